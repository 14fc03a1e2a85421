"""The causal depthwise convolution of the recurrent layers (Gated DeltaNet's q/k/v, LFM2's short
convolutions, Mamba2's x/B/C), over a varlen batch whose windows live in a slot pool
(kernels/varlen.py).

Channel c of token t: act(bias[c] + sum_j weight[c, j] x'[t - (K - 1) + j, c]), x' a request's
inputs after its window, the last K - 1 inputs it saw (zeros where it has none yet). The window
then becomes the last K - 1 rows of x': transformers' causal_conv1d_update with a state K - 1
wide.

Shapes: x [T, C] (rows may be a strided view, as a slice of a fused projection); weight [C, K];
bias [C] or None; conv_state [S, K - 1, C], oldest row first (a row per input: a token's update
writes one contiguous row); output [T, C] in x's dtype. activation None or "silu".
token_state_slots [T] (the varlen form, optional): where the window after each token is also
written (-1: nowhere), for speculative verification to roll back to."""
from __future__ import annotations

import torch

from . import native
from .varlen import Varlen, check_token_slots, check_varlen

ACTIVATIONS = (None, "silu")
MAX_NATIVE_TAPS = 16  # kernels/csrc/recurrent.c MAX_TAPS


def _check(x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state, activation) -> Varlen:
    assert x.dim() == 2 and x.stride(1) == 1, f"x: want [T, C] with contiguous channels, got {tuple(x.shape)}"
    t, c = x.shape
    assert weight.dim() == 2 and weight.shape[0] == c and weight.shape[1] >= 2, \
        f"weight: want [{c}, K >= 2], got {tuple(weight.shape)}"
    k = weight.shape[1]
    assert bias is None or bias.shape == (c,), f"bias: want [{c}], got {tuple(bias.shape)}"
    assert conv_state.dim() == 3 and conv_state.shape[1:] == (k - 1, c), \
        f"conv_state: want [slots, {k - 1}, {c}], got {tuple(conv_state.shape)}"
    assert conv_state.is_contiguous(), "conv_state: must be contiguous"
    assert activation in ACTIVATIONS, f"activation: one of {ACTIVATIONS}, got {activation!r}"
    for name, y in (("weight", weight), ("bias", bias), ("conv_state", conv_state)):
        assert y is None or y.device == x.device, f"{name}: on {y.device}, x on {x.device}"
    return check_varlen(t, cu_seqlens, state_slots, conv_state.shape[0], has_initial_state, x.device)


_DECODE_CU: dict = {}  # (N, device) -> arange(N + 1): one object a batch size (varlen.check_varlen reuses its check)


def _decode_batch(x: torch.Tensor) -> torch.Tensor:
    key = (x.shape[0], x.device)
    if key not in _DECODE_CU:
        _DECODE_CU[key] = torch.arange(x.shape[0] + 1, device=x.device)
    return _DECODE_CU[key]


def causal_conv1d_ref(x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state=None, *,
                      activation: str | None = None, token_state_slots: torch.Tensor | None = None) -> torch.Tensor:
    """The varlen form (a prefill chunk per request, or any mix): -> [T, C]; each request's window
    written back to its slot. Arithmetic in fp32."""
    var = _check(x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state, activation)
    tok = check_token_slots(token_state_slots, var, x.shape[0], conv_state.shape[0], x.device)
    w = weight.float()
    width = w.shape[1] - 1
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    bounds = var.bounds
    for n in range(var.num_seqs):
        a, b = bounds[n], bounds[n + 1]
        slot = int(var.state_slots[n])
        window = conv_state[slot].float() if bool(var.has_initial_state[n]) else \
            torch.zeros(width, x.shape[1], device=x.device)
        xs = torch.cat([window, x[a:b].float()])  # [K - 1 + L, C]
        if b > a:
            taps = xs.unfold(0, width + 1, 1)  # [L, C, K]: row t holds x'[t .. t + K - 1]
            y = (taps * w).sum(-1)
            if bias is not None:
                y = y + bias.float()
            out[a:b] = torch.nn.functional.silu(y) if activation == "silu" else y
        if tok is not None:
            for i in range(b - a):  # the window after token i: x'[i + 1 .. i + K - 1]
                if int(tok[a + i]) >= 0:
                    conv_state[int(tok[a + i])] = xs[i + 1:i + 1 + width].to(conv_state.dtype)
        conv_state[slot] = xs[xs.shape[0] - width:].to(conv_state.dtype)
    return out.to(x.dtype)


