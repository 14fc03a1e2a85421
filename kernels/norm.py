"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch

from . import native


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual) where new_residual = x + residual (or x).
    Statistics in fp32 whatever the input dtype."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype), residual


def native_fits(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the C kernel (kernels/csrc/small_ops.c) takes this call: the library built, fp32
    throughout, each row's elements contiguous (rows apart are copied together), one weight per
    column."""
    return (native.library() is not None and x.dtype == weight.dtype == torch.float32 and x.stride(-1) == 1
            and weight.is_contiguous() and weight.numel() == x.shape[-1]
            and (residual is None or (residual.is_contiguous() and residual.shape == x.shape
                                      and residual.dtype == x.dtype)))


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_torch's contract (the sum lands in x) in one C call, for a call that native_fits(). Rows
    apart in memory (qwen3's heads, views of the qkv rows) are copied together first; the sum
    then lands in the copy, which is returned."""
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    native.library().rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                              eps, out.data_ptr(), x.numel() // n if n else 0, n, torch.get_num_threads())
    return out, x


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU torch path, fp32: rms_norm_ref's contract allocating less: the residual is added into x
    IN PLACE (x is a layer's fresh output, which becomes the residual stream), then torch.rms_norm
    (a composite on CPU in torch 2.13, but fewer ops than the reference: 12 against 16 us at
    batch 1; docs/benchmarks.md, issue 17)."""
    if residual is not None:
        x = x.add_(residual)
    return torch.rms_norm(x, (x.shape[-1],), weight, eps), x


# ---------------------------------------------------------------------------
# Triton: residual add + RMSNorm in one pass. Fused it reads x and residual and
# writes out and the new residual: 4 passes over [T, N]. The reference makes 14
# on bf16 input (add 3, fp32 cast 2, square 2, mean 1, scale 2, weight 2,
# downcast 2), half of them at fp32 width.

from .triton_utils import cdiv, interpreting, jit, next_pow2, tl  # noqa: E402


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, num_rows, n_cols, inner, stride_outer,
                     stride_inner, eps, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RES: tl.constexpr):
    # Row r of x lives at (r // inner) * stride_outer + (r % inner) * stride_inner: that covers
    # [T, N] rows and the per-head rows of a strided [T, H, D] view (Q/K norm).
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_N)
    mask = (r < num_rows)[:, None] & (c < n_cols)[None, :]
    r64 = r.to(tl.int64)
    x_off = ((r64 // inner) * stride_outer + (r64 % inner) * stride_inner)[:, None] + c[None, :]
    dense = r64[:, None] * n_cols + c[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0)
    if HAS_RES:
        # Round the sum to x's dtype first, as torch's add does, and norm the rounded value.
        x = (x.to(tl.float32) + tl.load(res_ptr + dense, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + dense, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + dense, (xf * inv[:, None] * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rms_norm_ref. x: [T, N] or a [T, H, N] view with unit last stride."""
    n = x.shape[-1]
    assert x.dim() in (2, 3) and x.stride(-1) == 1, (x.shape, x.stride())
    assert weight.shape == (n,) and weight.is_contiguous() and weight.device == x.device
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    rows = x.numel() // n
    inner = x.shape[1] if x.dim() == 3 else 1
    stride_inner = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(out) if residual is not None else x
    if rows == 0:
        return out, new_res
    block_n = next_pow2(n)
    # GPU: one row per program keeps all SMs busy; the interpreter wants few programs.
    block_r = max(1, min(next_pow2(rows), 16384 // block_n)) if interpreting(x) else 1
    warps = 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16
    _rms_norm_kernel[(cdiv(rows, block_r),)](
        x, residual if residual is not None else x, weight, out, new_res, rows, n, inner, x.stride(0),
        stride_inner, eps, block_r, block_n, residual is not None, num_warps=warps)
    return out, new_res
