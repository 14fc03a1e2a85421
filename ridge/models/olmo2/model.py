"""OLMo 2, as transformers' Olmo2 modeling code computes it: no norms before the
attention and the MLP, a norm on each one's output before it joins the residual
stream (post_attention_layernorm, post_feedforward_layernorm), and QK-norm over
the whole q and k projections (num_heads * head_dim, num_kv_heads * head_dim),
not per head."""
from __future__ import annotations

from ridge.config import ModelConfig

from ..layers.decoder import CausalLM, DecoderLayer, RMSNorm


class Olmo2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps)

    def norm_qk(self, q, k):
        T = q.shape[0]
        return (self.q_norm.forward(q.reshape(T, -1))[0].view(q.shape),
                self.k_norm.forward(k.reshape(T, -1))[0].view(k.shape))

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        # (h, residual) carry the stream as their sum, as in llama's layer; the stream enters
        # attention un-normed.
        stream = h if residual is None else h + residual
        stream = stream + self.post_attention_layernorm.forward(self.attention(stream, positions, cos_sin, meta, kv))[0]
        return self.post_feedforward_layernorm.forward(self.mlp(stream))[0], stream


class Olmo2CausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> DecoderLayer:
        return Olmo2DecoderLayer(cfg, index)
