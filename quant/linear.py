"""Runtime FP8 linear layer: consumes what quant/fp8.py produced.

An FP8 weight stays FP8 on every device where ridge has a product for it: on CUDA the FP8
kernels read it (ops.keeps_fp8); on a CPU ridge's e4m3 products read its bytes, packed once at
load into their layout with the scales beside them (kernels/cpu_linear.py CpuLinear.from_fp8:
weight and weight_scale are then those two tensors, one byte a weight). Only where those
products are not built (no C compiler) is it upcast once at load (fp8 * scale is exact in fp32).
Which product runs per step size is kernels' choice (kernels/cpu_linear_plan.py): the layer
only holds its weights."""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels import ops
from ridge.kernels.cpu_linear import CpuLinear
from ridge.kernels.fp8_scales import dequantize

FP8 = torch.float8_e4m3fn
IMAGE_CODES = ("e4m3", "i8")  # what a CPU image's packed bytes are (ridge/models/cpu_image.py)


def packed_image(sd, name: str, shape: tuple[int, int]) -> CpuLinear | None:
    """The weight `name` as a CPU image holds it (ridge/models/cpu_image.py: name.cpu_<code>, the
    bytes packed for the CPU products, and name.cpu_scale in their scale layout), else None."""
    for code in IMAGE_CODES:
        packed = sd.get(f"{name}.cpu_{code}")
        if packed is not None:
            nb, kp = packed.shape[:2]
            if packed.dtype != torch.uint8 or nb != -(-shape[0] // 16) or 2 * kp != shape[1]:
                raise ValueError(f"{name}: a CPU image of {tuple(packed.shape)} for a {shape[0]} x {shape[1]} layer")
            return CpuLinear(packed=packed, scale=sd[f"{name}.cpu_scale"], shape=tuple(shape), code=code)
    return None


class FP8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.register_buffer("weight", torch.empty(0))
        self.register_buffer("weight_scale", None)
        self.register_buffer("bias", None)
        self.fp8_device = False  # the weight stays FP8 on the device (ops.keeps_fp8: CUDA), set by load
        self.cpu: CpuLinear | None = None  # the CPU weight and its products (kernels/cpu_linear.py)

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
        elif weight.dtype == FP8 and ops.resident_e4m3(device, tuple(weight.shape)):
            self.cpu = CpuLinear.from_fp8(weight, scale)
            self.weight, self.weight_scale = self.cpu.packed.view(FP8), self.cpu.scale
        elif weight.dtype == FP8:
            self.cpu = CpuLinear.upcast(weight, scale, dtype)
            self.weight = self.cpu.weight.to(device)
        else:
            self.weight = weight.to(device=device, dtype=dtype)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)

    def hold(self, cpu: CpuLinear, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        """A weight packed for the CPU products already (quant/embedding.py: an 8-bit head, a tied
        one the table's own bytes; a CPU image's mapped bytes): weight and weight_scale are its
        two tensors."""
        if cpu.shape != (self.out_features, self.in_features):
            raise ValueError(f"weight {cpu.shape}, the layer is {self.out_features} x {self.in_features}")
        if (bias is not None) != self.has_bias:
            raise ValueError("a bias for a layer without one" if bias is not None else "no bias for a layer with one")
        self.cpu, self.fp8_device = cpu, False
        self.weight, self.weight_scale = cpu.packed.view(torch.int8 if cpu.code == "i8" else FP8), cpu.scale
        self.bias = None if bias is None else bias.to(dtype=dtype)

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8

    def dequantized(self) -> torch.Tensor:
        """The [out, in] weight the layer computes with, in fp32 (e4m3 times its scales, exact):
        for oracles that copy it into another model."""
        if self.cpu is not None and self.cpu.is_packed:
            return self.cpu.reference(torch.eye(self.in_features)).T.contiguous()
        if self.weight.dtype == FP8:
            return dequantize(self.weight, self.weight_scale, torch.float32)
        return self.weight.float()

    def cpu_weights(self) -> CpuLinear:
        """The weight as kernels' CPU products see it (made here for a weight never quantized,
        or one assigned rather than loaded: a tied head in the compute dtype)."""
        if self.cpu is None or (not self.cpu.is_packed and self.cpu.weight is not self.weight):
            self.cpu = CpuLinear(self.weight)
        return self.cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Buffers looked up through nn.Module.__getattr__ cost about a microsecond each, and a
        # batch-1 step makes ~120 of these calls: read them from the buffer dict at once.
        b = self._buffers
        return ops.fp8_linear(x, b["weight"], b["weight_scale"], b["bias"], self.cpu)
