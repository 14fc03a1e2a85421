"""Mamba2's selective scan (SSD: Granite 4 hybrid, Nemotron-H), over a varlen batch whose states
live in a slot pool (kernels/varlen.py).

Per head h, a state S [P, N] and, for each token with input x [P], time step dt, B and C [N] (of
the head's group, h // (H / G)):
    dt' = clamp(softplus?(dt + dt_bias[h]), dt_limit);  S <- exp(dt' A[h]) S + dt' x B^T;
    y = S C + D[h] x
(transformers' mamba2_selective_state_update, and mamba2_chunk_scan in chunks).

Two forms: the chunked one for prefill (within a chunk the scan is a masked attention-like
product, C B^T weighted by the decays, plus the state carried in; the state is touched once a
chunk), and the recurrent one, token by token, for decode and speculative verification. On CPU
kernels/ops.py runs the C token loop for both (the chunked form's extra arithmetic buys
parallelism a CPU lacks).

Shapes: x [T, H, P]; dt [T, H]; A [H] (negative: -exp(A_log)); B, C [T, G, N]; D, dt_bias [H] or
None; state_pool [S, H, P, N] (fp32 or bf16; arithmetic in fp32); output [T, H, P] in x's dtype.
Rows of x, dt, B and C may be strided views of one fused projection."""
from __future__ import annotations

import math

import torch

from . import native
from .varlen import Varlen, by_request, check_token_slots, check_varlen, initial_state

CHUNK = 64  # any chunk gives the same scan: 64 keeps a Triton program's tiles in registers
MAX_NATIVE_DIM = 1024


def _check(x, dt, A, B, C, D, dt_bias, state_pool, cu_seqlens, state_slots, has_initial_state) -> Varlen:
    assert x.dim() == 3, f"x: want [T, H, P], got {tuple(x.shape)}"
    t, h, p = x.shape
    assert dt.shape == (t, h), f"dt: want [{t}, {h}], got {tuple(dt.shape)}"
    assert A.shape == (h,), f"A: want [{h}], got {tuple(A.shape)}"
    assert B.dim() == 3 and B.shape[0] == t, f"B: want [{t}, G, N], got {tuple(B.shape)}"
    assert C.shape == B.shape, f"C: want {tuple(B.shape)} as B, got {tuple(C.shape)}"
    g, n = B.shape[1:]
    assert h % g == 0, f"B: its {g} groups must divide the {h} heads"
    assert D is None or D.shape == (h,), f"D: want [{h}], got {tuple(D.shape)}"
    assert dt_bias is None or dt_bias.shape == (h,), f"dt_bias: want [{h}], got {tuple(dt_bias.shape)}"
    assert state_pool.dim() == 4 and state_pool.shape[1:] == (h, p, n), \
        f"state_pool: want [slots, {h}, {p}, {n}], got {tuple(state_pool.shape)}"
    assert state_pool.dtype in (torch.float32, torch.bfloat16), f"state_pool: fp32 or bf16, got {state_pool.dtype}"
    assert state_pool.is_contiguous(), "state_pool: must be contiguous"
    for name, y in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias)):
        assert y is None or y.device == state_pool.device, f"{name}: on {y.device}, the pool on {state_pool.device}"
    return check_varlen(t, cu_seqlens, state_slots, state_pool.shape[0], has_initial_state, x.device)


def _limits(dt_limit) -> tuple[float, float]:
    lo, hi = dt_limit
    assert lo <= hi, f"dt_limit: want (lo, hi) with lo <= hi, got {dt_limit}"
    return float(lo), float(hi)


def _prepare(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit):
    """-> fp32 x, dt' [T, H], A, and B, C repeated per head [T, H, N]."""
    group = x.shape[1] // B.shape[1]
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = torch.nn.functional.softplus(d)
    d = d.clamp(*dt_limit)
    return (x.float(), d, A.float(), B.float().repeat_interleave(group, dim=1),
            C.float().repeat_interleave(group, dim=1))


