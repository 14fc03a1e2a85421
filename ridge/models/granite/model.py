"""Granite (3.x), as transformers' Granite modeling code computes it: llama's layers
with four multipliers: embeddings times embedding_multiplier, each sublayer's
output times residual_multiplier before the residual add, attention_multiplier as
the softmax scale (ModelConfig.softmax_scale, read by llama's layer) and the
logits divided by logits_scaling."""
from __future__ import annotations

import torch

from ridge.config import ModelConfig

from ..layers.decoder import CausalLM, DecoderLayer


class GraniteDecoderLayer(DecoderLayer):
    def forward(self, h, residual, positions, cos_sin, meta, kv):
        m = self.cfg.residual_multiplier
        h, residual = self.input_layernorm.forward(h, residual)
        h, residual = self.post_attention_layernorm.forward(self.attention(h, positions, cos_sin, meta, kv) * m,
                                                            residual)
        return self.mlp(h) * m, residual


class GraniteCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> DecoderLayer:
        return GraniteDecoderLayer(cfg, index)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.cfg.embedding_multiplier

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.cfg.logits_scaling
