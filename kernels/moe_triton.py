"""The MoE experts in Triton (fused_moe's contract, kernels/moe.py; fused_moe_ref is the oracle).

Two paths, chosen per shape by measurement (pick_config; the first candidate on the interpreter
and while a CUDA graph is being captured):

  sorted (prefill): the T * k routed slots are sorted by expert into a padded block layout,
    each expert's run rounded up to BLOCK_M rows (align_block_size: the idea of vLLM's
    moe_align_block_size and SGLang's, in device-side torch ops, no host sync, so a CUDA graph
    can hold it), one grouped GEMM launch for gate_up with the activation in its epilogue and
    one for down with the routing weight in its epilogue; then each token's k rows are summed.
    A row block belongs to one expert, so each program reads one expert's weight tiles and a
    weight tile is read once per block of BLOCK_M slots routed to that expert.
  gemv (decode): one program per (slot, column tile) for gate_up and per (token, column tile)
    for down, reading only the selected experts' rows: no sort, no padded rows, no tensor-core
    tile of 16 rows for one token; down's program adds its token's k weighted terms itself.

FP8 weights (e4m3, one scale per output channel per expert): on sm_89+ and the interpreter the
sorted path is W8A8 as kernels/linear.py (activations quantized per row, fp8 x fp8 dot, both
scales in the epilogue); below sm_89 the weight tile is decoded in registers (weight-only).
The gemv path is weight-only everywhere: it is bound by the weight bytes, not the arithmetic.
"""
from __future__ import annotations

import torch

from .activation import GELU, GELU_TANH, SILU, SWIGLUOAI, gated_act
from .attention import _load_f32
from .linear import quantize_rows_triton
from .moe import FP8, check_args
from .triton_utils import cdiv, interpreting, jit, native_fp8, next_pow2, pick_config, tl