def _chunked_one(x, dt, A, B, C, state, chunk: int):
    """One request: x [L, H, P], dt [L, H] (dt'), B, C [L, H, N] fp32, state [H, P, N] -> (y without
    the D skip [L, H, P], final state). With acs the cumulative dt' A within a chunk,
        y = (C B^T * exp(acs_i - acs_j))_{j<=i} (dt' x) + exp(acs) C S^T,
        S <- exp(acs_last) S + (exp(acs_last - acs) dt' x)^T B."""
    length, h = x.shape[:2]
    pad = (-length) % chunk

    def blocks(y):  # [L, H, ...] -> [H, c, chunk, ...], zero-padded (dt' = 0 there: no decay, no input)
        y = y.transpose(0, 1)
        y = torch.nn.functional.pad(y, (0, 0, 0, pad) if y.dim() == 3 else (0, pad))
        return y.reshape(h, -1, chunk, *y.shape[2:])

    xdt, B, C, a = map(blocks, (x * dt[..., None], B, C, dt * A))
    acs = a.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (acs[..., :, None] - acs[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    y = ((C @ B.transpose(-1, -2)) * decay) @ xdt  # [H, c, chunk, P]
    a_last = acs[..., -1]
    xin = xdt * (a_last[..., None] - acs).exp()[..., None]
    for c in range(xdt.shape[1]):
        y[:, c] += acs[:, c].exp()[..., None] * (C[:, c] @ state.transpose(-1, -2))
        state = state * a_last[:, c, None, None].exp() + xin[:, c].transpose(-1, -2) @ B[:, c]
    return y.reshape(h, -1, y.shape[-1])[:, :length].transpose(0, 1), state


def _recurrent_one(x, dt, A, B, C, state, on_token=None):
    y = torch.empty_like(x)
    for i in range(x.shape[0]):
        state = state * (dt[i] * A).exp()[:, None, None] + (dt[i][:, None] * x[i])[:, :, None] * B[i][:, None, :]
        y[i] = torch.einsum("hpn,hn->hp", state, C[i])
        if on_token is not None:
            on_token(i, state)
    return y, state


def ssd_chunk_scan_ref(x, dt, A, B, C, state_pool, cu_seqlens, state_slots, has_initial_state=None, *, D=None,
                       dt_bias=None, dt_softplus: bool = True, dt_limit=(0.0, math.inf), chunk_size: int = CHUNK):
    """The chunked form over a varlen batch: -> y [T, H, P]; each request's final state written to
    its slot. The CPU path of prefill where ridge's C kernels are not built (kernels/ops.py: where
    they are, their token loop runs faster on CPU)."""
    var = _check(x, dt, A, B, C, D, dt_bias, state_pool, cu_seqlens, state_slots, has_initial_state)
    xf, d, af, bf, cf = _prepare(x, dt, A, B, C, dt_bias, dt_softplus, _limits(dt_limit))
    y = torch.empty(xf.shape, dtype=torch.float32, device=x.device)
    bounds = var.bounds
    for n in range(var.num_seqs):
        a, b = bounds[n], bounds[n + 1]
        state = initial_state(state_pool, var, n)
        if b > a:
            y[a:b], state = _chunked_one(xf[a:b], d[a:b], af, bf[a:b], cf[a:b], state, chunk_size)
        state_pool[int(var.state_slots[n])] = state.to(state_pool.dtype)
    if D is not None:
        y += D.float()[:, None] * xf
    return y.to(x.dtype)


def ssd_state_update_ref(x, dt, A, B, C, state_pool, cu_seqlens, state_slots, has_initial_state=None, *, D=None,
                         dt_bias=None, dt_softplus: bool = True, dt_limit=(0.0, math.inf),
                         token_state_slots: torch.Tensor | None = None):
    """The recurrent form, token by token: the chunked form's contract, and token_state_slots [T]
    (optional) where the state after each token is also written (-1: not kept)."""
    var = _check(x, dt, A, B, C, D, dt_bias, state_pool, cu_seqlens, state_slots, has_initial_state)
    tok = check_token_slots(token_state_slots, var, x.shape[0], state_pool.shape[0], x.device)
    xf, d, af, bf, cf = _prepare(x, dt, A, B, C, dt_bias, dt_softplus, _limits(dt_limit))
    y = torch.empty(xf.shape, dtype=torch.float32, device=x.device)

    def run(a, b, initial, keep):
        y[a:b], state = _recurrent_one(xf[a:b], d[a:b], af, bf[a:b], cf[a:b], initial, keep)
        return state

    by_request(var, state_pool, tok, run)
    if D is not None:
        y += D.float()[:, None] * xf
    return y.to(x.dtype)


# ---------------------------------------------------------------------------
# C: the recurrent form (kernels/csrc/recurrent.c), the decode hot path on CPU.

def native_fits(x, dt, A, B, C, D, dt_bias, state_pool) -> bool:
    """Whether the C kernel takes this call: the library built, fp32 throughout, each token's heads
    (x) and groups (B, C) contiguous, dt's heads contiguous."""
    if native.library() is None or x.device.type != "cpu" or state_pool.dtype != torch.float32:
        return False
    if any(y is not None and y.dtype != torch.float32 for y in (x, dt, A, B, C, D, dt_bias)):
        return False
    return (x.stride(2) == 1 and x.stride(1) == x.shape[2] and dt.stride(1) == 1
            and all(y.stride(2) == 1 and y.stride(1) == y.shape[2] for y in (B, C))
            and all(y is None or y.is_contiguous() for y in (A, D, dt_bias)) and x.shape[2] <= MAX_NATIVE_DIM)


def ssd_state_update_native(x, dt, A, B, C, state_pool, cu_seqlens, state_slots, has_initial_state=None, *, D=None,
                            dt_bias=None, dt_softplus: bool = True, dt_limit=(0.0, math.inf),
                            token_state_slots: torch.Tensor | None = None):
    """ssd_state_update_ref's contract in one C call, for a call that native_fits()."""
    var = _check(x, dt, A, B, C, D, dt_bias, state_pool, cu_seqlens, state_slots, has_initial_state)
    tok = check_token_slots(token_state_slots, var, x.shape[0], state_pool.shape[0], x.device)
    lo, hi = _limits(dt_limit)
    t, h, p = x.shape
    g, n = B.shape[1:]
    y = torch.empty((t, h, p), dtype=torch.float32)
    rc = native.library().ssd_update(
        x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(), B.data_ptr(), B.stride(0), C.data_ptr(),
        C.stride(0), None if D is None else D.data_ptr(), None if dt_bias is None else dt_bias.data_ptr(),
        int(dt_softplus), lo, hi, y.data_ptr(), state_pool.data_ptr(), var.cu_seqlens.data_ptr(),
        var.state_slots.data_ptr(), var.has_initial_state.data_ptr(), None if tok is None else tok.data_ptr(),
        var.num_seqs, h, g, p, n, torch.get_num_threads())
    assert rc == 0, f"ssd_update: failed ({rc})"
    return y


# ---------------------------------------------------------------------------
# Triton. One program per (request, head, block of P): it holds the state's [BP, N] slice in
# registers for the whole request and writes it back once (the chunked form) or after each token
# where token_state_slots asks (the recurrent one). Loads are cast to fp32.

from .triton_utils import interpreting, jit, next_pow2, tl  # noqa: E402


@jit
def _dt(d, bias_ptr, h, lo, hi, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """dt' from the loaded dt (a value or a vector)."""
    d = d.to(tl.float32)
    if HAS_BIAS:
        d += tl.load(bias_ptr + h).to(tl.float32)
    if SOFTPLUS:  # torch's threshold: above 20, x itself
        d = tl.where(d > 20.0, d, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))))
    return tl.minimum(tl.maximum(d, lo), hi)


