"""FP8 (e4m3) linear: weights with one scale per output channel."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K]; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32 -> [T, N] in x's dtype.
    Weight-only dequantization: exact, since fp8 * fp32 scale is exact in fp32."""
    assert weight.dtype == torch.float8_e4m3fn and weight.shape[1] == x.shape[-1]
    assert weight_scale.shape == (weight.shape[0],)
    w = (weight.float() * weight_scale.float()[:, None]).to(x.dtype)
    return F.linear(x, w, bias)
