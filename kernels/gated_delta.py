"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next), over a varlen batch whose states
live in a slot pool (kernels/varlen.py).

Per value head, a state S [Dk, Dv] and, for each token with key k, value v, query q, log decay g
and learning rate beta:
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T (scale q)
(transformers' torch_recurrent_gated_delta_rule). q and k may be L2-normalized first
(use_qk_l2norm, as the models call it); each q/k head serves Hv / Hk consecutive value heads.

Two forms: the chunked one for prefill (chunks of 64 tokens: within a chunk the delta updates are
condensed by the WY/UT transform, T = (I + strict_lower(beta K K^T * decay))^-1, so a chunk costs
a few matrix products and the state is touched once a chunk), and the recurrent one, token by
token, for decode and speculative verification (few tokens a request). On CPU kernels/ops.py
runs the C token loop for both (the chunked form's extra arithmetic buys parallelism a CPU lacks).

Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state_pool [S, Hv, Dk, Dv] (fp32 or
bf16; arithmetic in fp32); output [T, Hv, Dv] in v's dtype."""
from __future__ import annotations

import torch

from . import native
from .varlen import Varlen, by_request, check_token_slots, check_varlen, initial_state

CHUNK = 64
L2_EPS = 1e-6  # the models' (FLA's) eps: x * rsqrt(sum(x^2) + eps)


def _check(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale) -> tuple[Varlen, float]:
    assert q.dim() == 3, f"q: want [T, Hk, Dk], got {tuple(q.shape)}"
    t, hk, dk = q.shape
    assert k.shape == q.shape, f"k: want {tuple(q.shape)} as q, got {tuple(k.shape)}"
    assert v.dim() == 3 and v.shape[0] == t, f"v: want [{t}, Hv, Dv], got {tuple(v.shape)}"
    hv, dv = v.shape[1:]
    assert hv % hk == 0, f"v: its {hv} heads must be a multiple of q/k's {hk}"
    assert g.shape == (t, hv), f"g: want [{t}, {hv}], got {tuple(g.shape)}"
    assert beta.shape == (t, hv), f"beta: want [{t}, {hv}], got {tuple(beta.shape)}"
    assert state_pool.dim() == 4 and state_pool.shape[1:] == (hv, dk, dv), \
        f"state_pool: want [slots, {hv}, {dk}, {dv}], got {tuple(state_pool.shape)}"
    assert state_pool.dtype in (torch.float32, torch.bfloat16), f"state_pool: fp32 or bf16, got {state_pool.dtype}"
    assert state_pool.is_contiguous(), "state_pool: must be contiguous"
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        assert x.device == state_pool.device, f"{name}: on {x.device}, the state pool on {state_pool.device}"
        assert x.dtype.is_floating_point, f"{name}: want a float tensor, got {x.dtype}"
    return (check_varlen(t, cu_seqlens, state_slots, state_pool.shape[0], has_initial_state, q.device),
            dk ** -0.5 if scale is None else float(scale))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """-> fp32 q (normed, scaled), k (normed), v, g, beta, with q/k heads repeated per value head."""
    group = v.shape[1] // k.shape[1]
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * scale
    if group > 1:
        qf, kf = qf.repeat_interleave(group, dim=1), kf.repeat_interleave(group, dim=1)
    return qf, kf, v.float(), g.float(), beta.float()


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + a)^-1 for strictly lower a [..., n, n], by forward substitution over rows: with
    X = (I + a)^-1 - I, X_i = -a_i - sum_j a_ij X_j. On CPU ten times faster than
    torch.linalg.solve_triangular on these batches of 64 x 64 (measured: 117 against 1,363 ms for
    32 heads x 4 chunks, 2 threads)."""
    x = -a
    for i in range(1, a.shape[-1]):
        x[..., i, :i] = x[..., i, :i] + (x[..., i, :i, None] * x[..., :i, :i]).sum(-2)
    return x + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)


def _chunked_one(q, k, v, g, beta, state, chunk: int):
    """One request: q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H] fp32 (prepared), state [H, Dk, Dv]
    -> (o [L, H, Dv], final state). Within a chunk, with gc the cumulative log decay and
    D[i, j] = exp(gc_i - gc_j) for j <= i, the chunk's token-by-token delta updates equal
        T = (I + strict_lower(beta_i k_i.k_j D_ij))^-1      (the UT transform of the WY form)
        u = T (beta v),  w = T (beta exp(gc) k),  v' = u - w S
        o = exp(gc) q S + lower(q k^T * D) v',  S <- exp(gc_last) S + (exp(gc_last - gc) k)^T v'."""
    length = q.shape[0]
    pad = (-length) % chunk
    h = q.shape[1]

    def blocks(x):  # [L, H, ...] -> [H, C, chunk, ...], zero-padded
        x = x.transpose(0, 1)
        x = torch.nn.functional.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(h, -1, chunk, *x.shape[2:])

    q, k, v, g, beta = map(blocks, (q, k, v, g, beta))
    gc = g.cumsum(-1)  # [H, C, chunk]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    t_inv = _unit_lower_inverse(((kb @ k.transpose(-1, -2)) * decay).tril(-1))
    u = t_inv @ (v * beta[..., None])
    w = t_inv @ (kb * gc.exp()[..., None])
    attn = (q @ k.transpose(-1, -2)) * decay
    qd = q * gc.exp()[..., None]
    g_last = gc[..., -1]  # [H, C]: the padded tail adds no decay
    kd = k * (g_last[..., None] - gc).exp()[..., None]
    out = torch.empty_like(u)
    for c in range(q.shape[1]):
        v_new = u[:, c] - w[:, c] @ state
        out[:, c] = qd[:, c] @ state + attn[:, c] @ v_new
        state = state * g_last[:, c, None, None].exp() + kd[:, c].transpose(-1, -2) @ v_new
    return out.reshape(h, -1, out.shape[-1])[:, :length].transpose(0, 1), state


def _recurrent_one(q, k, v, g, beta, state, on_token=None):
    """One request token by token (the rule as the module docstring states it); on_token(i, S)
    sees the state after each token."""
    out = torch.empty_like(v)
    for i in range(q.shape[0]):
        state = state * g[i].exp()[:, None, None]
        delta = (v[i] - torch.einsum("hkv,hk->hv", state, k[i])) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        out[i] = torch.einsum("hkv,hk->hv", state, q[i])
        if on_token is not None:
            on_token(i, state)
    return out, state


def gated_delta_rule_chunk_ref(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state=None, *,
                               scale: float | None = None, use_qk_l2norm: bool = False, chunk_size: int = CHUNK):
    """The chunked form over a varlen batch: -> o [T, Hv, Dv]; each request's final state written to
    its slot. The CPU path of prefill where ridge's C kernels are not built (kernels/ops.py: where
    they are, their token loop runs faster on CPU)."""
    var, scale = _check(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    out = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    bounds = var.bounds
    for n in range(var.num_seqs):
        a, b = bounds[n], bounds[n + 1]
        state = initial_state(state_pool, var, n)
        if b > a:
            out[a:b], state = _chunked_one(qf[a:b], kf[a:b], vf[a:b], gf[a:b], bf[a:b], state, chunk_size)
        state_pool[int(var.state_slots[n])] = state.to(state_pool.dtype)
    return out.to(v.dtype)


def gated_delta_rule_recurrent_ref(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state=None, *,
                                   scale: float | None = None, use_qk_l2norm: bool = False,
                                   token_state_slots: torch.Tensor | None = None):
    """The recurrent form, token by token: the chunked form's contract, and token_state_slots [T]
    (optional) where the state after each token is also written (-1: not kept)."""
    var, scale = _check(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale)
    tok = check_token_slots(token_state_slots, var, q.shape[0], state_pool.shape[0], q.device)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    out = torch.empty(vf.shape, dtype=torch.float32, device=v.device)

    def run(a, b, initial, keep):
        out[a:b], state = _recurrent_one(qf[a:b], kf[a:b], vf[a:b], gf[a:b], bf[a:b], initial, keep)
        return state

    by_request(var, state_pool, tok, run)
    return out.to(v.dtype)


# ---------------------------------------------------------------------------
# C: the recurrent form (kernels/csrc/recurrent.c), the decode hot path on CPU.

MAX_NATIVE_DIM = 1024  # the C kernel's per-token buffers live on its stack


def native_fits(q, k, v, g, beta, state_pool) -> bool:
    """Whether the C kernel takes this call: the library built, fp32 throughout, each token's heads
    contiguous (q, k, v may be views of one fused projection's rows), g and beta contiguous."""
    if native.library() is None or state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        return False
    if any(x.dtype != torch.float32 for x in (q, k, v, g, beta)) or q.device.type != "cpu":
        return False
    heads_contiguous = all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k, v))
    return (heads_contiguous and g.is_contiguous() and beta.is_contiguous()
            and max(q.shape[2], v.shape[2]) <= MAX_NATIVE_DIM)