@jit
def _ssd_chunk_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, bias_ptr, y_ptr, pool_ptr, cu_ptr, slot_ptr,
                      init_ptr, s_xt, s_dt, s_bt, s_ct, num_heads, lo, hi,
                      HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr,
                      BN: tl.constexpr, BT: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SOFTPLUS: tl.constexpr, PREC: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(cu_ptr + n).to(tl.int64)
    length = tl.load(cu_ptr + n + 1).to(tl.int64) - start
    slot = tl.load(slot_ptr + n).to(tl.int64)
    has_init = (tl.zeros([BP, BN], tl.int32) + tl.load(init_ptr + n).to(tl.int32)) != 0  # a tensor mask
    grp = h // HEADS_PER_GROUP
    rp = tl.program_id(2) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    mp, mn = rp < P, rn < N
    m_s = mp[:, None] & mn[None, :]
    s_ptrs = pool_ptr + (slot * num_heads + h) * (P * N) + rp[:, None] * N + rn[None, :]
    S = tl.load(s_ptrs, mask=m_s & has_init, other=0.0).to(tl.float32)  # [BP, BN]
    a_h = tl.load(a_ptr + h).to(tl.float32)
    skip = tl.load(d_ptr + h).to(tl.float32) if HAS_D else 0.0
    ri = tl.arange(0, BT)
    lower = ri[:, None] >= ri[None, :]
    for c0 in range(0, length, BT):
        mt = c0 + ri < length
        row = start + c0 + ri
        d = tl.load(dt_ptr + row * s_dt + h, mask=mt, other=0.0)
        d = tl.where(mt, _dt(d, bias_ptr, h, lo, hi, HAS_BIAS, SOFTPLUS), 0.0)  # padding: no decay, no input
        acs = tl.cumsum(d * a_h, 0)
        a_last = tl.sum(d * a_h, 0)
        x = tl.load(x_ptr + row[:, None] * s_xt + h * P + rp[None, :], mask=mt[:, None] & mp[None, :],
                    other=0.0).to(tl.float32)
        bm = tl.load(b_ptr + row[:, None] * s_bt + grp * N + rn[None, :], mask=mt[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)
        cm = tl.load(c_ptr + row[:, None] * s_ct + grp * N + rn[None, :], mask=mt[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)
        xdt = x * d[:, None]
        decay = tl.exp(tl.where(lower, acs[:, None] - acs[None, :], float("-inf")))
        y = tl.dot(tl.dot(cm, tl.trans(bm), input_precision=PREC) * decay, xdt, input_precision=PREC)
        y += tl.exp(acs)[:, None] * tl.dot(cm, tl.trans(S), input_precision=PREC)
        y += skip * x
        tl.store(y_ptr + (row[:, None] * num_heads + h) * P + rp[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mt[:, None] & mp[None, :])
        xin = xdt * tl.exp(a_last - acs)[:, None]
        S = S * tl.exp(a_last) + tl.dot(tl.trans(xin), bm, input_precision=PREC)
    tl.store(s_ptrs, S.to(pool_ptr.dtype.element_ty), mask=m_s)


@jit
def _ssd_update_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, bias_ptr, y_ptr, pool_ptr, cu_ptr, slot_ptr,
                       init_ptr, tok_ptr, s_xt, s_dt, s_bt, s_ct, num_heads, lo, hi,
                       HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr,
                       BN: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                       TOKEN_SLOTS: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(cu_ptr + n).to(tl.int64)
    length = tl.load(cu_ptr + n + 1).to(tl.int64) - start
    slot = tl.load(slot_ptr + n).to(tl.int64)
    has_init = (tl.zeros([BP, BN], tl.int32) + tl.load(init_ptr + n).to(tl.int32)) != 0
    grp = h // HEADS_PER_GROUP
    rp = tl.program_id(2) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    mp, mn = rp < P, rn < N
    m_s = mp[:, None] & mn[None, :]
    head = h * (P * N) + rp[:, None] * N + rn[None, :]
    S = tl.load(pool_ptr + slot * num_heads * (P * N) + head, mask=m_s & has_init, other=0.0).to(tl.float32)
    a_h = tl.load(a_ptr + h).to(tl.float32)
    skip = tl.load(d_ptr + h).to(tl.float32) if HAS_D else 0.0
    for i in range(0, length):
        row = start + i
        d = _dt(tl.load(dt_ptr + row * s_dt + h), bias_ptr, h, lo, hi, HAS_BIAS, SOFTPLUS)
        x = tl.load(x_ptr + row * s_xt + h * P + rp, mask=mp, other=0.0).to(tl.float32)
        bm = tl.load(b_ptr + row * s_bt + grp * N + rn, mask=mn, other=0.0).to(tl.float32)
        cm = tl.load(c_ptr + row * s_ct + grp * N + rn, mask=mn, other=0.0).to(tl.float32)
        S = S * tl.exp(d * a_h) + (d * x)[:, None] * bm[None, :]
        y = tl.sum(S * cm[None, :], axis=1) + skip * x
        tl.store(y_ptr + (row * num_heads + h) * P + rp, y.to(y_ptr.dtype.element_ty), mask=mp)
        if TOKEN_SLOTS:
            keep = tl.load(tok_ptr + row)
            tl.store(pool_ptr + keep * num_heads * (P * N) + head, S.to(pool_ptr.dtype.element_ty),
                     mask=m_s & ((tl.zeros([BP, BN], tl.int64) + keep) >= 0))
    tl.store(pool_ptr + slot * num_heads * (P * N) + head, S.to(pool_ptr.dtype.element_ty), mask=m_s)


def _launch_args(x, dt, B, C):
    """The kernels address a token's heads as row * stride + head * P + i: heads contiguous."""
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "x: each token's heads must be contiguous"
    assert dt.stride(1) == 1, "dt: its heads must be contiguous"
    for name, y in (("B", B), ("C", C)):
        assert y.stride(2) == 1 and y.stride(1) == y.shape[2], f"{name}: each token's groups must be contiguous"
    p, n = x.shape[2], B.shape[2]
    return max(16, min(64, next_pow2(p))), max(16, next_pow2(n))


def _common(x, dt, A, B, C, D, dt_bias, state_pool, var, dt_limit):
    bp, bn = _launch_args(x, dt, B, C)
    t, h, p = x.shape
    y = torch.empty((t, h, p), dtype=x.dtype, device=x.device)
    lo, hi = _limits(dt_limit)
    grid = (var.num_seqs, h, -(-p // bp))
    args = (x, dt, A.contiguous(), B, C, A if D is None else D.contiguous(), A if dt_bias is None else
            dt_bias.contiguous(), y, state_pool, var.cu_seqlens, var.state_slots, var.has_initial_state)
    strides = (x.stride(0), dt.stride(0), B.stride(0), C.stride(0), h, lo, min(hi, 3.0e38))
    return y, grid, args, strides, (h // B.shape[1], p, B.shape[2], bp, bn)


def ssd_chunk_scan_triton(x, dt, A, B, C, state_pool, cu_seqlens, state_slots, has_initial_state=None, *, D=None,
                          dt_bias=None, dt_softplus: bool = True, dt_limit=(0.0, math.inf),
                          chunk_size: int = CHUNK):
    """ssd_chunk_scan_ref's contract (chunk_size: a power of two, at least 16)."""
    var = _check(x, dt, A, B, C, D, dt_bias, state_pool, cu_seqlens, state_slots, has_initial_state)
    assert chunk_size >= 16 and chunk_size == next_pow2(chunk_size), f"chunk_size: a power of two >= 16, got {chunk_size}"
    y, grid, args, strides, shape = _common(x, dt, A, B, C, D, dt_bias, state_pool, var, dt_limit)
    if var.num_seqs:
        _ssd_chunk_kernel[grid](*args, *strides, *shape, chunk_size, D is not None, dt_bias is not None, dt_softplus,
                                "ieee" if interpreting(x) else "tf32x3", num_warps=4)
    return y


def ssd_state_update_triton(x, dt, A, B, C, state_pool, cu_seqlens, state_slots, has_initial_state=None, *, D=None,
                            dt_bias=None, dt_softplus: bool = True, dt_limit=(0.0, math.inf),
                            token_state_slots: torch.Tensor | None = None):
    """ssd_state_update_ref's contract."""
    var = _check(x, dt, A, B, C, D, dt_bias, state_pool, cu_seqlens, state_slots, has_initial_state)
    tok = check_token_slots(token_state_slots, var, x.shape[0], state_pool.shape[0], x.device)
    y, grid, args, strides, shape = _common(x, dt, A, B, C, D, dt_bias, state_pool, var, dt_limit)
    if var.num_seqs:
        _ssd_update_kernel[grid](*args, var.cu_seqlens if tok is None else tok, *strides, *shape, D is not None,
                                 dt_bias is not None, dt_softplus, tok is not None, num_warps=4)
    return y
