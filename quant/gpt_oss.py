"""gpt-oss's experts as shipped -> ridge's stacked layout (quant/fuse.py calls it).

gpt-oss checkpoints ship each layer's experts stacked, with biases, in one of two forms:
- MXFP4 (the released checkpoints, quantization_config quant_method "mxfp4"):
  mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16] uint8 (two e2m1 values a byte, the low
  nibble first) with gate_up_proj_scales [E, 2I, H/32] uint8 (one e8m0 exponent, biased by
  127, per 32 values), and down_proj_blocks / down_proj_scales [E, H, I/32, ...];
- dequantized, as transformers' model holds them: gate_up_proj [E, H, 2I], down_proj [E, I, H].
Either way gate_up's 2I outputs interleave gate and up (gate j at 2j, up j at 2j + 1), and
gate_up_proj_bias [E, 2I] with them; ridge's layout is [gate | up] rows, [E, 2I, H].
A GGUF (quant/gguf_moe.py) holds them split, as llama.cpp's converter writes them: gate_exps and
up_exps [E, I, H], down_exps [E, H, I], each with its _bias (read from MXFP4 by the gguf package).

MXFP4 is dequantized at load (exactly: e2m1 times a power of two is exact in bf16 and fp32),
then quantized to FP8 like any bf16 checkpoint (--weights fp8): an expert weight then takes a
byte and its channel a 4-byte scale, against MXFP4's 4.25 bits (a nibble and an exponent per
32), so the experts take 1.88 times the bytes (gpt-oss-20b's 19.1 B expert parameters:
about 19.1 GB in FP8 against 10.2 GB in MXFP4); on CPU they are held upcast, as every weight is."""
from __future__ import annotations

import torch

from .errors import ModelLoadError

# e2m1's sixteen codes (OCP MX spec): sign, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] fp32."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def _split_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Interleaved gate/up along dim 1 ([E, 2I, ...]) -> [gate | up]."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def gpt_oss_experts(sd: dict, m: str, path) -> dict[str, torch.Tensor]:
    """The layer's tensors under `m` (model.layers.{i}.mlp.) -> ridge's names under experts.
    and router."""
    def need(name: str) -> torch.Tensor:
        if m + name not in sd:
            raise ModelLoadError(path, f"missing tensor {m}{name}")
        return sd[m + name]

    if m + "experts.gate_exps" in sd:
        return {"experts.gate_up_proj.weight": torch.cat((need("experts.gate_exps"), need("experts.up_exps")), 1),
                "experts.gate_up_proj.bias": torch.cat((need("experts.gate_exps_bias"), need("experts.up_exps_bias")), 1),
                "experts.down_proj.weight": need("experts.down_exps"), "experts.down_proj.bias": need("experts.down_exps_bias"),
                "router.weight": need("router.weight"), "router.bias": need("router.bias")}
    if m + "experts.gate_up_proj_blocks" in sd:
        gate_up = dequantize_mxfp4(need("experts.gate_up_proj_blocks"), need("experts.gate_up_proj_scales"))
        down = dequantize_mxfp4(need("experts.down_proj_blocks"), need("experts.down_proj_scales"))
    else:
        gate_up, down = need("experts.gate_up_proj").transpose(1, 2), need("experts.down_proj").transpose(1, 2)
    return {"experts.gate_up_proj.weight": _split_gate_up(gate_up).contiguous(),
            "experts.gate_up_proj.bias": _split_gate_up(need("experts.gate_up_proj_bias")).contiguous(),
            "experts.down_proj.weight": down.contiguous(), "experts.down_proj.bias": need("experts.down_proj_bias"),
            "router.weight": need("router.weight"), "router.bias": need("router.bias")}
