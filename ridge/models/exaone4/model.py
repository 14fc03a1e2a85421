"""EXAONE 4, as transformers' Exaone4 modeling code computes it: OLMo 2's layer (ridge/models/
olmo2/model.py: the stream enters attention and the MLP un-normed, each output is normed before
it joins the stream) with QK-norm over each head (llama's layer's), not over the whole
projections; the global layers' NoPE is llama's layer's (ModelConfig.nope_layers)."""
from __future__ import annotations

from ridge.config import ModelConfig

from ..layers.decoder import DecoderLayer, RMSNorm
from ..olmo2.model import Olmo2CausalLM, Olmo2DecoderLayer


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    norm_qk = DecoderLayer.norm_qk  # each head on its own


class Exaone4CausalLM(Olmo2CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> DecoderLayer:
        return Exaone4DecoderLayer(cfg, index)
