"""Runtime FP8 linear layer: consumes what quant/fp8.py produced.

Whether the weight stays FP8 is kernels' choice per device (ops.keeps_fp8): on
CUDA it does and runs through the FP8 kernels; on CPU torch's fp8 -> fp32 cast
is far too slow to run every step, so the weight is upcast once at load; fp8 *
scale is exact in fp32, so both devices compute with the same quantized
numbers. Which product runs, per device and on CPU per
step size (bf16 copies, ridge's e4m3 kernel), is kernels' choice
(kernels/ops.py, kernels/cpu_linear.py): the layer only holds its weights."""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels import ops
from ridge.kernels.cpu_linear import CpuLinear, pack_fp8
from ridge.kernels.fp8_scales import column_groups, dequantize

FP8 = torch.float8_e4m3fn


class FP8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.register_buffer("weight", torch.empty(0))
        self.register_buffer("weight_scale", None)
        self.register_buffer("bias", None)
        self.fp8_device = False  # the weight stays FP8 on the device (ops.keeps_fp8: CUDA), set by load
        self.cpu: CpuLinear | None = None  # the CPU weight and its formats (kernels/cpu_linear.py)

    def load(self, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
             device: torch.device, dtype: torch.dtype) -> None:
        # The converter (quant/fuse.py) hands what the config declares; these guard its contract.
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"weight {tuple(weight.shape)}, the layer is {self.out_features} x {self.in_features}")
        if (bias is not None) != self.has_bias:
            raise ValueError("a bias for a layer without one" if bias is not None else "no bias for a layer with one")
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias {tuple(bias.shape)}, the layer has {self.out_features} outputs")
        self.cpu = None
        self.fp8_device = weight.dtype == FP8 and ops.keeps_fp8(device)  # FP8 kept: the FP8 kernels run
        if self.fp8_device:
            if (why := ops.fp8_refusal(scale, tuple(weight.shape), device)) is not None:
                raise ValueError(why)
            self.weight = weight.to(device)
            self.weight_scale = scale.float().to(device)
        elif weight.dtype == FP8:
            self.weight = dequantize(weight, scale, dtype).to(device)
            # The e4m3 kernel's layout from the bytes at hand (a permute: recovering them from the
            # upcast copy costs a slow fp32 -> e4m3 cast); kept until the CPU formats are chosen.
            groups = column_groups(scale, tuple(weight.shape))[0].to(device)
            self.cpu = CpuLinear(self.weight, groups[0] if groups.shape[0] == 1 else groups, pack_fp8(weight, groups))
        else:
            self.weight = weight.to(device=device, dtype=dtype)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8

    def cpu_weights(self) -> CpuLinear:
        """The weight as kernels' CPU formats see it (made here for a weight never quantized,
        or one assigned rather than loaded: the tied head)."""
        if self.cpu is None or self.cpu.weight is not self.weight:
            self.cpu = CpuLinear(self.weight)
        return self.cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Buffers looked up through nn.Module.__getattr__ cost about a microsecond each, and a
        # batch-1 step makes ~120 of these calls: read them from the buffer dict at once.
        b = self._buffers
        return ops.fp8_linear(x, b["weight"], b["weight_scale"], b["bias"], self.cpu)
