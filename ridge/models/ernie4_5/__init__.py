"""ERNIE 4.5 dense (Ernie4_5Config, the 0.3B): llama's decoder with one use_bias flag for every
projection, and RoPE over interleaved pairs (dims 2i and 2i + 1 rotate together, transformers'
GLM-style rotate_half) where llama's layer rotates halves (i and i + D/2). The model turns one
into the other exactly by reordering each q and k head's rows (model.py), so the kernels run as
for llama.

GGUF ernie4_5 (llama.cpp's converter: Ernie4_5Model): the checkpoint's rows as they are (llama.cpp
runs its interleaved NORM rope on them), reordered by the model as from Hugging Face."""
from __future__ import annotations

from ridge.quant.gguf_config import GGUFFamily, output_biases, refuse_yarn_attn_factor
from ridge.quant.gguf_loader import BIAS_NAMES
from ridge.quant.hf_config import HFConfig, HFFamily, rope_fields
from ridge.quant.spec import ModelSpec

from ..llama import LLAMA_DEFAULTS
from .model import Ernie4_5CausalLM

__all__ = ["SPEC", "Ernie4_5CausalLM"]


def read_ernie4_5(c: HFConfig, kw: dict) -> dict:
    b = c.flag("use_bias")
    return dict(attention_bias=b, o_bias=b, mlp_bias=b, **rope_fields(c, kw["head_dim"]))


def read_ernie4_5_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    refuse_yarn_attn_factor("ernie4_5", a, kw, path)
    return output_biases(names)


SPEC = ModelSpec(
    "ernie4_5", Ernie4_5CausalLM,
    HFFamily(dict(LLAMA_DEFAULTS, vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18,
                  num_attention_heads=16, num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0, use_bias=False), read_ernie4_5),
    GGUFFamily("ernie4_5", read=read_ernie4_5_gguf, keys=frozenset({"rope.scaling.attn_factor"}), names=BIAS_NAMES),
)
