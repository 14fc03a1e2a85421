"""Llama (Llama 2 and 3, SmolLM2): the decoder every dense family builds on
(ridge/models/layers/decoder.py), read from LlamaConfig's fields and llama.cpp's llama GGUFs."""
from __future__ import annotations

from ridge.quant.gguf_config import GGUFFamily
from ridge.quant.hf_config import HFConfig, HFFamily, attention_biases, rope_fields
from ridge.quant.spec import ModelSpec

from ..layers.decoder import CausalLM

# LlamaConfig's defaults (transformers 5.24) of the fields every family reads; the families
# built on llama's decoder start from them.
LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                      max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_parameters=None)


def read_llama(c: HFConfig, kw: dict) -> dict:
    return {**attention_biases(c, mlp=True), **rope_fields(c, kw["head_dim"])}


SPEC = ModelSpec(
    "llama", CausalLM,
    HFFamily(dict(LLAMA_DEFAULTS, attention_bias=False, mlp_bias=False), read_llama, frozenset({"pretraining_tp"})),
    # llama.cpp writes Mistral as llama too (read as llama), and Mixtral (claimed by its expert count).
    GGUFFamily("llama", claims=lambda meta: not meta("expert_count"), permuted_qk=True),
)
