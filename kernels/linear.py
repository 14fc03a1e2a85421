"""FP8 (e4m3) linear: weights with one scale per output channel, per 1 x G group along K or per
B x B block (kernels/fp8_scales.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8_scales import dequantize, scale_block


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K]; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32 -> [T, N] in x's dtype.
    Weight-only dequantization: exact, since fp8 * fp32 scale is exact in fp32."""
    assert weight.dtype == torch.float8_e4m3fn and weight.shape[1] == x.shape[-1]
    w = dequantize(weight, weight_scale, x.dtype)  # checks the scale's layout
    return F.linear(x, w, bias)


# ---------------------------------------------------------------------------
# Triton. Three paths, chosen from the device's compute capability:
#   sm_89+ (Ada, Hopper, Blackwell): W8A8. Activations get one fp32 scale per
#     token (amax / 448) in a quantize kernel, then an fp8 x fp8 product with
#     both scales applied in the epilogue: torch._scaled_mm or the Triton dot
#     below, whichever the tuner measures faster for the shape. Weights scaled
#     per group along K (or per block) take activations scaled per token and
#     group of the same width (DeepSeek-V3's 1 x 128 tiles): each K tile is one
#     group of both, and its product is scaled by both as it is added.
#   below sm_89 (Ampere): weight-only. The fp8 weight tile is decoded in
#     registers and the dot runs in the activations' dtype.
#   CPU (interpreter): the Triton W8A8 dot, which the interpreter computes right.

