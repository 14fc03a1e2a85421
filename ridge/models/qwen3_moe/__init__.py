"""Qwen3-MoE (Qwen3MoeConfig in transformers 5.24, with its defaults): Qwen3's attention, and a
router over num_experts experts in the sparse layers (ridge/models/layers/moe.py): a softmax
over every expert, then the top k, renormalised where norm_topk_prob. A layer is sparse unless
it is in mlp_only_layers or (index + 1) is not a multiple of decoder_sparse_step; the others run
the dense MLP of intermediate_size.

GGUF qwen3moe (llama.cpp's converter: Qwen3MoeModel): expert_count, expert_used_count and
expert_feed_forward_length (the experts' width); llama.cpp renormalises the k weights (the
format has no norm_topk_prob: a file is read as llama.cpp runs it); stored unpermuted."""
from __future__ import annotations

from ridge.quant.fuse import WeightLayout, stacked_experts
from ridge.quant.gguf_config import EXPERT_KEYS, GGUFFamily, expert_fields
from ridge.quant.gguf_loader import split_experts
from ridge.quant.hf_config import MOE_IGNORED, HFConfig, HFFamily, experts_count, moe_fields, rope_fields
from ridge.quant.spec import ModelSpec

from ..layers.moe import MoeCausalLM

DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                num_attention_heads=32, num_key_value_heads=4, head_dim=None, hidden_act="silu",
                max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters=None, attention_bias=False, use_sliding_window=False, sliding_window=4096,
                decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
                norm_topk_prob=False, mlp_only_layers=None)
EXPERTS = ("mlp.", "gate", "gate_proj", "up_proj", "down_proj")  # under model.layers.{i}.


def _sparse_layers(c: HFConfig, n: int, experts: int) -> list[int]:
    step = c.positive_int("decoder_sparse_step")
    only = c.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        c.refuse("mlp_only_layers", only, "expected a list of layer indices")
    return [i for i in range(n) if experts > 0 and i not in only and (i + 1) % step == 0]


def read_qwen3_moe(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    # Qwen3MoeConfig maps num_experts to num_local_experts, so a saved file may carry either.
    experts, k = experts_count(c, "num_experts", alias="num_local_experts")
    layers = _sparse_layers(c, n, experts)
    # Qwen3MoeConfig: the window counts only with use_sliding_window, and then on every layer.
    window = c.positive_int("sliding_window") if c.flag("use_sliding_window") else None
    b = c.flag("attention_bias")
    return dict(qk_norm=True, attention_bias=b, o_bias=b, **rope_fields(c, kw["head_dim"]),
                sliding_window=window, layer_types=None if window is None else ["sliding_attention"] * n,
                **moe_fields(experts, k, c.positive_int("moe_intermediate_size"), layers, n, c.flag("norm_topk_prob")))


def read_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    return expert_fields(a, kw, names, path)


SPEC = ModelSpec(
    "qwen3_moe", MoeCausalLM,
    HFFamily(DEFAULTS, read_qwen3_moe, MOE_IGNORED),
    GGUFFamily("qwen3moe", read=read_gguf, keys=EXPERT_KEYS | {"expert_feed_forward_length"},
               tensor=split_experts(EXPERTS)),
    WeightLayout(experts=stacked_experts(EXPERTS)),
)
