"""Qwen2 (Qwen2.5): llama's decoder with q, k and v biases and the sliding window of the
layers from max_window_layers on (Qwen2Config); GGUF qwen2, stored unpermuted."""
from __future__ import annotations

from ridge.quant.gguf_config import GGUFFamily
from ridge.quant.hf_config import HFConfig, HFFamily, rope_fields, window_from_layer_types
from ridge.quant.spec import ModelSpec

from ..layers.decoder import CausalLM
from ..llama import LLAMA_DEFAULTS

QWEN_DEFAULTS = dict(LLAMA_DEFAULTS, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
                     max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096,
                     max_window_layers=28, layer_types=None)


def qwen_windows(c: HFConfig, n: int) -> dict:
    # transformers: sliding_window counts only with use_sliding_window, and then layers from
    # max_window_layers on slide, unless layer_types says otherwise.
    window = c.positive_int("sliding_window") if c.flag("use_sliding_window") else None
    first = c.get("max_window_layers")
    if isinstance(first, bool) or not isinstance(first, int):
        c.refuse("max_window_layers", first, "expected an integer")
    default = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    return window_from_layer_types(c, n, window, default)


def read_qwen2(c: HFConfig, kw: dict) -> dict:
    return dict(attention_bias=True, **rope_fields(c, kw["head_dim"]), **qwen_windows(c, kw["num_layers"]))


SPEC = ModelSpec("qwen2", CausalLM, HFFamily(QWEN_DEFAULTS, read_qwen2), GGUFFamily("qwen2"))
