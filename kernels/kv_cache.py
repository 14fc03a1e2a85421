"""KV-cache write: scatter new K/V through the slot mapping into the paged cache.

Cache layout, shared by every attention implementation:
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  k_scale, v_scale: [num_blocks, block_size, num_kv_heads] float16, FP8 caches only

FP8 rule: one scale per (token, KV head) = max(|x|) / 448, stored in float16 and
floored at 2**-14 so that it never underflows; values are divided by the stored
(rounded) scale and cast with round-to-nearest-even, saturating at +-448.
Per-token-head scales were chosen by measured accuracy (docs/benchmarks.md);
the fp16 scale costs 2 bytes per 64-value head, which keeps FP8 at 1.94x BF16's
tokens per byte.

A model's FP8 cache holds K and V rotated by a Hadamard matrix H (head_dim a power of two):
the attention layer (ridge/models/layers/decoder.py) writes K H and V H, attends with q H / D and turns
the output back by H / D, exact in the algebra (H H = D I: (q H / D) . (k H) = q . k and
sum p (v H) H / D = sum p v). The kernels here store and read whatever they are given. On
SmolLM2 it cut FP8 KV's KL from fp32 on code by a quarter and left prose's (docs/benchmarks.md).
"""
from __future__ import annotations

import functools

import torch

from . import native

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0 ** -14


FP8_KV_FORMAT = "K and V rotated by H, fp16 scale per (token, head)"  # in the prefix disk tier's key


@functools.lru_cache(maxsize=None)
def rotation(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """-> (H, H / D): the +-1 Sylvester Hadamard matrix [D, D] (symmetric, H H = D I; +-1 and a
    power-of-two divisor are exact in every dtype), or None where D is no power of two."""
    if head_dim < 2 or head_dim & (head_dim - 1):
        return None
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(dtype), (h / head_dim).to(dtype)


def fp8_kv_scale(x: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] -> per (token, head) scale [T, H] in SCALE_DTYPE."""
    amax = x.abs().amax(dim=-1).float()
    return (amax / FP8_MAX).clamp(min=MIN_SCALE).to(SCALE_DTYPE)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = fp8_kv_scale(x)
    q = (x.float() / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, slot_mapping: torch.Tensor,
                 meta=None) -> None:
    """key/value: [T, Hkv, D]; slot_mapping: [T] int64 (-1 skips the token). meta: the step's
    AttentionMetadata, where whether any of its slots is padding is asked once a step and kept
    for the other layers: the check is three ops and a host read, a third of a batch-1
    layer's write."""
    num_blocks, block_size, num_heads, head_dim = k_cache.shape
    assert key.shape == value.shape and key.shape[1:] == (num_heads, head_dim), (key.shape, k_cache.shape)
    assert slot_mapping.shape == (key.shape[0],)
    if meta is not None and meta.slot_mapping is slot_mapping:
        valid = meta.state_for(_all_slots_valid, None)
    else:
        valid = _all_slots_valid(None, slot_mapping)
    if not valid:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k = k_cache.view(num_blocks * block_size, num_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_heads, head_dim)
    if k_cache.dtype == FP8:
        assert k_scale is not None and v_scale is not None, "an FP8 cache needs its scales"
        key, ks = quantize_kv(key)
        value, vs = quantize_kv(value)
        k_scale.view(-1, num_heads).index_copy_(0, slot_mapping, ks)
        v_scale.view(-1, num_heads).index_copy_(0, slot_mapping, vs)
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    if k_cache.dtype == FP8:  # index_copy_ has no fp8 kernel on CPU; the bytes are what matter
        flat_k, flat_v, key, value = (t.view(torch.uint8) for t in (flat_k, flat_v, key, value))
    flat_k.index_copy_(0, slot_mapping, key)
    flat_v.index_copy_(0, slot_mapping, value)


def _all_slots_valid(meta, slot_mapping: torch.Tensor | None = None) -> bool:
    """No padding slot (-1) in the step's slot mapping (meta's, or the one given)."""
    return bool(((meta.slot_mapping if slot_mapping is None else slot_mapping) >= 0).all())


NATIVE_KV = {torch.float32: 0, FP8: 1, torch.bfloat16: 2}  # cache dtype -> the C kernels' `kind`


def native_fits(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, slot_mapping: torch.Tensor) -> bool:
    """Whether the C kernel (kernels/csrc/small_ops.c) takes this call: the library built, fp32
    rows with contiguous heads, an fp32, bf16 or FP8 cache (FP8 with its fp16 scales), contiguous,
    and an int64 slot mapping."""
    _, _, num_heads, head_dim = k_cache.shape
    fp8 = k_cache.dtype == FP8
    return (native.library() is not None and NATIVE_KV.get(k_cache.dtype) is not None
            and v_cache.dtype == k_cache.dtype and key.dtype == value.dtype == torch.float32
            and key.shape == value.shape and key.shape[1:] == (num_heads, head_dim)
            and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (key, value))
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and (not fp8 or (k_scale is not None and v_scale is not None
                             and k_scale.dtype == v_scale.dtype == SCALE_DTYPE
                             and k_scale.is_contiguous() and v_scale.is_contiguous()))
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and slot_mapping.shape == (key.shape[0],))


