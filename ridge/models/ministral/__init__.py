"""Ministral (MinistralConfig, Ministral 8B): llama's decoder with layer_types choosing each
layer's attention, every layer sliding by default where sliding_window is set. llama.cpp writes
Ministral GGUFs as llama, which ridge reads as llama."""
from __future__ import annotations

from ridge.quant.hf_config import HFConfig, HFFamily, rope_fields, window_from_layer_types
from ridge.quant.spec import ModelSpec

from ..layers.decoder import CausalLM
from ..llama import LLAMA_DEFAULTS


def read_ministral(c: HFConfig, kw: dict) -> dict:
    n, window = kw["num_layers"], c.positive_int("sliding_window")
    default = ["sliding_attention" if window is not None else "full_attention"] * n
    if window is None and "sliding_attention" in (c.get("layer_types") or default):
        c.refuse("sliding_window", None, "sliding layers need a window (transformers' Ministral cannot run without one)")
    return {**rope_fields(c, kw["head_dim"]), **window_from_layer_types(c, n, window, default)}


SPEC = ModelSpec("ministral", CausalLM, HFFamily(
    dict(LLAMA_DEFAULTS, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=4096 * 32,
         sliding_window=4096, layer_types=None), read_ministral))