def causal_conv1d_update_ref(x, weight, bias, conv_state, state_slots, *, activation: str | None = None):
    """The decode form: x [N, C], one token for each request (its window at state_slots[n])."""
    return causal_conv1d_ref(x, weight, bias, conv_state, _decode_batch(x), state_slots, activation=activation)


# ---------------------------------------------------------------------------
# C (kernels/csrc/recurrent.c): both forms in one pass, the window updated in place. A prefill
# chunk's convolution is K multiply-adds per element, bound by reading x: no product to give to BLAS.

def native_fits(x, weight, bias, conv_state) -> bool:
    """Whether the C kernel takes this call: the library built, fp32 throughout, at most 16 taps."""
    return (native.library() is not None and x.device.type == "cpu" and x.stride(1) == 1
            and all(y is None or (y.dtype == torch.float32 and y.is_contiguous()) for y in (weight, bias, conv_state))
            and x.dtype == torch.float32 and weight.shape[1] <= MAX_NATIVE_TAPS)


def _conv_native(x, weight, bias, conv_state, var: Varlen | None, state_slots, activation, tok=None):
    n = state_slots.shape[0] if var is None else var.num_seqs
    out = torch.empty(x.shape, dtype=torch.float32)
    init = torch.ones(n, dtype=torch.uint8) if var is None else var.has_initial_state
    slots = state_slots.to(torch.int64).contiguous() if var is None else var.state_slots
    rc = native.library().conv1d_varlen(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        conv_state.data_ptr(), None if var is None else var.cu_seqlens.data_ptr(), slots.data_ptr(), init.data_ptr(),
        None if tok is None else tok.data_ptr(), n, x.shape[1], weight.shape[1], int(activation == "silu"), torch.get_num_threads())
    assert rc == 0, f"conv1d_varlen: failed ({rc})"
    return out


def causal_conv1d_native(x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state=None, *,
                         activation: str | None = None, token_state_slots: torch.Tensor | None = None) -> torch.Tensor:
    """causal_conv1d_ref's contract in one C call, for a call that native_fits()."""
    var = _check(x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state, activation)
    tok = check_token_slots(token_state_slots, var, x.shape[0], conv_state.shape[0], x.device)
    return _conv_native(x, weight, bias, conv_state, var, state_slots, activation, tok)


def causal_conv1d_update_native(x, weight, bias, conv_state, state_slots, *, activation: str | None = None):
    """causal_conv1d_update_ref's contract in one C call (no cu_seqlens built: one token a request)."""
    _check(x, weight, bias, conv_state, _decode_batch(x), state_slots, None, activation)
    return _conv_native(x, weight, bias, conv_state, None, state_slots, activation)


# ---------------------------------------------------------------------------
# Triton: one program per (request, block of channels), BT tokens at a time; each tap is a
# shifted load of x, or of the window where it reaches before the request's first token.

from .triton_utils import jit, next_pow2, tl  # noqa: E402


