"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral, gpt-oss, GLM-4.5): llama's layer with its MLP
replaced, in the layers ModelConfig.is_moe_layer names, by a router and stacked FP8 experts
(gpt-oss: biases on the router and the experts, the clamped SwiGLU, and attention sinks;
GLM-4.5: a sigmoid router with a correction bias and expert groups, and shared experts; Qwen3-Next
and Qwen3.5-MoE: a shared expert behind a sigmoid gate, on their own layers through SparseMlp).

The router's logits are computed in fp32 from fp32 weights, whatever the activations' dtype,
and each family's rule turns them into k experts and their weights (ModelConfig.moe_router):
the two common rules through ops.moe_route (ridge's C kernel on a CPU, which breaks ties to the
lower expert; torch.topk, which transformers runs, elsewhere), the others here. The
experts run through ops.fused_moe (kernels/moe.py): grouped per expert on CPU, the grouped
kernel on a GPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig
from ridge.kernels import ops
from ridge.kernels.decoder_native import MoeSpec
from ridge.kernels.timing import section
from ridge.quant.experts import FP8Experts
from ridge.quant.linear import FP8Linear

from .decoder import ACT_AND_MUL, CausalLM, DecoderLayer


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k, self.kind, self.norm = cfg.num_experts_per_tok, cfg.moe_router, cfg.norm_topk_prob
        self.groups, self.topk_groups, self.scale = cfg.moe_n_group, cfg.moe_topk_group, cfg.routed_scaling_factor
        self.register_buffer("weight", torch.empty(0))  # [E, H] fp32
        self.register_buffer("bias", None)  # [E] fp32 (gpt-oss)
        self.register_buffer("correction", None)  # [E] fp32: sigmoid_group_topk's e_score_correction_bias

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32)."""
        if self.kind in ("softmax_topk", "topk_softmax"):  # the common rules: an op of their own
            return ops.moe_route(h, self.weight, self.bias, self.kind, self.k, self.norm)
        with section("router"):
            logits = F.linear(h.float(), self.weight, self.bias)  # [T, E]
            if self.kind == "topk_sigmoid":
                top, ids = torch.topk(logits, self.k, dim=-1)
                weights = torch.sigmoid(top)
            else:
                ids, weights = self._sigmoid_group_topk(logits)
            return ids, weights

    def _sigmoid_group_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The correction bias only chooses: experts by sigmoid + bias within the topk_groups groups
        # whose two best experts score highest; their weights are the sigmoids themselves.
        T, E = logits.shape
        scores = logits.sigmoid()
        choice = scores + self.correction
        group_scores = choice.view(T, self.groups, E // self.groups).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        best = torch.topk(group_scores, self.topk_groups, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        choice = choice.masked_fill(~allowed.repeat_interleave(E // self.groups, dim=1), float("-inf"))
        ids = torch.topk(choice, self.k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale


class SharedExperts(nn.Module):
    """A gated MLP every token runs beside the routed experts (GLM-4.5's shared experts). Gated
    (Qwen3-Next's, cfg.extra["shared_expert_gate"]): its output times sigmoid(gate . h), the
    gate a [1, H] row kept in fp32 as a router's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = FP8Linear(cfg.hidden_size, 2 * cfg.shared_expert_intermediate_size)
        self.down_proj = FP8Linear(cfg.shared_expert_intermediate_size, cfg.hidden_size)
        self.act_and_mul = ACT_AND_MUL[cfg.hidden_act]
        self.gated = bool(cfg.extra.get("shared_expert_gate"))
        self.register_buffer("gate", None)  # [1, H] fp32 where gated

    def forward(self, h):
        out = self.down_proj.forward(self.act_and_mul(self.gate_up_proj.forward(h)))
        if not self.gated:
            return out
        return out * torch.sigmoid(F.linear(h.float(), self.gate)).to(out.dtype)


class SparseMlp:
    """A layer whose MLP is a mixture of experts: make_experts replaces the dense MLP (built by
    the layer's own __init__) with a router, the stacked experts and any shared experts."""

    def make_experts(self, cfg: ModelConfig) -> None:
        del self.gate_up_proj, self.down_proj  # the dense MLP's, which this layer has not
        self.router = Router(cfg)
        self.experts = FP8Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                  cfg.moe_act or cfg.hidden_act, cfg.moe_bias, cfg.swiglu_alpha, cfg.swiglu_limit)
        self.shared_experts = SharedExperts(cfg) if cfg.shared_expert_intermediate_size else None

    def moe_spec(self) -> MoeSpec | None:
        """This MLP as the one-call layers may run it in C (kernels/decoder_native.py): a router
        of the two rules ops.moe_route runs and no shared experts; else None (run here)."""
        r, e = self.router, self.experts
        if self.shared_experts is not None or r.kind not in ("softmax_topk", "topk_softmax"):
            return None
        return MoeSpec(r.weight, r.bias, r.kind, r.k, bool(r.norm), e.cpu, e.b_gate_up, e.b_down, e.act, *e.swiglu)

    def mlp(self, h):
        ids, weights = self.router.forward(h)
        out = self.experts.forward(h, ids, weights)
        return out if self.shared_experts is None else out + self.shared_experts.forward(h)


class MoeDecoderLayer(SparseMlp, DecoderLayer):
    """A sparse layer: attention as llama's, then router -> experts in place of the dense MLP."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        self.make_experts(cfg)


class MoeCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return MoeDecoderLayer(cfg, index) if cfg.is_moe_layer(index) else DecoderLayer(cfg, index)

    def load_layer(self, i: int, sd, device: torch.device, dtype: torch.dtype) -> None:
        super().load_layer(i, sd, device, dtype)
        layer = self.layers[i]
        if self.cfg.attention_sinks:
            layer.sinks = sd[f"layers.{i}.sinks"].float().to(device)
        if isinstance(layer, SparseMlp):
            p = f"layers.{i}."
            layer.router.weight = sd[p + "router.weight"].float().to(device)
            if p + "router.bias" in sd:
                layer.router.bias = sd[p + "router.bias"].float().to(device)
            if self.cfg.moe_router == "sigmoid_group_topk":
                layer.router.correction = sd[p + "router.correction"].float().to(device)
            layer.experts.load({k[len(p) + 8:]: t for k, t in sd.items() if k.startswith(p + "experts.")},
                               device, dtype)
            if layer.shared_experts is not None and layer.shared_experts.gated:
                layer.shared_experts.gate = sd[p + "shared_experts.gate.weight"].float().to(device)
