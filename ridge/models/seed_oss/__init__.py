"""Seed-OSS (SeedOssConfig): llama's decoder with its biases under three flags: attention_bias
(q, k and v), attention_out_bias (o) and mlp_bias (gate, up and down). Its dropouts
(attention_dropout, residual_dropout) are training's.

GGUF seed_oss (llama.cpp's converter: SeedOssModel): the MLP's input norm is named
post_attention_norm; Q and K rows stored unpermuted (NEOX rope); q, k and v biases."""
from __future__ import annotations

from ridge.quant.gguf_config import GGUFFamily, refuse_yarn_attn_factor
from ridge.quant.hf_config import HFConfig, HFFamily, rope_fields
from ridge.quant.spec import ModelSpec

from ..layers.decoder import CausalLM
from ..llama import LLAMA_DEFAULTS


def read_seed_oss(c: HFConfig, kw: dict) -> dict:
    return dict(attention_bias=c.flag("attention_bias"), o_bias=c.flag("attention_out_bias"),
                mlp_bias=c.flag("mlp_bias"), **rope_fields(c, kw["head_dim"]))


def read_seed_oss_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    refuse_yarn_attn_factor("seed_oss", a, kw, path)
    return {}


SPEC = ModelSpec(
    "seed_oss", CausalLM,
    HFFamily(dict(LLAMA_DEFAULTS, vocab_size=155136, intermediate_size=27648, num_hidden_layers=64,
                  num_attention_heads=80, num_key_value_heads=8, head_dim=128, max_position_embeddings=524288,
                  attention_bias=True, attention_out_bias=False, mlp_bias=False),
             read_seed_oss, frozenset({"pretraining_tp", "residual_dropout"})),
    GGUFFamily("seed_oss", read=read_seed_oss_gguf, keys=frozenset({"rope.scaling.attn_factor"}),
               names={"post_attention_norm.weight": "post_attention_layernorm.weight"}),
)
