"""OLMo 3, as transformers' Olmo3 modeling code computes it: OLMo 2's layer (norms after attention
and the MLP, QK-norm over the whole projections) with sliding-window layers beside full ones
(config.layer_types, 3 sliding : 1 full by default), each layer type with its own RoPE: the
full layers take rope_theta with the checkpoint's scaling (YaRN on the long-context models),
the sliding layers their own table (ModelConfig.rope_local_theta and rope_local_scaling)."""
from __future__ import annotations

import torch

from ridge.config import ModelConfig

from ..layers.decoder import DecoderLayer
from ..layers.rope import rope_cos_sin
from ..olmo2.model import Olmo2CausalLM, Olmo2DecoderLayer


class Olmo3DecoderLayer(Olmo2DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        # A sliding layer's own RoPE table (the model's cos_sin_local, set by load_layer);
        # None: the table the model passes, the full layers'.
        self.own_cos_sin: torch.Tensor | None = None

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        return super().forward(h, residual, positions, cos_sin if self.own_cos_sin is None else self.own_cos_sin,
                               meta, kv)


class Olmo3CausalLM(Olmo2CausalLM):
    def __init__(self, cfg: ModelConfig, max_model_len: int | None = None):
        super().__init__(cfg, max_model_len)
        self.register_buffer("cos_sin_local", torch.empty(0), persistent=False)

    def make_layer(self, cfg: ModelConfig, index: int) -> DecoderLayer:
        return Olmo3DecoderLayer(cfg, index)

    def load_globals(self, sd, device, dtype, freq_factors=None) -> None:
        super().load_globals(sd, device, dtype, freq_factors)
        cfg = self.cfg
        if cfg.rope_local_theta is not None:
            self.cos_sin_local = rope_cos_sin(cfg.head_dim, self.max_model_len, cfg.rope_local_theta,
                                              cfg.rope_local_scaling).to(device)

    def load_layer(self, i, sd, device, dtype) -> None:
        super().load_layer(i, sd, device, dtype)
        layer = self.layers[i]
        if self.cfg.rope_local_theta is not None:
            layer.own_cos_sin = self.cos_sin_local if layer.window is not None else None
