"""The gated MLP's activation over a fused gate/up projection: act(gate) * up, for the
activations transformers' ACT2FN names silu, gelu (erf) and gelu_pytorch_tanh (tanh)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] laid out as [gate | up] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] laid out as [gate | up] -> gelu(gate) * up, gelu with erf (transformers' gelu)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] laid out as [gate | up] -> gelu(gate) * up, gelu's tanh approximation
    (transformers' gelu_pytorch_tanh: Gemma)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def native_fits(x: torch.Tensor) -> bool:
    """Whether the C kernel (kernels/csrc/small_ops.c) takes this call: the library built,
    contiguous fp32 input of an even width."""
    return native.library() is not None and x.dtype == torch.float32 and x.is_contiguous() and not x.shape[-1] % 2


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul_ref's contract in one C call, for a call that native_fits()."""
    n = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    native.library().silu_and_mul(x.data_ptr(), x.numel() // x.shape[-1] if n else 0, n, out.data_ptr(),
                                  torch.get_num_threads())
    return out


# ---------------------------------------------------------------------------
# Triton: act(gate) * up in one pass: reads [T, 2I] once, writes [T, I].
# The reference makes 5 passes (chunk views are free; act read+write, mul
# reads two and writes one). One kernel, the activation a constexpr.

from .triton_utils import cdiv, interpreting, jit, next_pow2, tl  # noqa: E402


SILU, GELU, GELU_TANH, SWIGLUOAI = 0, 1, 2, 3  # the kernels' ACT (a jit function reads literals, not these names)


@jit
def gated_act(gate, up, alpha, limit, ACT: tl.constexpr):
    """act(gate) * up in fp32, for every gated MLP's kernel (here, kernels/moe_triton.py).
    SWIGLUOAI (gpt-oss): gate clamped above at limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate); alpha and limit are read only there."""
    if ACT == 0:  # SILU
        act = gate * tl.sigmoid(gate)
    elif ACT == 1:  # GELU
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))  # 1 / sqrt(2)
    elif ACT == 2:  # 0.5 (1 + tanh(u)) = sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3): Triton has no tanh
        act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:  # SWIGLUOAI
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
        act = gate * tl.sigmoid(gate * alpha)
    return act * up


@jit
def _act_and_mul_kernel(x_ptr, out_ptr, num_rows, inter, stride_x, ACT: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_I: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (r < num_rows)[:, None] & (c < inter)[None, :]
    src = x_ptr + r.to(tl.int64)[:, None] * stride_x + c[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    out = gated_act(gate, up, 0.0, 0.0, ACT)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * inter + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as silu_and_mul_ref: x [T, 2 * I] = [gate | up] -> [T, I]."""
    return _act_and_mul(x, SILU)


def gelu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as gelu_and_mul_ref."""
    return _act_and_mul(x, GELU)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as gelu_tanh_and_mul_ref."""
    return _act_and_mul(x, GELU_TANH)


def _act_and_mul(x: torch.Tensor, act: int) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1, (x.shape, x.stride())
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if interpreting(x):
        block_i = next_pow2(inter)
        block_r = max(1, min(next_pow2(rows), 16384 // block_i))
    else:
        block_i, block_r = min(1024, next_pow2(inter)), 1
    _act_and_mul_kernel[(cdiv(rows, block_r), cdiv(inter, block_i))](
        x, out, rows, inter, x.stride(0), act, block_r, block_i, num_warps=4)
    return out