@jit
def _conv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr, tok_ptr, s_xt, C,
                 K: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SILU: tl.constexpr, TOKEN_SLOTS: tl.constexpr):
    n = tl.program_id(0)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = rc < C
    start = tl.load(cu_ptr + n).to(tl.int64)
    length = tl.load(cu_ptr + n + 1).to(tl.int64) - start
    slot = tl.load(slot_ptr + n).to(tl.int64)
    has_init = tl.load(init_ptr + n).to(tl.int32)
    window = state_ptr + slot * (K - 1) * C
    bias = tl.load(bias_ptr + rc, mask=mc, other=0.0).to(tl.float32) if HAS_BIAS else tl.zeros([BC], tl.float32)
    rt = tl.arange(0, BT)
    # as a vector: a scalar mask broadcast into a tensor one has no dtype the interpreter takes
    has_t = (rt * 0 + has_init) != 0
    for t0 in range(0, length, BT):
        t = t0 + rt
        mt = t < length
        acc = tl.zeros([BT, BC], tl.float32) + bias[None, :]
        for j in tl.static_range(K):
            p = t - (K - 1) + j  # < 0: from the window
            m_x = (mt & (p >= 0))[:, None] & mc[None, :]
            m_w = (mt & (p < 0) & has_t)[:, None] & mc[None, :]
            xv = tl.load(x_ptr + (start + p)[:, None] * s_xt + rc[None, :], mask=m_x, other=0.0).to(tl.float32)
            wv = tl.load(window + (K - 1 + p)[:, None] * C + rc[None, :], mask=m_w, other=0.0).to(tl.float32)
            acc += (xv + wv) * tl.load(w_ptr + rc * K + j, mask=mc, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (start + t)[:, None] * C + rc[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mt[:, None] & mc[None, :])
        if TOKEN_SLOTS:  # the window after token t: x'[t + 1 .. t + K - 1], row r at p = t + 1 - (K - 1) + r
            keep = tl.load(tok_ptr + start + t, mask=mt, other=-1)
            for r in tl.static_range(K - 1):
                p = t + 1 - (K - 1) + r
                m_x = (mt & (p >= 0))[:, None] & mc[None, :]
                m_w = (mt & (p < 0) & has_t)[:, None] & mc[None, :]
                xv = tl.load(x_ptr + (start + p)[:, None] * s_xt + rc[None, :], mask=m_x, other=0.0).to(tl.float32)
                wv = tl.load(window + (K - 1 + p)[:, None] * C + rc[None, :], mask=m_w, other=0.0).to(tl.float32)
                tl.store(state_ptr + (keep.to(tl.int64) * (K - 1) + r)[:, None] * C + rc[None, :],
                         (xv + wv).to(state_ptr.dtype.element_ty), mask=(keep >= 0)[:, None] & mc[None, :])
    # the new window: the last K - 1 rows of x', all read before any is written
    r = tl.arange(0, BW)
    p = length - (K - 1) + r
    mr = r < K - 1
    xv = tl.load(x_ptr + (start + p)[:, None] * s_xt + rc[None, :], mask=(mr & (p >= 0))[:, None] & mc[None, :],
                 other=0.0)
    wv = tl.load(window + (K - 1 + p)[:, None] * C + rc[None, :],
                 mask=(mr & (p < 0) & ((r * 0 + has_init) != 0))[:, None] & mc[None, :], other=0.0)
    tl.store(window + r[:, None] * C + rc[None, :], (xv.to(tl.float32) + wv.to(tl.float32)).to(
        state_ptr.dtype.element_ty), mask=mr[:, None] & mc[None, :])


def _conv_triton(x, weight, bias, conv_state, var: Varlen, activation, tok=None):
    t, c = x.shape
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if var.num_seqs:
        bc = min(256, max(16, next_pow2(c)))
        k = weight.shape[1]
        w = weight.contiguous()
        _conv_kernel[(var.num_seqs, -(-c // bc))](
            x, w, w if bias is None else bias, out, conv_state, var.cu_seqlens, var.state_slots,
            var.has_initial_state, var.cu_seqlens if tok is None else tok, x.stride(0), c, k,
            max(2, next_pow2(k - 1)), 16, bc, bias is not None, activation == "silu", tok is not None, num_warps=4)
    return out


def causal_conv1d_triton(x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state=None, *,
                         activation: str | None = None, token_state_slots: torch.Tensor | None = None) -> torch.Tensor:
    """causal_conv1d_ref's contract."""
    var = _check(x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state, activation)
    tok = check_token_slots(token_state_slots, var, x.shape[0], conv_state.shape[0], x.device)
    return _conv_triton(x, weight, bias, conv_state, var, activation, tok)


def causal_conv1d_update_triton(x, weight, bias, conv_state, state_slots, *, activation: str | None = None):
    """causal_conv1d_update_ref's contract."""
    var = _check(x, weight, bias, conv_state, _decode_batch(x), state_slots, None, activation)
    return _conv_triton(x, weight, bias, conv_state, var, activation)