def write_kv_native(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, slot_mapping: torch.Tensor,
                    meta=None) -> None:
    """write_kv_ref's contract, byte for byte, in one C call for K and V (FP8 quantized there by
    the same rule; -1 slots skipped there, so no per-step state), for a call that native_fits()."""
    num_blocks, block_size, num_heads, head_dim = k_cache.shape
    fp8 = k_cache.dtype == FP8
    rc = native.library().write_kv(
        key.data_ptr(), value.data_ptr(), key.shape[0], key.stride(0), value.stride(0), num_heads, head_dim,
        slot_mapping.data_ptr(), num_blocks * block_size, k_cache.data_ptr(), v_cache.data_ptr(),
        k_scale.data_ptr() if fp8 else None, v_scale.data_ptr() if fp8 else None, NATIVE_KV[k_cache.dtype])
    if rc != 0:
        raise IndexError(f"write_kv: a slot past the cache's {num_blocks * block_size} slots")


# ---------------------------------------------------------------------------
# Triton: one pass over the new K (or V) rows: amax, scale, quantize, scatter:
# read once, write once. The reference makes about 13 passes (abs 2, amax 1,
# fp32 cast 2, divide 2, clamp 2, fp8 cast 2, index_copy 2) plus 2 for the
# boolean compaction of skipped rows, and syncs the host to do it.

from .triton_utils import cdiv, interpreting, jit, native_fp8, next_pow2, tl  # noqa: E402

_PLAIN, _FP8_NATIVE, _FP8_STAGED = 0, 1, 2


@jit
def _write_kv_kernel(x_ptr, slot_ptr, cache_ptr, scale_ptr, staged_ptr, num_tokens, stride_xt, stride_xh,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_P: tl.constexpr, DIM_P: tl.constexpr,
                     BLOCK_T: tl.constexpr, MODE: tl.constexpr):
    # MODE 0: store in the cache dtype. 1: FP8, quantized here. 2: FP8 scale computed here,
    # scaled fp32 values staged per token for torch to round (interpreter, pre-sm_89).
    t1 = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [T]
    h1 = tl.arange(0, HEADS_P)  # [H]
    slot1 = tl.load(slot_ptr + t1, mask=t1 < num_tokens, other=-1).to(tl.int64)
    keep1 = (t1 < num_tokens) & (slot1 >= 0)
    t, slot, keep = t1[:, None, None], slot1[:, None, None], keep1[:, None, None]  # [T, 1, 1]
    h = h1[None, :, None]  # [1, H, 1]
    d = tl.arange(0, DIM_P)[None, None, :]  # [1, 1, D]
    mask = keep & (h < NUM_HEADS) & (d < HEAD_DIM)
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
    dst = cache_ptr + slot * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    if MODE == 0:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        # scale = max(amax / 448, 2^-14) rounded to fp16; values divide by the ROUNDED scale.
        amax = tl.max(tl.abs(x), axis=2)  # [T, H]
        scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 2.0 ** -14)
        scale = scale.to(tl.float16)
        smask = keep1[:, None] & (h1[None, :] < NUM_HEADS)
        tl.store(scale_ptr + slot1[:, None] * NUM_HEADS + h1[None, :], scale, mask=smask)
        y = tl.math.div_rn(x, tl.broadcast_to(scale.to(tl.float32)[:, :, None], x.shape))
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if MODE == 1:
            tl.store(dst, y.to(tl.float8e4nv), mask=mask)
        else:
            tl.store(staged_ptr + t.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + d, y, mask=mask)


def _launch_write(x, slot_mapping, cache, scale, staged, mode: int) -> None:
    num_tokens, num_heads, head_dim = x.shape
    heads_p, dim_p = next_pow2(num_heads), next_pow2(head_dim)
    # Interpreter: few, large programs (each loop step costs milliseconds). GPU: ~2K elements each.
    per_prog = 16384 if interpreting(x) else 2048
    block_t = max(1, min(next_pow2(num_tokens), per_prog // (heads_p * dim_p)))
    _write_kv_kernel[(cdiv(num_tokens, block_t),)](
        x, slot_mapping, cache, scale, staged, num_tokens, x.stride(0), x.stride(1),
        num_heads, head_dim, heads_p, dim_p, block_t, mode)


def _write_one(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    if cache.dtype != FP8:
        _launch_write(x, slot_mapping, cache, cache, cache, _PLAIN)
    elif native_fp8(x) and not interpreting(x):
        _launch_write(x, slot_mapping, cache, scale, cache, _FP8_NATIVE)
    else:
        # Staged: the kernel scales and saturates, torch rounds to nearest even, and a
        # plain byte scatter places the rows (no host sync, so CUDA graphs can capture it).
        staged = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        _launch_write(x, slot_mapping, cache, scale, staged, _FP8_STAGED)
        q8 = staged.to(FP8).view(torch.uint8)
        _launch_write(q8, slot_mapping, cache.view(torch.uint8), cache, cache, _PLAIN)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, slot_mapping: torch.Tensor,
                    meta=None) -> None:
    """Same contract as write_kv_ref (no per-step state: the kernel skips -1 slots itself). key/value may be strided views (rows of a fused qkv)."""
    num_blocks, block_size, num_heads, head_dim = k_cache.shape
    assert key.shape == value.shape and key.shape[1:] == (num_heads, head_dim), (key.shape, k_cache.shape)
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert slot_mapping.shape == (key.shape[0],) and slot_mapping.dtype == torch.int64
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    assert key.device == k_cache.device == slot_mapping.device
    if k_cache.dtype == FP8:
        assert k_scale is not None and v_scale is not None, "an FP8 cache needs its scales"
        assert k_scale.dtype == SCALE_DTYPE and k_scale.shape == k_cache.shape[:3] and k_scale.is_contiguous()
        assert v_scale.dtype == SCALE_DTYPE and v_scale.shape == v_cache.shape[:3] and v_scale.is_contiguous()
    if key.shape[0] == 0:
        return
    _write_one(key, k_cache, k_scale, slot_mapping)
    _write_one(value, v_cache, v_scale, slot_mapping)
