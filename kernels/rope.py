"""Rotary position embedding in the rotate-half (Hugging Face) layout.

Partial rotary (Phi-3/4's partial_rotary_factor): the angle table's width R = 2 x
frequencies may be below head_dim; then only each head's first R dims rotate (halves
[0, R/2) and [R/2, R)) and the rest pass through, as transformers' apply_rotary_pos_emb."""
from __future__ import annotations

import torch

from . import native


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
             meta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D], positions: [T], cos_sin: [max_pos, R] = [cos | sin]
    each over R/2 frequencies, R <= D (R < D: partial rotary). Returns rotated (q, k) in their
    own dtype. meta: the step's AttentionMetadata, where a backend keeps per-step state (this one
    keeps none)."""
    cs = cos_sin[positions].float()
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x):
        x1, x2, rest = x.float().split([half, half, x.shape[-1] - 2 * half], dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q and k as one [T, Hq + Hkv, D] view) where k's heads follow q's in memory, as in the
    fused qkv output: one rotation then costs what one of the two did (docs/benchmarks.md)."""
    t, hq, d = q.shape
    if (q.stride() == k.stride() and q.stride(1) == d and q.stride(2) == 1
            and k.data_ptr() == q.data_ptr() + hq * d * q.element_size() and k.shape[0] == t):
        return (q.as_strided((t, hq + k.shape[1], d), q.stride()),)
    return q, k


class _Angles:
    """The torch path's state for one step: the step's cos and sin, looked up once."""

    def __init__(self, meta, positions: torch.Tensor, cos_sin: torch.Tensor):
        cs = cos_sin[positions].float()
        half = cs.shape[-1] // 2
        self.positions, self.cos_sin = positions, cos_sin  # held: their ids are the state's key
        self.cos, self.sin = cs[:, None, :half].contiguous(), cs[:, None, half:].contiguous()


def native_fits(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    """Whether the C kernel (kernels/csrc/small_ops.c) takes this call: the library built, fp32
    q, k and angles, head_dim contiguous, int64 positions."""
    return (native.library() is not None and q.dtype == k.dtype == cos_sin.dtype == torch.float32
            and q.stride(2) == 1 and k.stride(2) == 1 and positions.dtype == torch.int64
            and positions.is_contiguous() and cos_sin.is_contiguous())


def rope_native(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_ref's contract, rotating q and k IN PLACE (as rope_triton does) in one C call (one for
    both where k's heads follow q's), for a call that native_fits()."""
    lib = native.library()
    for x in _adjacent(q, k):
        # The kernel's D is the table's width: it rotates each head's first D dims.
        lib.rope(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), x.stride(1), cos_sin.shape[1],
                 positions.data_ptr(), cos_sin.data_ptr(), torch.get_num_threads())
    return q, k


def rope_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               meta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU torch path, fp32: rope_ref's contract, rotating q and k IN PLACE, with the step's
    angles looked up once and kept in `meta`'s state for every layer. A batch-1 layer then runs
    5 small ops per tensor instead of about 10, allocating one half-width temporary instead of
    five full ones (docs/benchmarks.md, issue 17)."""
    key = (id(positions), id(cos_sin))  # valid while the state holds both tensors
    angles = _Angles(None, positions, cos_sin) if meta is None else meta.state_for(_Angles, key, positions, cos_sin)
    cos, sin = angles.cos, angles.sin
    half = cos.shape[-1]
    for x in _adjacent(q, k):
        x1, x2 = x[..., :half], x[..., half:2 * half]
        t = x1 * sin
        x1.mul_(cos).addcmul_(x2, sin, value=-1.0)  # x1 cos - x2 sin
        x2.mul_(cos).add_(t)  # x2 cos + x1 sin
    return q, k


# ---------------------------------------------------------------------------
# Triton: rotate Q and K in place, one launch for both. In place it reads and
# writes each element once (2 passes over Q/K); the reference makes about 13
# (fp32 cast 2, four half-width products 4, two sums 3, concatenation 2,
# downcast 2) and allocates new Q/K.

from .triton_utils import cdiv, interpreting, jit, next_pow2, tl  # noqa: E402


@jit
def _rotate(ptr, t, stride_t, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
            HALF: tl.constexpr, HALF_P: tl.constexpr, t_ok):
    h = tl.arange(0, HEADS_P)[None, :, None]
    j = tl.arange(0, HALF_P)[None, None, :]
    mask = t_ok[:, None, None] & (h < NUM_HEADS) & (j < HALF)
    base = ptr + t.to(tl.int64)[:, None, None] * stride_t + h * stride_h + j
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    tl.store(base, (x1 * c - x2 * s).to(ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * c + x1 * s).to(ptr.dtype.element_ty), mask=mask)


@jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, num_tokens, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                 NUM_Q: tl.constexpr, NUM_K: tl.constexpr, Q_P: tl.constexpr, K_P: tl.constexpr,
                 HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.int64)
    j = tl.arange(0, HALF_P)
    cs_mask = t_ok[:, None] & (j < HALF)[None, :]
    cos = tl.load(cs_ptr + pos[:, None] * stride_cs + j[None, :], mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos[:, None] * stride_cs + HALF + j[None, :], mask=cs_mask, other=0.0).to(tl.float32)
    _rotate(q_ptr, t, stride_qt, stride_qh, cos, sin, NUM_Q, Q_P, HALF, HALF_P, t_ok)
    _rotate(k_ptr, t, stride_kt, stride_kh, cos, sin, NUM_K, K_P, HALF, HALF_P, t_ok)


def rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rope_ref, but rotates q and k IN PLACE and returns them:
    callers must use the returned tensors and not keep the unrotated ones."""
    num_tokens, num_q, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and head_dim % 2 == 0, (q.shape, k.shape)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and q.dtype == k.dtype
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64)
    assert cos_sin.dim() == 2 and cos_sin.shape[1] <= head_dim and cos_sin.shape[1] % 2 == 0
    assert cos_sin.stride(-1) == 1
    assert q.device == k.device == positions.device == cos_sin.device
    if num_tokens == 0:
        return q, k
    num_k, half = k.shape[1], cos_sin.shape[1] // 2  # partial rotary: the kernel rotates 2 * half dims
    heads_p, half_p = next_pow2(max(num_q, num_k)), next_pow2(half)
    block_t = max(1, min(next_pow2(num_tokens), (16384 if interpreting(q) else 1024) // (heads_p * half_p)))
    _rope_kernel[(cdiv(num_tokens, block_t),)](
        q, k, positions, cos_sin, num_tokens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        num_q, num_k, next_pow2(num_q), next_pow2(num_k), half, half_p, block_t)
    return q, k