def gated_delta_rule_recurrent_native(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state=None,
                                      *, scale: float | None = None, use_qk_l2norm: bool = False,
                                      token_state_slots: torch.Tensor | None = None):
    """gated_delta_rule_recurrent_ref's contract in one C call, for a call that native_fits()."""
    var, scale = _check(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale)
    tok = check_token_slots(token_state_slots, var, q.shape[0], state_pool.shape[0], q.device)
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.empty((t, hv, dv), dtype=torch.float32)
    rc = native.library().gdn_recurrent(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0), g.data_ptr(), beta.data_ptr(),
        out.data_ptr(), state_pool.data_ptr(), var.cu_seqlens.data_ptr(), var.state_slots.data_ptr(),
        var.has_initial_state.data_ptr(), None if tok is None else tok.data_ptr(), var.num_seqs, hk, hv, dk, dv, scale,
        int(use_qk_l2norm), torch.get_num_threads())
    assert rc == 0, f"gdn_recurrent: failed ({rc})"
    return out


# ---------------------------------------------------------------------------
# Triton. One program per (request, value head, block of Dv): it holds the state's [Dk, BV] slice
# in registers for the whole request and writes it back once (the chunked form) or after each
# token where token_state_slots asks (the recurrent one). Loads are cast to fp32 (the interpreter
# computes bf16 arithmetic wrongly, and the state wants fp32 anyway).

