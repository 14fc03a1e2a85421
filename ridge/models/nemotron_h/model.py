"""Nemotron-H, as transformers' modeling_nemotron_h computes it: a stack of single sublayers, each
an RMSNorm, one mixer and the residual add: Mamba2 (ridge/models/layers/mamba2.py, its state in
the slot pool beside the paged KV), attention without positions (NoPE: no RoPE in any layer,
the softmax scale head_dim ** -0.5, no biases), an MLP without a gate (up, relu squared, down),
or a mixture of such MLPs beside a shared one (routed DeepSeek-V3's way: layers/moe.py Router's
sigmoid_group_topk). An MLP or experts block holds neither KV nor state
(ModelConfig.mixerless_layers).

The experts run one product pair per expert over the rows routed to it (sorted once, one count
read back a layer): ridge's fused expert kernels run gated experts, which these are not. Where
moe_latent_size is set, the experts work in that width between a projection in and one out."""
from __future__ import annotations

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.quant.linear import FP8Linear

from ..layers.decoder import CausalLM, DecoderLayer, RMSNorm
from ..layers.mamba2 import Mamba2Mixer
from ..layers.moe import Router


class NemotronHAttentionLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        del self.gate_up_proj, self.down_proj, self.post_attention_layernorm  # the MLP is a layer of its own

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        h, residual = self.input_layernorm.forward(h, residual)
        return self.attention(h, positions, cos_sin, meta, kv), residual


class NemotronHMambaLayer(nn.Module):
    """A Mamba2 block; kv is its LayerState (cache/state_cache.py)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = Mamba2Mixer(cfg, cfg.rms_norm_eps)

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        h, residual = self.input_layernorm.forward(h, residual)
        return self.mixer.forward(h, meta, kv), residual


class ReluSquaredMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool):
        super().__init__()
        self.up_proj = FP8Linear(hidden, inter, bias=bias)
        self.down_proj = FP8Linear(inter, hidden, bias=bias)

    def forward(self, h):
        return self.down_proj.forward(torch.relu(self.up_proj.forward(h)).square())


class NemotronHMLPLayer(ReluSquaredMLP):
    """An MLP block: down(relu(up(h)) ** 2); kv is None (it holds no cache)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        h, residual = self.input_layernorm.forward(h, residual)
        return super().forward(h), residual


class NemotronHMoELayer(nn.Module):
    """An experts block: the router's k experts weighted, plus the shared MLP; kv is None."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        h, latent = cfg.hidden_size, cfg.extra["moe_latent_size"]
        width = latent or h
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.router = Router(cfg)
        self.experts = nn.ModuleList(ReluSquaredMLP(width, cfg.moe_intermediate_size, False)
                                     for _ in range(cfg.num_experts))
        self.shared_experts = ReluSquaredMLP(h, cfg.shared_expert_intermediate_size, cfg.mlp_bias)
        self.latent_in_proj = FP8Linear(h, latent, bias=cfg.mlp_bias) if latent else None
        self.latent_out_proj = FP8Linear(latent, h, bias=cfg.mlp_bias) if latent else None

    def routed(self, h):
        ids, weights = self.router.forward(h)  # [T, k]
        x = h if self.latent_in_proj is None else self.latent_in_proj.forward(h)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens, picks = order // ids.shape[1], order
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows, pick = tokens[start:start + n], picks[start:start + n]
                y = self.experts[e].forward(x[rows]).float() * weights.reshape(-1)[pick, None]
                out.index_add_(0, rows, y)
                start += n
        out = out.to(x.dtype)
        return out if self.latent_out_proj is None else self.latent_out_proj.forward(out)

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        h, residual = self.input_layernorm.forward(h, residual)
        return self.routed(h) + self.shared_experts.forward(h), residual


class NemotronHCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        if cfg.is_linear_layer(index):
            return NemotronHMambaLayer(cfg, index)
        if cfg.is_moe_layer(index):
            return NemotronHMoELayer(cfg, index)
        if not cfg.holds_kv(index):
            return NemotronHMLPLayer(cfg, index)
        return NemotronHAttentionLayer(cfg, index)

    def load_layer(self, i: int, sd, device: torch.device, dtype: torch.dtype) -> None:
        super().load_layer(i, sd, device, dtype)
        layer = self.layers[i]
        if isinstance(layer, NemotronHMambaLayer):
            layer.mixer.load_extra(sd, f"layers.{i}.mixer.", device)
        if isinstance(layer, NemotronHMoELayer):
            layer.router.weight = sd[f"layers.{i}.router.weight"].float().to(device)
            layer.router.correction = sd[f"layers.{i}.router.correction"].float().to(device)
