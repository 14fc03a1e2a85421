"""MXFP4 (OCP Microscaling): e2m1 values, two a byte, with one e8m0 exponent per 32.

A checkpoint's MXFP4 weights are dequantized at load, exactly (e2m1 times a power of two is
exact in bf16 and fp32), then quantized to FP8 like any bf16 checkpoint (--weights fp8): a
weight then takes a byte and its channel a 4-byte scale, against MXFP4's 4.25 bits (a nibble
and an exponent per 32), so such weights take 1.88 times the bytes in FP8."""
from __future__ import annotations

import torch

# e2m1's sixteen codes (OCP MX spec): sign, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8 (the low nibble first), scales [..., G] uint8 (exponents biased
    by 127) -> [..., G * 32] fp32."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)
