"""Runtime FP8 linear layer: consumes what quant/fp8.py produced.

On CUDA the weight stays FP8 in memory and runs through the FP8 kernels. On CPU
torch's fp8 -> fp32 cast is far too slow to run every step, so the weight is
upcast once at load; fp8 * scale is exact in fp32, so both devices compute
with the same quantized numbers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.kernels import ops

FP8 = torch.float8_e4m3fn


class FP8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.register_buffer("weight", torch.empty(0))
        self.register_buffer("weight_scale", None)
        self.register_buffer("bias", None)

    def load(self, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
             device: torch.device, dtype: torch.dtype) -> None:
        assert weight.shape == (self.out_features, self.in_features), (weight.shape, self.out_features, self.in_features)
        assert (bias is not None) == self.has_bias
        if weight.dtype == FP8 and device.type == "cuda":
            self.weight = weight.to(device)
            self.weight_scale = scale.float().to(device)
        elif weight.dtype == FP8:
            self.weight = (weight.float() * scale.float()[:, None]).to(dtype).to(device)
        else:
            self.weight = weight.to(device=device, dtype=dtype)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            return ops.fp8_linear(x, self.weight, self.weight_scale, self.bias)
        return F.linear(x, self.weight, self.bias)