ACT_CODE = {"silu": SILU, "gelu": GELU, "gelu_pytorch_tanh": GELU_TANH, "swigluoai": SWIGLUOAI}


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_slots [P] int32, block_expert [P / block_m] int32, num_padded [1] int32).

    sorted_slots lists the slots t * k + j grouped by expert (ascending; within an expert in
    slot order), each expert's run padded with the sentinel T * k up to a multiple of block_m;
    block_expert[b] is the expert owning rows b * block_m ..; num_padded the rows in use. P is
    the most any routing can need (T * k + min(E, T * k) * (block_m - 1), rounded up to a
    block), so the shapes depend only on T: blocks past num_padded are left to the kernel to skip."""
    T, k = topk_ids.shape
    n = T * k
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))  # no bincount: it reads the max on the host
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # [n] slots by expert
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert]  # place within its expert
    cap = cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    sorted_slots = torch.full((cap,), n, dtype=torch.int32, device=dev)
    sorted_slots[(ends - padded)[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, cap, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_slots, block_expert, ends[-1:].to(torch.int32)


# ---------------------------------------------------------------------------- sorted: grouped GEMM

@jit
def _moe_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, topk_w_ptr,
                     sorted_slots, block_expert, num_padded, num_slots, N, K, stride_am, stride_we, stride_wn,
                     alpha, limit, A_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, A_FP8: tl.constexpr, B_MODE: tl.constexpr,
                     DOT_F32: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                     ROUTED: tl.constexpr):
    # One BLOCK_M x BLOCK_N tile of out [num_slots, N]: rows are sorted slots of one expert e.
    # A row of a slot s is s // A_DIV (gate_up reads token s // k of x; down reads row s of the
    # activations). GATED: out = act(A W_e[n]^T, A W_e[N + n]^T) (W_e holds [gate | up], N = I);
    # ROUTED: out *= topk_weights[s]. W is K-major ([E, rows, K]), per-channel scales [E, rows].
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(tl.load(num_padded), BLOCK_M), tl.cdiv(N, BLOCK_N)
    if pid >= grid_m * grid_n:  # the grid is sized for the worst routing
        return
    group = pid // (GROUP_M * grid_n)  # grouped order: consecutive programs share an expert's tiles in L2
    first_m = group * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % rows
    pid_n = (pid % (GROUP_M * grid_n)) // rows
    slot = tl.load(sorted_slots + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = slot < num_slots
    a_row = tl.where(m_ok, slot // A_DIV, 0).to(tl.int64)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + a_row[:, None] * stride_am
    w_cols = w_ptr + e * stride_we + n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        a_mask = m_ok[:, None] & (k < K)[None, :]
        b_mask = (k < K)[:, None] & n_ok[None, :]
        if A_FP8 and B_MODE == 1 and not DOT_F32:
            a = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0)
            acc = tl.dot(a, tl.load(w_cols + k[:, None], mask=b_mask, other=0.0), acc)
            if GATED:
                acc_up = tl.dot(a, tl.load(w_cols + N * stride_wn + k[:, None], mask=b_mask, other=0.0), acc_up)
        else:
            dt = tl.float32 if DOT_F32 else out_ptr.dtype.element_ty
            a = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0).to(tl.float32).to(dt)
            acc = tl.dot(a, _load_f32(w_cols + k[:, None], b_mask, B_MODE).to(dt), acc)
            if GATED:
                acc_up = tl.dot(a, _load_f32(w_cols + N * stride_wn + k[:, None], b_mask, B_MODE).to(dt), acc_up)
    if A_FP8:  # both scales before the bias
        a_scale = tl.load(a_scale_ptr + a_row, mask=m_ok, other=0.0)[:, None]
        acc, acc_up = acc * a_scale, acc_up * a_scale
    out = _epilogue(acc, e, n, n_ok, w_scale_ptr, bias_ptr, stride_we // stride_wn, B_MODE, HAS_BIAS)
    if GATED:
        up = _epilogue(acc_up, e, N + n, n_ok, w_scale_ptr, bias_ptr, stride_we // stride_wn, B_MODE, HAS_BIAS)
        out = gated_act(out, up, alpha, limit, ACT)
    if ROUTED:
        out = out * tl.load(topk_w_ptr + slot, mask=m_ok, other=0.0)[:, None]
    dst = out_ptr + slot.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@jit
def _epilogue(acc, e, rows, ok, w_scale_ptr, bias_ptr, rows_per_expert, B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr):
    # Channel scales before the bias (the scale belongs to the weight); a float weight has none.
    # acc is [M, N] or [N]: the per-channel terms broadcast along its last axis.
    idx = e * rows_per_expert + rows
    if B_MODE != 0:
        acc = acc * tl.load(w_scale_ptr + idx, mask=ok, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    return acc


# ---------------------------------------------------------------------------- gemv: few tokens

@jit
def _gemv(x_row, w_rows, rows, ok, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          B_MODE: tl.constexpr):
    # [BLOCK_N] fp32: the selected rows of one expert's weight times one activation row. The
    # products accumulate in a 2-D tile, reduced once after the K loop.
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w = w_rows + rows.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        acc += _load_f32(w + k[None, :], ok[:, None] & k_ok[None, :], B_MODE) * x[None, :]
    return tl.sum(acc, axis=1)


@jit
def _moe_gemv_gate_up_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, topk_ids_ptr, N, K, stride_xm,
                             stride_we, stride_wn, alpha, limit, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    # Program (slot s, column tile): out[s, n] = act(gate_e(x[s // k]), up_e(x[s // k])), e = topk_ids[s].
    s = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < N
    e = tl.load(topk_ids_ptr + s).to(tl.int64)
    x_row = x_ptr + (s // TOP_K).to(tl.int64) * stride_xm
    w = w_ptr + e * stride_we
    gate = _gemv(x_row, w, n, ok, K, stride_wn, BLOCK_N, BLOCK_K, B_MODE)
    up = _gemv(x_row, w, N + n, ok, K, stride_wn, BLOCK_N, BLOCK_K, B_MODE)
    gate = _epilogue(gate, e, n, ok, w_scale_ptr, bias_ptr, 2 * N, B_MODE, HAS_BIAS)
    up = _epilogue(up, e, N + n, ok, w_scale_ptr, bias_ptr, 2 * N, B_MODE, HAS_BIAS)
    out = gated_act(gate, up, alpha, limit, ACT)
    tl.store(out_ptr + s.to(tl.int64) * N + n, out.to(out_ptr.dtype.element_ty), mask=ok)


@jit
def _moe_gemv_down_kernel(h_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, topk_ids_ptr, topk_w_ptr, N, K,
                          stride_we, stride_wn, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr):
    # Program (token t, column tile): out[t, n] = sum_j topk_weights[t, j] * down_e(h[t k + j])[n],
    # the k terms added here in slot order (one store per token, no atomics).
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < N
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        s = t.to(tl.int64) * TOP_K + j
        e = tl.load(topk_ids_ptr + s).to(tl.int64)
        y = _gemv(h_ptr + s * K, w_ptr + e * stride_we, n, ok, K, stride_wn, BLOCK_N, BLOCK_K, B_MODE)
        y = _epilogue(y, e, n, ok, w_scale_ptr, bias_ptr, N, B_MODE, HAS_BIAS)
        total += tl.load(topk_w_ptr + s) * y
    tl.store(out_ptr + t.to(tl.int64) * N + n, total.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------- host side

def _b_mode(w: torch.Tensor, x: torch.Tensor) -> int:
    """0: a float weight; 1: e4m3 converted by the hardware (sm_89+, the interpreter); 2: its bits decoded."""
    return 0 if w.dtype != FP8 else (1 if native_fp8(x) else 2)


def _weight(w: torch.Tensor, b_mode: int) -> torch.Tensor:
    return w.view(torch.uint8) if b_mode == 2 else w


def _dot_f32(x: torch.Tensor) -> bool:
    return interpreting(x) or x.dtype == torch.float32  # the interpreter's bf16 dot is wrong


def _candidates(x: torch.Tensor, T: int) -> list[dict]:
    """Tiles per token-count class (decode: the gemv path first, the sorted one with the fewest
    rows a dot takes; prefill: the sorted path's square-ish tiles)."""
    if interpreting(x):
        path = "gemv" if T <= 4 else "sorted"
        return [dict(path=path, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1)]
    if T <= 16:
        return ([dict(path="gemv", BLOCK_M=1, BLOCK_N=n, BLOCK_K=256, num_warps=4, num_stages=1) for n in (8, 16, 32)]
                + [dict(path="sorted", BLOCK_M=16, BLOCK_N=n, BLOCK_K=128, num_warps=4, num_stages=s)
                   for n in (64, 128) for s in (3, 4)])
    if T <= 128:
        return [dict(path="sorted", BLOCK_M=m, BLOCK_N=n, BLOCK_K=128, num_warps=4, num_stages=3)
                for m in (16, 32) for n in (64, 128)]
    # gate_up holds two accumulators and two weight tiles: 128 x 256 would pass Hopper's shared memory.
    return [dict(path="sorted", BLOCK_M=m, BLOCK_N=n, BLOCK_K=128, num_warps=w, num_stages=s)
            for m, n, w, s in ((64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3), (128, 64, 4, 4))]


def _gemv_path(x, w1, s1, w2, s2, topk_ids, topk_weights, b1, b2, act, alpha, limit, cfg) -> torch.Tensor:
    T, k = topk_ids.shape
    E, I2, H = w1.shape
    inter = I2 // 2
    m1, m2 = _b_mode(w1, x), _b_mode(w2, x)
    h = torch.empty((T * k, inter), dtype=x.dtype, device=x.device)
    bn, bk, warps = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    _moe_gemv_gate_up_kernel[(T * k, cdiv(inter, bn))](
        x, _weight(w1, m1), s1 if s1 is not None else x, b1 if b1 is not None else x, h, topk_ids, inter, H,
        x.stride(0), w1.stride(0), w1.stride(1), alpha, limit, k, bn, min(bk, next_pow2(H)), m1, b1 is not None,
        ACT_CODE[act], num_warps=warps)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    _moe_gemv_down_kernel[(T, cdiv(H, bn))](
        h, _weight(w2, m2), s2 if s2 is not None else x, b2 if b2 is not None else x, out, topk_ids, topk_weights,
        H, inter, w2.stride(0), w2.stride(1), k, bn, min(bk, next_pow2(inter)), m2, b2 is not None, num_warps=warps)
    return out


def _grouped_gemm(a, a_scale, w, w_scale, bias, out, layout, topk_weights, num_slots, a_div, gated, act, alpha,
                  limit, cfg, b_mode) -> None:
    sorted_slots, block_expert, num_padded = layout
    N = w.shape[1] // 2 if gated else w.shape[1]
    K = w.shape[2]
    grid = (block_expert.shape[0] * cdiv(N, cfg["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a, a_scale if a_scale is not None else out, _weight(w, b_mode), w_scale if w_scale is not None else out,
        bias if bias is not None else out, out, topk_weights, sorted_slots, block_expert, num_padded, num_slots, N, K,
        a.stride(0), w.stride(0), w.stride(1), alpha, limit, a_div, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"],
        8, a_scale is not None, b_mode, _dot_f32(out), bias is not None, gated,
        ACT_CODE[act], topk_weights is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _sorted_path(x, w1, s1, w2, s2, topk_ids, topk_weights, b1, b2, act, alpha, limit, cfg, w8a8) -> torch.Tensor:
    T, k = topk_ids.shape
    E, I2, H = w1.shape
    layout = align_block_size(topk_ids, E, cfg["BLOCK_M"])
    m1, m2 = _b_mode(w1, x), _b_mode(w2, x)
    h = torch.empty((T * k, I2 // 2), dtype=x.dtype, device=x.device)
    a, a_scale = quantize_rows_triton(x) if w8a8 else (x, None)
    _grouped_gemm(a, a_scale, w1, s1, b1, h, layout, None, T * k, k, True, act, alpha, limit, cfg, m1)
    a, a_scale = quantize_rows_triton(h) if w8a8 else (h, None)
    y = torch.empty((T * k, H), dtype=x.dtype, device=x.device)
    _grouped_gemm(a, a_scale, w2, s2, b2, y, layout, topk_weights, T * k, 1, False, act, alpha, limit, cfg, m2)
    return y.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe_triton(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, *,
                     b_gate_up=None, b_down=None, act="silu", swiglu_alpha=1.702, swiglu_limit=7.0, cpu=None,
                     cfg: dict | None = None, w8a8: bool = True) -> torch.Tensor:
    """fused_moe's contract (kernels/moe.py). cpu is the CPU path's and unused here. cfg forces a
    path and its tiles (tests, the GPU check); w8a8=False keeps the sorted path weight-only
    (it is W8A8 by default for FP8 weights where the hardware converts e4m3)."""
    check_args(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, b_gate_up, b_down, act)
    for t in (w_gate_up, w_down, topk_ids, topk_weights, *(b for b in (b_gate_up, b_down) if b is not None)):
        assert t.is_contiguous() and t.device == x.device, "fused_moe_triton: contiguous inputs on x's device"
    assert x.stride(1) == 1 and x.dtype in (torch.float32, torch.float16, torch.bfloat16), (x.stride(), x.dtype)
    T, H = x.shape
    if T == 0:
        return torch.empty((0, H), dtype=x.dtype, device=x.device)
    fp8 = w_gate_up.dtype == FP8 and w_down.dtype == FP8
    w8a8 = w8a8 and fp8 and native_fp8(x)
    args = (x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, b_gate_up, b_down, act,
            swiglu_alpha, swiglu_limit)

    def run(c: dict) -> torch.Tensor:
        return _gemv_path(*args, c) if c["path"] == "gemv" else _sorted_path(*args, c, w8a8)

    if cfg is None:
        E, I2, _ = w_gate_up.shape
        key = (E, I2, H, topk_ids.shape[1], min(next_pow2(T), 4096), str(x.dtype), str(w_gate_up.dtype), act, w8a8)
        cfg = pick_config("fused_moe", key, _candidates(x, T), x, run)
    return run(cfg)
