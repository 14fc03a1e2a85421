"""Mixtral (MixtralConfig in transformers 5.24, with its defaults): llama's attention with a
window on every layer, and every layer a mixture of num_local_experts experts,
intermediate_size wide, of which each token takes the top k of a softmax, renormalised.

GGUF: llama.cpp's converter writes Mixtral as llama (LlamaModel) with llama.expert_count, which
tells it from llama; the experts' width is feed_forward_length; Q and K rows permuted as llama's."""
from __future__ import annotations

from ridge.quant.fuse import WeightLayout, stacked_experts
from ridge.quant.gguf_config import EXPERT_KEYS, GGUFFamily, expert_fields
from ridge.quant.gguf_loader import split_experts
from ridge.quant.hf_config import MOE_IGNORED, HFConfig, HFFamily, experts_count, moe_fields, rope_fields, window_all
from ridge.quant.spec import ModelSpec

from ..layers.moe import MoeCausalLM

DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, tie_word_embeddings=False,
                sliding_window=None, num_experts_per_tok=2, num_local_experts=8, rope_parameters=None,
                rope_theta=1_000_000.0)
# Mixtral's jitter scales the router's input only in training.
IGNORED = MOE_IGNORED | {"router_jitter_noise"}
# Under model.layers.{i}.: the original checkpoints' names, and transformers 5's.
EXPERTS = (("block_sparse_moe.", "gate", "w1", "w3", "w2"), ("mlp.", "gate", "w1", "w3", "w2"))


def read_mixtral(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    experts, k = experts_count(c, "num_local_experts")
    if not experts:
        c.refuse("num_local_experts", experts, "Mixtral's every layer is a mixture of experts")
    return dict(**rope_fields(c, kw["head_dim"]), **window_all(c, n),
                **moe_fields(experts, k, kw["intermediate_size"], list(range(n)), n, True))


def read_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    return expert_fields(a, kw, names, path, width=kw["intermediate_size"])


SPEC = ModelSpec(
    "mixtral", MoeCausalLM,
    HFFamily(DEFAULTS, read_mixtral, IGNORED),
    GGUFFamily("llama", claims=lambda meta: bool(meta("expert_count")), read=read_gguf, keys=EXPERT_KEYS,
               tensor=split_experts(EXPERTS[-1]), permuted_qk=True),
    WeightLayout(experts=stacked_experts(*EXPERTS)),
)
