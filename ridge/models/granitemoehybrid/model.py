"""Granite 4 hybrid, as transformers' modeling_granitemoehybrid computes it: Mamba2 layers
(ridge/models/layers/mamba2.py, their state in the slot pool beside the paged KV) and attention
layers as layer_types says, each followed by its MLP, with Granite's multipliers: embeddings
times embedding_multiplier, each sublayer's output times residual_multiplier before the residual
add, attention_multiplier as the softmax scale, the logits divided by logits_scaling.

The MLP: the routed experts (router: the top k logits, then a softmax over them; experts
intermediate_size wide) plus the shared MLP (shared_intermediate_size), or the shared MLP alone
where num_local_experts is 0. Attention layers rotate q and k where position_embedding_type is
rope, and are NoPE otherwise."""
from __future__ import annotations

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.quant.experts import FP8Experts
from ridge.quant.linear import FP8Linear

from ..granite.model import GraniteCausalLM, GraniteDecoderLayer
from ..layers.decoder import ACT_AND_MUL, CausalLM, RMSNorm
from ..layers.mamba2 import Mamba2Mixer
from ..layers.moe import MoeCausalLM, Router, SharedExperts


def add_mlp(layer: nn.Module, cfg: ModelConfig, index: int) -> None:
    """The layer's MLP modules, under the names the fused checkpoint gives them."""
    if cfg.is_moe_layer(index):
        layer.router = Router(cfg)
        layer.experts = FP8Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        layer.shared_experts = SharedExperts(cfg)
    else:
        layer.gate_up_proj = FP8Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        layer.down_proj = FP8Linear(cfg.intermediate_size, cfg.hidden_size)
    layer.act_and_mul = ACT_AND_MUL[cfg.hidden_act]


def run_mlp(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    if hasattr(layer, "router"):
        ids, weights = layer.router.forward(h)
        return layer.experts.forward(h, ids, weights) + layer.shared_experts.forward(h)
    return layer.down_proj.forward(layer.act_and_mul(layer.gate_up_proj.forward(h)))


class GraniteHybridAttentionLayer(GraniteDecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        del self.gate_up_proj, self.down_proj
        add_mlp(self, cfg, index)

    def mlp(self, h):
        return run_mlp(self, h)


class GraniteHybridMambaLayer(nn.Module):
    """A Mamba2 layer and its MLP; kv is its LayerState (cache/state_cache.py)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = Mamba2Mixer(cfg, cfg.rms_norm_eps)
        add_mlp(self, cfg, index)

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        m = self.cfg.residual_multiplier
        h, residual = self.input_layernorm.forward(h, residual)
        h, residual = self.post_attention_layernorm.forward(self.mixer.forward(h, meta, kv) * m, residual)
        return run_mlp(self, h) * m, residual


class GraniteHybridCausalLM(GraniteCausalLM, MoeCausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        if cfg.is_linear_layer(index):
            return GraniteHybridMambaLayer(cfg, index)
        return GraniteHybridAttentionLayer(cfg, index)

    def load_layer(self, i: int, sd, device: torch.device, dtype: torch.dtype) -> None:
        CausalLM.load_layer(self, i, sd, device, dtype)
        layer, p = self.layers[i], f"layers.{i}."
        if hasattr(layer, "router"):
            layer.router.weight = sd[p + "router.weight"].float().to(device)
            layer.experts.load({k[len(p) + 8:]: t for k, t in sd.items() if k.startswith(p + "experts.")},
                               device, dtype)
        if isinstance(layer, GraniteHybridMambaLayer):
            layer.mixer.load_extra(sd, p + "mixer.", device)
