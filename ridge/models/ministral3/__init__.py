"""Ministral 3 (Ministral3Config, the text model of the Ministral 3 checkpoints): Mistral's
decoder (a window on every layer where sliding_window is set) with YaRN, and q scaled after RoPE
by 1 + llama_4_scaling_beta * log(1 + floor(p / original_max_position_embeddings)) at position p
(ModelConfig.query_scale, run by llama's layer): both read from rope_parameters, where
Ministral3Config keeps llama_4_scaling_beta beside YaRN's own keys. Ministral3Config carries no
layer_types (transformers warns and ignores them), so neither does ridge.

The Hub ships Ministral 3 as Mistral3ForConditionalGeneration (a Pixtral vision tower beside
this text model): ridge/models/mistral3/ reads that wrapper, its text_config through this family.

GGUF: llama.cpp writes these checkpoints as mistral3 (YaRN and the query scale's beta in its own
keys, the period its original context), read by gguf.py."""
from __future__ import annotations

from ridge.quant.hf_config import HFConfig, HFFamily, rope_fields, window_all
from ridge.quant.spec import ModelSpec

from ..layers.decoder import CausalLM
from ..llama import LLAMA_DEFAULTS
from . import gguf

# Ministral3Config.__post_init__'s rope_parameters where a config leaves them out.
DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 16384,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
# rope_parameters' keys that are not RoPE's: the query scale's beta, and the context the
# config class copies in (Ministral3Config.ignore_keys_at_rope_validation).
OWN_KEYS = ("llama_4_scaling_beta", "max_position_embeddings")


def _query_scale(c: HFConfig, params: dict) -> dict:
    beta, period = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        c.refuse("rope_parameters.llama_4_scaling_beta", beta, "expected a number (transformers' Ministral 3 "
                                                               "scales every query by it)")
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        c.refuse("rope_parameters.original_max_position_embeddings", period,
                 "expected a positive integer: the query scale's period")
    return dict(beta=float(beta), period=period)


def read_ministral3(c: HFConfig, kw: dict) -> dict:
    params = c.get("rope_scaling") or c.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(params, dict):
        c.refuse("rope_parameters", params, "expected a JSON object")
    view = HFConfig({**c.values, "rope_scaling": None,
                     "rope_parameters": {k: v for k, v in params.items() if k not in OWN_KEYS}}, c.path, c.defaults)
    return dict(**rope_fields(view, kw["head_dim"]), **window_all(c, kw["num_layers"]),
                query_scale=_query_scale(c, params))


MINISTRAL3_DEFAULTS = dict(LLAMA_DEFAULTS, vocab_size=131072, intermediate_size=14336, num_hidden_layers=34,
                          num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-5,
                          sliding_window=None)

SPEC = ModelSpec("ministral3", CausalLM, HFFamily(MINISTRAL3_DEFAULTS, read_ministral3),
                 gguf=gguf.FAMILY)  # GGUF as llama.cpp writes it: gguf.py
