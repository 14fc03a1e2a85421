"""Qwen3-VL's text model: Qwen3's decoder with interleaved mrope (layers/mrope.py) and deepstack.

Deepstack: the tower's deepstack mergers give each image token one more row per merger
(vision.py: encode's rows are [merger | deepstack 0 | deepstack 1 | ...]); the row of merger k is
added to the token's hidden state after text layer k (Qwen3VLTextModel._deepstack_process). The
image rows reach the model as CausalLM.forward's embeds, so a chunk adds them to the image tokens
it computes; a prefix hit skips both, its KV already holding their effect."""
from __future__ import annotations

import torch

from ..layers.decoder import DecoderLayer
from ..layers.mrope import MRopeCausalLM


class DeepstackLayer(DecoderLayer):
    """A decoder layer whose output this step gains rows at some tokens (inject: (rows, [rows, hidden]))."""
    inject = None

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        h, residual = super().forward(h, residual, positions, cos_sin, meta, kv)
        if self.inject is not None:
            rows, values = self.inject
            h = h.index_add(0, rows, values.to(h.dtype))
        return h, residual


class Qwen3VLCausalLM(MRopeCausalLM):
    def make_layer(self, cfg, index: int):
        return DeepstackLayer(cfg, index)

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta, kv_caches, num_layers=None, embeds=None):
        d = self.cfg.hidden_size
        if embeds is None or embeds[1].shape[1] == d:
            return super().forward(input_ids, positions, meta, kv_caches, num_layers, embeds)
        rows, values = embeds
        layers = list(zip(self.layers, values[:, d:].split(d, dim=1)))
        for layer, deep in layers:
            layer.inject = (rows, deep)
        try:
            return super().forward(input_ids, positions, meta, kv_caches, num_layers, (rows, values[:, :d]))
        finally:
            for layer, _ in layers:
                layer.inject = None
