"""Gemma 2 and Gemma 3 (text) decoders: llama's flattened-batch layout with Gemma's differences.

As transformers' Gemma2/Gemma3 modeling code computes them (the oracle of tests/test_gemma.py):
- four norms a layer: the attention's and the MLP's outputs are normed before they join the
  residual stream (post_attention_layernorm, post_feedforward_layernorm), and the MLP's input has
  its own (pre_feedforward_layernorm);
- every norm multiplies by 1 + w; the loaders hand the multiplier itself (HF's w plus 1, added in
  fp32 as transformers does; a GGUF stores it so already), so ops.rms_norm runs unchanged;
- embeddings scaled by sqrt(hidden), rounded to the model's dtype first (transformers keeps the
  normalizer as a tensor cast to the weights' dtype: sqrt(3072) is 55.5 in bf16);
- gelu_pytorch_tanh gating; softmax scale query_pre_attn_scalar ** -0.5;
- sliding-window layers beside full ones (config.layer_types), each with its own RoPE table on
  Gemma 3 (rope_local_theta for the sliding ones), QK-norm over head_dim on Gemma 3;
- attention scores soft-capped (Gemma 2: s -> c tanh(s / c), in ops.paged_attention) and the final
  logits likewise (compute_logits)."""
from __future__ import annotations

import torch
from torch import nn

from ridge.config import ModelConfig

from ..layers.decoder import CausalLM, DecoderLayer, RMSNorm


class GemmaDecoderLayer(DecoderLayer):
    """llama's layer (its attention with this layer's window and soft-cap, its gated MLP) plus
    the MLP's own input norm and both branches' output norms."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.softcap = cfg.attn_logit_softcapping

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        # (h, residual) carry the stream as their sum, as in llama's layer: each norm that joins a
        # branch's output to the stream is the fused add-and-norm; the post-norms stand alone.
        h, residual = self.input_layernorm.forward(h, residual)
        h = self.post_attention_layernorm.forward(self.attention(h, positions, cos_sin, meta, kv))[0]
        h, residual = self.pre_feedforward_layernorm.forward(h, residual)
        return self.post_feedforward_layernorm.forward(self.mlp(h))[0], residual


class GemmaCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_model_len: int | None = None):
        super().__init__(cfg, max_model_len)
        self.embed_scale = 1.0

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return GemmaDecoderLayer(cfg, index)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).mul_(self.embed_scale)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def load_globals(self, sd, device, dtype, freq_factors=None) -> None:
        super().load_globals(sd, device, dtype, freq_factors)
        cfg = self.cfg
        # transformers: embeddings * torch.tensor(sqrt(hidden)).to(the weights' dtype)
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5).to(dtype))