from .attention import _load_f32  # noqa: E402  (fp8 decode shared with the KV cache)
from .triton_utils import cdiv, capability, interpreting, jit, native_fp8, next_pow2, pick_config, tl  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@jit
def _quant_rows_kernel(x_ptr, q_ptr, staged_ptr, scale_ptr, num_rows, K, stride_x,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, STAGED: tl.constexpr):
    # Per-token dynamic scale: pass 1 finds amax, pass 2 divides by the scale and saturates.
    # STAGED: write scaled fp32 for torch to round (the interpreter's fp8 cast is wrong).
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    row = x_ptr + r.to(tl.int64)[:, None] * stride_x
    amax = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(row + c[None, :], mask=r_ok[:, None] & (c < K)[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1e-12)  # zero rows divide
    tl.store(scale_ptr + r, scale, mask=r_ok)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        mask = r_ok[:, None] & (c < K)[None, :]
        x = tl.load(row + c[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        dst = r.to(tl.int64)[:, None] * K + c[None, :]
        if STAGED:
            tl.store(staged_ptr + dst, y, mask=mask)
        else:
            tl.store(q_ptr + dst, y.to(tl.float8e4nv), mask=mask)


def quantize_groups_ref(x: torch.Tensor, gk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (fp8 [M, K], fp32 scale [M, cdiv(K, gk)]): each token's 1 x gk groups along K
    scaled by their own amax / 448 (the last group the remainder)."""
    M, K = x.shape
    G = -(-K // gk)
    xp = F.pad(x.float(), (0, G * gk - K)).view(M, G, gk)
    scale = (xp.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    q = (xp / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(M, G * gk)[:, :K]
    return q, scale


def quantize_groups_triton(x: torch.Tensor, gk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_groups_ref through the per-row kernel: the tokens' groups are rows of gk. The
    fp8 result keeps the padded width (cdiv(K, gk) * gk, zeros past K) as its row stride."""
    assert x.dim() == 2 and x.stride(1) == 1
    M, K = x.shape
    G = -(-K // gk)
    xp = x if G * gk == K and x.is_contiguous() else F.pad(x, (0, G * gk - K)).contiguous()
    q, scale = quantize_rows_triton(xp.view(M * G, gk))
    return q.view(M, G * gk)[:, :K], scale.view(M, G)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (fp8 [M, K], fp32 scale [M, 1]) with x ~= fp8 * scale, per-token."""
    assert x.dim() == 2 and x.stride(1) == 1
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    staged = interpreting(x) or not native_fp8(x)
    buf = torch.empty((M, K) if staged else (1,), dtype=torch.float32, device=x.device)
    block_k = min(next_pow2(K), 16384 if interpreting(x) else 2048)
    block_r = max(1, min(next_pow2(M), 16384 // block_k)) if interpreting(x) else 1
    if M:
        _quant_rows_kernel[(cdiv(M, block_r),)](x, q, buf, scale, M, K, x.stride(0), block_r, block_k, staged,
                                                num_warps=4)
    if staged:
        q = buf.to(FP8)  # round to nearest even; the kernel already saturated
    return q, scale


@jit
def _fp8_gemm_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_bn,
                     stride_bs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, A_FP8: tl.constexpr, B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
                     DOT_F32: tl.constexpr, SCALE_BN: tl.constexpr, A_GROUPS: tl.constexpr):
    # C[M, N] = (A[M, K] @ W[N, K]^T) * a_scale[M] * w_scale + bias. W is K-major, as fp8 MMAs want.
    # A_FP8: A is fp8 with per-row scales (W8A8); else A is bf16/fp16 and W is decoded to its dtype.
    # SCALE_BN 0: w_scale[N], one per column, applied once at the end. Else the weight is scaled
    # per group of BLOCK_K along K and SCALE_BN rows (1: 1 x G groups; 128: DeepSeek-V3's blocks),
    # w_scale[N / SCALE_BN, cdiv(K, BLOCK_K)] with row stride stride_bs: each K tile's product is
    # scaled as it is added, so a tile is exactly one group (the host sets BLOCK_K to it).
    # A_GROUPS (with SCALE_BN): A's scales are per row and K tile, a_scale[M, cdiv(K, BLOCK_K)],
    # applied with the weight's as each tile is added.
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)  # grouped order: consecutive programs share W tiles in L2
    first_m = group * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % rows
    pid_n = (pid % (GROUP_M * grid_n)) // rows
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        a_mask = (m < M)[:, None] & (k < K)[None, :]
        b_mask = (k < K)[:, None] & (n < N)[None, :]
        part = acc if SCALE_BN == 0 else tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if A_FP8 and B_MODE == 1 and not DOT_F32:
            a = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0)
            b = tl.load(b_cols + k[:, None], mask=b_mask, other=0.0)
            part = tl.dot(a, b, part)
        else:
            a = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
            b = _load_f32(b_cols + k[:, None], b_mask, B_MODE)
            if DOT_F32:
                part = tl.dot(a, b, part)
            else:
                dt = c_ptr.dtype.element_ty
                part = tl.dot(a.to(dt), b.to(dt), part)
        if SCALE_BN == 0:
            acc = part
        else:
            gs = tl.load(b_scale_ptr + (n // SCALE_BN).to(tl.int64) * stride_bs + k0 // BLOCK_K, mask=n < N, other=0.0)
            if A_GROUPS:
                ag = tl.load(a_scale_ptr + m.to(tl.int64) * tl.cdiv(K, BLOCK_K) + k0 // BLOCK_K, mask=m < M, other=0.0)
                acc += part * gs[None, :] * ag[:, None]
            else:
                acc += part * gs[None, :]
    out = acc
    if SCALE_BN == 0:
        out = acc * tl.load(b_scale_ptr + n, mask=n < N, other=0.0)[None, :]
    if A_FP8 and not A_GROUPS:
        out = out * tl.load(a_scale_ptr + m, mask=m < M, other=0.0)[:, None]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    c_mask = (m < M)[:, None] & (n < N)[None, :]
    tl.store(c_ptr + m.to(tl.int64)[:, None] * N + n[None, :], out.to(c_ptr.dtype.element_ty), mask=c_mask)


def _gemm_candidates(t: torch.Tensor, M: int) -> list[dict]:
    """Tiles per M class and architecture. Hopper (sm_90, 228 KB shared memory) takes
    the widest tiles and deepest pipelines; Ada and Ampere (~100-164 KB) shallower ones."""
    if interpreting(t):
        return [dict(BLOCK_M=min(64, max(16, next_pow2(M))), BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1)]
    hopper = capability(t) >= (9, 0)
    stages = (3, 4) if hopper else (2, 3)
    if M <= 16:  # decode: stream the weight through many narrow N tiles
        return [dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=4, num_stages=s)
                for n in (32, 64, 128) for k in (128, 256) for s in stages]
    if M <= 128:
        return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=128, num_warps=4, num_stages=s)
                for m in (32, 64) for n in (64, 128) for s in stages]
    wide = (128, 256) if hopper else (64, 128)
    return [dict(BLOCK_M=128, BLOCK_N=n, BLOCK_K=128 if hopper else 64, num_warps=w, num_stages=s)
            for n in wide for w in (4, 8) for s in stages]


def _scale_tiles(w_scale: torch.Tensor, shape) -> tuple[int, int]:
    """-> (SCALE_BN, the K tile) for the kernel: (0, 0) per channel, else the group's rows and
    its width along K, which the K tile must equal."""
    bn, bk = scale_block(w_scale, tuple(shape))
    if bk == shape[1] and bn == 1:
        return 0, 0
    assert bk >= 16, f"groups of {bk} along K: tl.dot takes K tiles of 16 or more"
    return bn, bk


MIN_FP8_DOT_K = 32  # the narrowest K tile an fp8 x fp8 tl.dot compiles for (sm_89+; 1 x 16 groups fail)


def gpu_refusal(weight_scale: torch.Tensor, shape, device: torch.device) -> str | None:
    """Why this GPU cannot run a weight of this scale layout (None: it can). A group narrower
    than the fp8 dot's K tile does not compile for W8A8 (tests/test_kernels_compile.py); the
    weight-only path (pre-sm_89) takes groups of 16."""
    bk = _scale_tiles(weight_scale, tuple(shape))[1]
    if device.type == "cuda" and bk and bk < MIN_FP8_DOT_K and torch.cuda.get_device_capability(device) >= (8, 9):
        return (f"FP8 scales in groups of {bk} along K: this GPU's fp8 product takes K tiles of {MIN_FP8_DOT_K} or "
                f"more; convert with --fp8-recipe g32 (or coarser, or channel, the CUDA default)")
    return None


def _group_candidates(cands: list[dict], bk: int) -> list[dict]:
    """The tile candidates with K tiles of one group each (deduplicated)."""
    out = []
    for c in cands:
        c = {**c, **({"BLOCK_K": bk} if "BLOCK_K" in c else {})}
        if c not in out:
            out.append(c)
    return out


def _launch_gemm(a, a_scale, weight, w_scale, bias, out, cfg, b_mode: int, dot_f32: bool) -> None:
    M, K = a.shape
    N = weight.shape[0]
    scale_bn, bk = _scale_tiles(w_scale, weight.shape)
    block_k = bk or cfg["BLOCK_K"]
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    _fp8_gemm_kernel[grid](
        a, weight, a_scale if a_scale is not None else w_scale, w_scale, bias if bias is not None else w_scale, out,
        M, N, K, a.stride(0), weight.stride(0), w_scale.stride(0) if scale_bn else 0, cfg["BLOCK_M"],
        cfg["BLOCK_N"], block_k, 8, a_scale is not None, b_mode, bias is not None, dot_f32, scale_bn,
        a_scale is not None and a_scale.shape[1] > 1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def fp8_w8a8_triton(x, weight, weight_scale, bias=None, cfg: dict | None = None) -> torch.Tensor:
    """fp8 activations x fp8 weights (any fp8_scales layout), product in a Triton fp8 dot: the
    activations scaled per token, or per token and group where the weight has groups along K."""
    bk = _scale_tiles(weight_scale, weight.shape)[1]
    a, a_scale = quantize_groups_triton(x, bk) if bk else quantize_rows_triton(x)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch_gemm(a, a_scale, weight, weight_scale, bias, out, cfg or _gemm_candidates(x, x.shape[0])[0], 1, False)
    return out


def fp8_scaled_mm(x, weight, weight_scale, bias=None) -> torch.Tensor:
    """The same W8A8 product through torch._scaled_mm (cuBLASLt on sm_89+)."""
    a, a_scale = quantize_rows_triton(x)
    out = torch._scaled_mm(a, weight.t(), scale_a=a_scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=x.dtype)
    return out if bias is None else out + bias


def fp8_weight_only_triton(x, weight, weight_scale, bias=None, cfg: dict | None = None) -> torch.Tensor:
    """Activations stay in their dtype; fp8 weights are decoded in the kernel (pre-sm_89 GPUs)."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    b_mode = 1 if native_fp8(x) else 2
    w = weight if b_mode == 1 else weight.view(torch.uint8)
    dot_f32 = interpreting(x) or x.dtype == torch.float32

    def launch(c: dict) -> None:
        _launch_gemm(x, None, w, weight_scale, bias, out, c, b_mode, dot_f32)

    if cfg is None:
        bk = _scale_tiles(weight_scale, weight.shape)[1]
        key = (weight.shape[0], weight.shape[1], _m_bucket(x.shape[0]), str(x.dtype), tuple(weight_scale.shape))
        cands = _gemm_candidates(x, _m_bucket(x.shape[0]))
        cfg = pick_config("fp8_weight_only", key, _group_candidates(cands, bk) if bk else cands, x, launch)
    launch(cfg)
    return out


def _m_bucket(M: int) -> int:
    return min(next_pow2(M), 4096)


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as fp8_linear_ref; the path follows the device (see above)."""
    assert weight.dtype == FP8 and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] == x.shape[-1]
    bk = _scale_tiles(weight_scale, weight.shape)[1]  # checks the scale's layout
    assert weight_scale.dtype == torch.float32
    assert weight_scale.is_contiguous() and (bias is None or bias.shape == (weight.shape[0],))
    assert x.device == weight.device == weight_scale.device
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if not interpreting(x) and capability(x) < (8, 9):
        return fp8_weight_only_triton(x2, weight, weight_scale, bias).reshape(*lead, -1)
    M, N, K = x2.shape[0], weight.shape[0], weight.shape[1]
    cands = [dict(backend="triton", **c) for c in _gemm_candidates(x, _m_bucket(M))]
    cands = _group_candidates(cands, bk) if bk else cands
    if not bk and not interpreting(x) and x.dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0:
        cands.insert(0, dict(backend="scaled_mm"))

    def run(cfg: dict) -> torch.Tensor:
        if cfg["backend"] == "scaled_mm":
            return fp8_scaled_mm(x2, weight, weight_scale, bias)
        return fp8_w8a8_triton(x2, weight, weight_scale, bias, cfg)

    cfg = pick_config("fp8_linear", (N, K, _m_bucket(M), str(x.dtype), tuple(weight_scale.shape)), cands, x, run)
    return run(cfg).reshape(*lead, -1)
