"""Qwen3: Qwen2's windows, QK-norm over each head, attention_bias on q, k, v and o
(Qwen3Config); GGUF qwen3, stored unpermuted. Qwen3's embedding models (a base model's
checkpoint, without the "model." prefix) read as the same family."""
from __future__ import annotations

from ridge.quant.gguf_config import GGUFFamily
from ridge.quant.hf_config import HFConfig, HFFamily, attention_biases, rope_fields
from ridge.quant.spec import ModelSpec

from ..layers.decoder import CausalLM
from ..qwen2 import QWEN_DEFAULTS, qwen_windows


def read_qwen3(c: HFConfig, kw: dict) -> dict:
    return dict(qk_norm=True, **attention_biases(c, mlp=False), **rope_fields(c, kw["head_dim"]),
                **qwen_windows(c, kw["num_layers"]))


SPEC = ModelSpec("qwen3", CausalLM, HFFamily(dict(QWEN_DEFAULTS, head_dim=128, attention_bias=False), read_qwen3),
                 GGUFFamily("qwen3"))
