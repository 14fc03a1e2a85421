"""gpt-oss's experts as shipped -> ridge's stacked layout (its WeightLayout.experts and GGUFFamily.tensor).

gpt-oss checkpoints ship each layer's experts stacked, with biases, in one of two forms:
- MXFP4 (the released checkpoints, quantization_config quant_method "mxfp4"):
  mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16] uint8 with gate_up_proj_scales
  [E, 2I, H/32] uint8, and down_proj_blocks / down_proj_scales [E, H, I/32, ...], dequantized
  as they are read (quant/mxfp4.py); gpt-oss-20b's 19.1 B expert parameters then take about
  19.1 GB in FP8 against 10.2 GB in MXFP4;
- dequantized, as transformers' model holds them: gate_up_proj [E, H, 2I], down_proj [E, I, H].
Either way gate_up's 2I outputs interleave gate and up (gate j at 2j, up j at 2j + 1), and
gate_up_proj_bias [E, 2I] with them; ridge's layout is [gate | up] rows, [E, 2I, H].
A GGUF holds them split, as llama.cpp's converter writes them: gate_exps and up_exps [E, I, H],
down_exps [E, H, I], each with its _bias (read from MXFP4 by the gguf package)."""
from __future__ import annotations

import torch

from ridge.quant.errors import ModelLoadError
from ridge.quant.mxfp4 import dequantize_mxfp4

# A GGUF layer's tensors beyond llama.cpp's common names, by their Hugging Face names.
GGUF_NAMES = {"attn_output.bias": "self_attn.o_proj.bias", "attn_sinks.weight": "self_attn.sinks",
              "post_attention_norm.weight": "post_attention_layernorm.weight"}
_GGUF_EXPERTS = {"ffn_gate_inp.weight": "router.weight", "ffn_gate_inp.bias": "router.bias",
                 **{f"ffn_{p}_exps.{k}": f"experts.{p}_exps" + ("" if k == "weight" else "_bias")
                    for p in ("gate", "up", "down") for k in ("weight", "bias")}}


def gguf_tensor(idx: str, name: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A GGUF layer's router or split experts -> their names under model.layers.{idx}.mlp."""
    return {f"model.layers.{idx}.mlp.{_GGUF_EXPERTS[name]}": w} if name in _GGUF_EXPERTS else None


def _split_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Interleaved gate/up along dim 1 ([E, 2I, ...]) -> [gate | up]."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def experts(sd: dict, cfg, layer: str, path) -> dict[str, torch.Tensor]:
    """The layer's tensors under `layer` (model.layers.{i}.) -> ridge's names under experts. and router."""
    m = layer + "mlp."

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
