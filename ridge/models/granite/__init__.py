"""Granite 3.x (GraniteConfig): llama's layers with four multipliers (model.py): embeddings
times embedding_multiplier, each sublayer's output times residual_multiplier,
attention_multiplier as the softmax scale and the logits divided by logits_scaling.

GGUF granite (llama.cpp's converter: GraniteModel): the multipliers as attention.scale,
embedding_scale, residual_scale and logit_scale, each written only where non-zero (absent:
head_dim ** -0.5 and 1); Q and K rows permuted as llama's."""
from __future__ import annotations

from ridge.quant.gguf_config import GGUFFamily, output_biases, refuse_yarn_attn_factor
from ridge.quant.gguf_loader import BIAS_NAMES
from ridge.quant.hf_config import HFConfig, HFFamily, attention_biases, rope_fields
from ridge.quant.spec import ModelSpec

from ..llama import LLAMA_DEFAULTS
from .model import GraniteCausalLM

__all__ = ["SPEC", "GraniteCausalLM"]


def read_granite(c: HFConfig, kw: dict) -> dict:
    return dict(**attention_biases(c, mlp=True), **rope_fields(c, kw["head_dim"]),
                embedding_multiplier=c.number("embedding_multiplier"),
                residual_multiplier=c.number("residual_multiplier"),
                softmax_scale=c.number("attention_multiplier"), logits_scaling=_divisor(c, "logits_scaling"))


def _divisor(c: HFConfig, key: str) -> float:
    v = c.number(key)
    if v == 0:
        c.refuse(key, v, "the logits are divided by it")
    return v


def read_granite_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    refuse_yarn_attn_factor("granite", a, kw, path)
    return dict(output_biases(names), softmax_scale=a("attention.scale"),
                embedding_multiplier=a("embedding_scale", 1.0), residual_multiplier=a("residual_scale", 1.0),
                logits_scaling=a("logit_scale", 1.0))


SPEC = ModelSpec(
    "granite", GraniteCausalLM,
    HFFamily(dict(LLAMA_DEFAULTS, attention_bias=False, mlp_bias=False, embedding_multiplier=1.0,
                  residual_multiplier=1.0, attention_multiplier=1.0, logits_scaling=1.0), read_granite),
    GGUFFamily("granite", read=read_granite_gguf, permuted_qk=True,
               keys=frozenset({"attention.scale", "embedding_scale", "residual_scale", "logit_scale"}),
               names=BIAS_NAMES),
)