from .triton_utils import interpreting, jit, next_pow2, tl  # noqa: E402


def _dot_precision(t: torch.Tensor) -> str:
    """fp32 products: tf32 alone loses ~1e-3 a product and the state carries it across chunks;
    tf32x3 keeps fp32's accuracy on tensor cores. The interpreter computes exactly either way."""
    return "ieee" if interpreting(t) else "tf32x3"


@jit
def _gdn_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, pool_ptr, cu_ptr, slot_ptr, init_ptr,
                      s_qt, s_kt, s_vt, s_gt, s_bt, num_v_heads, scale,
                      GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      BT: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(cu_ptr + n)
    length = tl.load(cu_ptr + n + 1) - start
    slot = tl.load(slot_ptr + n).to(tl.int64)
    # a [BK, BV] mask: a scalar mask broadcast into a tensor one has no dtype the interpreter takes
    has_init = (tl.zeros([BK, BV], tl.int32) + tl.load(init_ptr + n).to(tl.int32)) != 0
    hk = h // GROUP
    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    s_ptrs = pool_ptr + (slot * num_v_heads + h) * (DK * DV) + rk[:, None] * DV + rv[None, :]
    S = tl.load(s_ptrs, mask=mk[:, None] & mv[None, :] & has_init, other=0.0).to(tl.float32)  # [BK, BV]
    ri = tl.arange(0, BT)
    lower = ri[:, None] >= ri[None, :]
    strict = ri[:, None] > ri[None, :]
    eye = tl.where(ri[:, None] == ri[None, :], 1.0, 0.0)
    for c0 in range(0, length, BT):
        mt = c0 + ri < length
        row = (start + c0 + ri).to(tl.int64)
        m_k = mt[:, None] & mk[None, :]
        k = tl.load(k_ptr + row[:, None] * s_kt + hk * DK + rk[None, :], mask=m_k, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row[:, None] * s_qt + hk * DK + rk[None, :], mask=m_k, other=0.0).to(tl.float32)
        if L2NORM:
            k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
            q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None]
        q = q * scale
        v = tl.load(v_ptr + row[:, None] * s_vt + h * DV + rv[None, :], mask=mt[:, None] & mv[None, :],
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * s_gt + h, mask=mt, other=0.0).to(tl.float32)
        b = tl.load(beta_ptr + row * s_bt + h, mask=mt, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)
        g_last = tl.sum(g, 0)  # padded rows add no decay
        decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
        kb = k * b[:, None]
        # X = T - I by forward substitution, row by row: X_i = M_i + sum_j M_ij X_j, M = -strict(A)
        x = -tl.where(strict, tl.dot(kb, tl.trans(k), input_precision=PREC) * decay, 0.0)
        for i in range(1, BT):
            a = tl.sum(tl.where(ri[:, None] == i, x, 0.0), axis=0)
            a = a + tl.sum(a[:, None] * x, axis=0) * (ri < i)
            x = tl.where(ri[:, None] == i, a[None, :], x)
        t_inv = x + eye
        u = tl.dot(t_inv, v * b[:, None], input_precision=PREC)
        w = tl.dot(t_inv, kb * tl.exp(gc)[:, None], input_precision=PREC)
        v_new = u - tl.dot(w, S, input_precision=PREC)
        attn = tl.dot(q, tl.trans(k), input_precision=PREC) * decay
        o = tl.dot(q * tl.exp(gc)[:, None], S, input_precision=PREC) + tl.dot(attn, v_new, input_precision=PREC)
        tl.store(o_ptr + (row[:, None] * num_v_heads + h) * DV + rv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
        kd = k * tl.exp(g_last - gc)[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(kd), v_new, input_precision=PREC)
    tl.store(s_ptrs, S.to(pool_ptr.dtype.element_ty), mask=mk[:, None] & mv[None, :])


@jit
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, pool_ptr, cu_ptr, slot_ptr, init_ptr, tok_ptr,
                          s_qt, s_kt, s_vt, s_gt, s_bt, num_v_heads, scale,
                          GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, L2NORM: tl.constexpr, TOKEN_SLOTS: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(cu_ptr + n)
    end = tl.load(cu_ptr + n + 1)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    has_init = (tl.zeros([BK, BV], tl.int32) + tl.load(init_ptr + n).to(tl.int32)) != 0
    hk = h // GROUP
    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    m_s = mk[:, None] & mv[None, :]
    head = h * (DK * DV) + rk[:, None] * DV + rv[None, :]
    S = tl.load(pool_ptr + slot * num_v_heads * (DK * DV) + head, mask=m_s & has_init, other=0.0).to(tl.float32)
    for i in range(0, end - start):
        t64 = start.to(tl.int64) + i
        k = tl.load(k_ptr + t64 * s_kt + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + t64 * s_qt + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
        if L2NORM:
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        v = tl.load(v_ptr + t64 * s_vt + h * DV + rv, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t64 * s_gt + h).to(tl.float32)
        b = tl.load(beta_ptr + t64 * s_bt + h).to(tl.float32)
        S = S * tl.exp(g)
        delta = (v - tl.sum(S * k[:, None], axis=0)) * b
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * (q * scale)[:, None], axis=0)
        tl.store(o_ptr + (t64 * num_v_heads + h) * DV + rv, o.to(o_ptr.dtype.element_ty), mask=mv)
        if TOKEN_SLOTS:
            keep = tl.load(tok_ptr + t64)
            tl.store(pool_ptr + keep * num_v_heads * (DK * DV) + head, S.to(pool_ptr.dtype.element_ty),
                     mask=m_s & ((tl.zeros([BK, BV], tl.int64) + keep) >= 0))
    tl.store(pool_ptr + slot * num_v_heads * (DK * DV) + head, S.to(pool_ptr.dtype.element_ty), mask=m_s)


def _launch_args(q, k, v, g, beta):
    """The kernels address each token's heads as row * stride + head * D + i: heads contiguous."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert x.stride(2) == 1 and x.stride(1) == x.shape[2], f"{name}: each token's heads must be contiguous"
    for name, x in (("g", g), ("beta", beta)):
        assert x.stride(1) == 1, f"{name}: its heads must be contiguous"
    dk, dv = q.shape[2], v.shape[2]
    bk = max(16, next_pow2(dk))
    bv = max(16, min(64, next_pow2(dv)))
    return dk, dv, bk, bv


def gated_delta_rule_chunk_triton(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state=None, *,
                                  scale: float | None = None, use_qk_l2norm: bool = False, chunk_size: int = CHUNK):
    """gated_delta_rule_chunk_ref's contract (chunk_size: a power of two, at least 16)."""
    var, scale = _check(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale)
    assert chunk_size >= 16 and chunk_size == next_pow2(chunk_size), f"chunk_size: a power of two >= 16, got {chunk_size}"
    dk, dv, bk, bv = _launch_args(q, k, v, g, beta)
    t, hv = v.shape[:2]
    out = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    if var.num_seqs:
        grid = (var.num_seqs, hv, -(-dv // bv))
        _gdn_chunk_kernel[grid](q, k, v, g, beta, out, state_pool, var.cu_seqlens, var.state_slots,
                                var.has_initial_state, q.stride(0), k.stride(0), v.stride(0), g.stride(0),
                                beta.stride(0), hv, scale, hv // k.shape[1], dk, dv, bk, bv, chunk_size,
                                use_qk_l2norm, _dot_precision(q), num_warps=4)
    return out


def gated_delta_rule_recurrent_triton(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state=None,
                                      *, scale: float | None = None, use_qk_l2norm: bool = False,
                                      token_state_slots: torch.Tensor | None = None):
    """gated_delta_rule_recurrent_ref's contract."""
    var, scale = _check(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale)
    tok = check_token_slots(token_state_slots, var, q.shape[0], state_pool.shape[0], q.device)
    dk, dv, bk, bv = _launch_args(q, k, v, g, beta)
    t, hv = v.shape[:2]
    out = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    if var.num_seqs:
        grid = (var.num_seqs, hv, -(-dv // bv))
        _gdn_recurrent_kernel[grid](q, k, v, g, beta, out, state_pool, var.cu_seqlens, var.state_slots,
                                    var.has_initial_state, var.cu_seqlens if tok is None else tok, q.stride(0),
                                    k.stride(0), v.stride(0), g.stride(0), beta.stride(0), hv, scale,
                                    hv // k.shape[1], dk, dv, bk, bv, use_qk_l2norm, tok is not None, num_warps=4)
    return out
