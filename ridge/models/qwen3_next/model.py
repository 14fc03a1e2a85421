"""Qwen3-Next and Qwen3.5-MoE, as transformers' modeling_qwen3_next computes them: Qwen3.5's layers
(ridge/models/qwen3_5/model.py: Gated DeltaNet on the state cache, gated attention with partial
rotary), whose MLP in the sparse layers (ModelConfig.is_moe_layer) is a mixture of experts
(ridge/models/layers/moe.py): the top k of a softmax over every expert (renormalised where
norm_topk_prob), beside a shared expert whose output is scaled by sigmoid(shared_expert_gate . h)."""
from __future__ import annotations

from torch import nn

from ridge.config import ModelConfig

from ..layers.moe import MoeCausalLM, SparseMlp
from ..qwen3_5.model import GatedAttentionLayer, GatedDeltaNetLayer, Qwen35CausalLM


class SparseGatedAttentionLayer(SparseMlp, GatedAttentionLayer):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        self.make_experts(cfg)


class SparseGatedDeltaNetLayer(SparseMlp, GatedDeltaNetLayer):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        self.make_experts(cfg)


class Qwen3NextCausalLM(Qwen35CausalLM, MoeCausalLM):
    """Qwen3.5's loading (the recurrent layers' taps and decay) over MoeCausalLM's (routers, experts)."""

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        if not cfg.is_moe_layer(index):
            return super().make_layer(cfg, index)
        return (SparseGatedDeltaNetLayer if cfg.is_linear_layer(index) else SparseGatedAttentionLayer)(cfg, index)
