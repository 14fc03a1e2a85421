"""Llama 4 (text), as transformers' Llama4Text modeling code computes it, on llama's layer:
- RoPE over interleaved pairs (the complex product), run as llama's by reordering each q and k
  head's rows at load (ridge/models/ernie4_5/model.py says why that is exact);
- NoPE layers (ModelConfig.nope_layers); on the RoPE layers a weightless RMS norm over each
  head of q and k (use_qk_norm), which transformers applies after RoPE and ridge before it: a
  rotation keeps a head's norm, so the two orders are one function;
- on the NoPE layers q times 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))
  (attn_temperature_tuning; ModelConfig.query_scale);
- sparse layers: the shared expert plus, for each of the k experts a token takes, that expert
  run on the token scaled by its router weight (sigmoid of its logit): the weight is applied to
  the expert's input, not its output, as Llama4TextMoe does."""
from __future__ import annotations

import torch

from ridge.config import ModelConfig
from ridge.kernels import ops

from ..ernie4_5.model import with_halves
from ..layers.decoder import DecoderLayer
from ..layers.moe import MoeCausalLM, MoeDecoderLayer


class _Llama4Attention:
    """What a Llama 4 layer changes in llama's attention, dense or sparse."""

    def _llama4(self, cfg: ModelConfig, index: int) -> None:
        self.qk_norm = cfg.extra.get("weightless_qk_norm", False) and self.rotary
        self.query_scale = None if self.rotary else cfg.query_scale
        self.ones = None  # [head_dim] fp32: the weightless norm's multiplier, set at load

    def norm_qk(self, q, k):
        eps = self.cfg.rms_norm_eps
        return ops.rms_norm(q, self.ones, eps)[0], ops.rms_norm(k, self.ones, eps)[0]


class Llama4DenseLayer(_Llama4Attention, DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        self._llama4(cfg, index)


class Llama4MoeLayer(_Llama4Attention, MoeDecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        self._llama4(cfg, index)

    def mlp(self, h):
        ids, weights = self.router.forward(h)  # [T, k]
        out = self.shared_experts.forward(h)
        one = torch.ones_like(weights[:, :1])
        for j in range(ids.shape[1]):
            out = out + self.experts.forward(h * weights[:, j:j + 1].to(h.dtype), ids[:, j:j + 1], one)
        return out


class Llama4CausalLM(MoeCausalLM):
    def make_layer(self, cfg: ModelConfig, index: int):
        return Llama4MoeLayer(cfg, index) if cfg.is_moe_layer(index) else Llama4DenseLayer(cfg, index)

    def load_layer(self, i: int, sd, device, dtype) -> None:
        super().load_layer(i, with_halves(sd, i, self.cfg), device, dtype)
        self.layers[i].ones = torch.ones(self.cfg.head_dim, device=device)
