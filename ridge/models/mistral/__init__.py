"""Mistral: llama's decoder with a sliding window on every layer (MistralConfig). llama.cpp
writes Mistral GGUFs as llama, which ridge reads as llama (the window is not in the format)."""
from __future__ import annotations

from ridge.quant.hf_config import HFConfig, HFFamily, rope_fields, window_all
from ridge.quant.spec import ModelSpec

from ..layers.decoder import CausalLM
from ..llama import LLAMA_DEFAULTS


def read_mistral(c: HFConfig, kw: dict) -> dict:
    return {**rope_fields(c, kw["head_dim"]), **window_all(c, kw["num_layers"])}


SPEC = ModelSpec("mistral", CausalLM, HFFamily(
    dict(LLAMA_DEFAULTS, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=4096 * 32,
         sliding_window=4096), read_mistral))
