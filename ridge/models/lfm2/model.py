"""LFM2, as transformers' modeling_lfm2 computes it: gated short-convolution layers beside GQA
attention layers with QK-norm (layer_types). A convolution layer's state, the last K - 1 inputs
of its convolution, lives in the slot pool beside the paged KV (cache/state_cache.py).

Convolution layer, per token: in_proj's rows are [B | C | x]; the depthwise causal convolution
of conv_L_cache taps (no activation) runs over B * x; its output times C goes through out_proj.
Every layer then adds a SwiGLU MLP (w1 the gate, w3 the up, w2 the down: gate_up_proj and
down_proj at load). The attention layers are llama's with q and k normed per head."""
from __future__ import annotations

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.kernels import ops
from ridge.quant.linear import FP8Linear

from ..layers.decoder import ACT_AND_MUL, CausalLM, DecoderLayer, RMSNorm


class ShortConvLayer(nn.Module):
    """A gated short-convolution layer and its MLP; kv is its LayerState (cache/state_cache.py)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        bias = cfg.linear_attention["bias"]
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.in_proj = FP8Linear(h, 3 * h, bias=bias)  # [B | C | x]
        self.out_proj = FP8Linear(h, h, bias=bias)
        self.register_buffer("conv1d_weight", torch.empty(0))  # [h, K] fp32
        self.conv1d_bias = None  # [h] fp32 where conv_bias
        self.gate_up_proj = FP8Linear(h, 2 * cfg.intermediate_size)
        self.down_proj = FP8Linear(cfg.intermediate_size, h)
        self.act_and_mul = ACT_AND_MUL[cfg.hidden_act]

    def load_extra(self, sd, prefix: str, device: torch.device) -> None:
        """The convolution's taps (and bias), outside FP8Linear and RMSNorm: fp32, as the kernels take them."""
        self.conv1d_weight = sd[prefix + "conv1d_weight"].float().contiguous().to(device)
        b = sd.get(prefix + "conv1d_bias")
        self.conv1d_bias = None if b is None else b.float().contiguous().to(device)

    def short_conv(self, h, meta, state):
        b, c, x = self.in_proj.forward(h).float().chunk(3, dim=-1)
        bx = (b * x).contiguous()
        # A step of decodes only (one token each, every one after its first) takes the one-token
        # form; a step that keeps states (speculation, prefix checkpoints) the varlen one.
        keep = meta.token_state_slots
        decode = keep is None and all(q == 1 and s > 1 for q, s in zip(meta.query_lens_host, meta.seq_lens_host))
        if decode:
            y = ops.causal_conv1d_update(bx, self.conv1d_weight, self.conv1d_bias, state.conv, meta.state_slots)
        else:
            y = ops.causal_conv1d(bx, self.conv1d_weight, self.conv1d_bias, state.conv, meta.query_start_loc,
                                  meta.state_slots, meta.has_initial_state, token_state_slots=keep)
        return self.out_proj.forward((c * y).to(h.dtype))

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        h, residual = self.input_layernorm.forward(h, residual)
        h = self.short_conv(h, meta, kv)
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return self.down_proj.forward(self.act_and_mul(self.gate_up_proj.forward(h))), residual


class Lfm2CausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return ShortConvLayer(cfg, index) if cfg.is_linear_layer(index) else DecoderLayer(cfg, index)

    def load_layer(self, i: int, sd, device: torch.device, dtype: torch.dtype) -> None:
        super().load_layer(i, sd, device, dtype)
        layer = self.layers[i]
        if isinstance(layer, ShortConvLayer):
            layer.load_extra(sd, f"layers.{i}.", device)
