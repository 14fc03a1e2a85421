"""The model families ridge runs from Hugging Face directories: for each model_type,
the fields its transformers model reads, how ridge honours them, and the values
it refuses (quant/hf_config.py). docs/architecture.md (## Models) lists them;
tests/test_families.py checks every field of transformers' config classes
against these declarations and each family's logits against transformers.

A family registers with register(): model_type -> Family."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .hf_config import HFConfig, common_fields, rope_fields, window_all, window_from_layer_types
from .hf_gemma import GEMMA2_DEFAULTS, GEMMA3_DEFAULTS, read_gemma
from .hf_moe import (GPT_OSS_DEFAULTS, MIXTRAL_DEFAULTS, MIXTRAL_IGNORED, MOE_IGNORED, QWEN3_MOE_DEFAULTS, read_gpt_oss,
                     read_mixtral, read_qwen3_moe)

# PreTrainedConfig's own fields and the keys save_pretrained adds: none changes a causal LM's math.
BASE_IGNORED = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype", "torch_dtype",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "model_type",
    "_name_or_path", "auto_map", "use_cache", "initializer_range", "pad_token_id", "bos_token_id",
    "eos_token_id", "attention_dropout",
})
# What common_fields and rope_fields read for every family.
COMMON_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                 "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta")


@dataclass(frozen=True)
class Family:
    """model_type's reading. defaults: transformers' class defaults of the fields read (COMMON_FIELDS
    and the family's own); ignored: its class fields that do not change the math at inference;
    read: the family's own fields -> ModelConfig keyword arguments, given the common ones."""
    model_type: str
    arch: str
    defaults: dict
    read: Callable[[HFConfig, dict], dict]
    ignored: frozenset = field(default_factory=frozenset)
    act_field: str = "hidden_act"  # the activation's key in the config class

    @property
    def fields(self) -> set[str]:
        return set(self.defaults) | set(COMMON_FIELDS)

    def model_config_kwargs(self, c: HFConfig) -> dict:
        kw = common_fields(c, self.arch, self.act_field)
        return {**kw, **self.read(c, kw)}


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family


_LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                       max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters=None)


def _biases(c: HFConfig, mlp: bool) -> dict:
    """attention_bias: q, k, v and o projections (llama, qwen3, olmo2, granite); mlp_bias: gate, up, down."""
    b = c.flag("attention_bias")
    return dict(attention_bias=b, o_bias=b, mlp_bias=c.flag("mlp_bias") if mlp else False)


def _read_llama(c: HFConfig, kw: dict) -> dict:
    return {**_biases(c, mlp=True), **rope_fields(c, kw["head_dim"])}


def _read_mistral(c: HFConfig, kw: dict) -> dict:
    return {**rope_fields(c, kw["head_dim"]), **window_all(c, kw["num_layers"])}


def _qwen_windows(c: HFConfig, n: int) -> dict:
    # transformers: sliding_window counts only with use_sliding_window, and then layers from
    # max_window_layers on slide, unless layer_types says otherwise.
    window = c.positive_int("sliding_window") if c.flag("use_sliding_window") else None
    first = c.get("max_window_layers")
    if isinstance(first, bool) or not isinstance(first, int):
        c.refuse("max_window_layers", first, "expected an integer")
    default = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    return window_from_layer_types(c, n, window, default)


def _read_qwen2(c: HFConfig, kw: dict) -> dict:
    return dict(attention_bias=True, **rope_fields(c, kw["head_dim"]), **_qwen_windows(c, kw["num_layers"]))


def _read_qwen3(c: HFConfig, kw: dict) -> dict:
    return dict(qk_norm=True, **_biases(c, mlp=False), **rope_fields(c, kw["head_dim"]),
                **_qwen_windows(c, kw["num_layers"]))


_QWEN_DEFAULTS = dict(_LLAMA_DEFAULTS, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
                      max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096,
                      max_window_layers=28, layer_types=None)

register(Family("llama", "llama", dict(_LLAMA_DEFAULTS, attention_bias=False, mlp_bias=False), _read_llama,
                frozenset({"pretraining_tp"})))
register(Family("mistral", "mistral", dict(_LLAMA_DEFAULTS, intermediate_size=14336, num_key_value_heads=8,
                                           max_position_embeddings=4096 * 32, sliding_window=4096), _read_mistral))
register(Family("qwen2", "qwen2", _QWEN_DEFAULTS, _read_qwen2))
register(Family("qwen3", "qwen3", dict(_QWEN_DEFAULTS, head_dim=128, attention_bias=False), _read_qwen3))
register(Family("gemma2", "gemma2", GEMMA2_DEFAULTS, read_gemma, act_field="hidden_activation"))
register(Family("gemma3_text", "gemma3_text", GEMMA3_DEFAULTS, read_gemma, act_field="hidden_activation"))


def _read_phi3(c: HFConfig, kw: dict) -> dict:
    # rope: su and yarn are longrope's old names (Phi3Config); original_max_position_embeddings is a
    # class field, so it overrides rope_parameters' own.
    rope = rope_fields(c, kw["head_dim"], types=("default", "longrope"), aliases={"su": "longrope", "yarn": "longrope"},
                       partial_rotary=True, original_max_field=True)
    return {**rope, **window_all(c, kw["num_layers"])}


def _read_olmo2(c: HFConfig, kw: dict) -> dict:
    return dict(qk_norm=True, **_biases(c, mlp=False), **rope_fields(c, kw["head_dim"]))


def _read_granite(c: HFConfig, kw: dict) -> dict:
    return dict(**_biases(c, mlp=True), **rope_fields(c, kw["head_dim"]),
                embedding_multiplier=c.number("embedding_multiplier"),
                residual_multiplier=c.number("residual_multiplier"),
                softmax_scale=c.number("attention_multiplier"), logits_scaling=_divisor(c, "logits_scaling"))


def _divisor(c: HFConfig, key: str) -> float:
    v = c.number(key)
    if v == 0:
        c.refuse(key, v, "the logits are divided by it")
    return v


register(Family("phi3", "phi3", dict(_LLAMA_DEFAULTS, vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                                     max_position_embeddings=4096, original_max_position_embeddings=4096,
                                     rms_norm_eps=1e-5, sliding_window=None, partial_rotary_factor=None),
                _read_phi3, frozenset({"resid_pdrop", "embd_pdrop"})))
register(Family("olmo2", "olmo2", dict(_LLAMA_DEFAULTS, vocab_size=50304, rms_norm_eps=1e-5, attention_bias=False),
                _read_olmo2))
register(Family("granite", "granite", dict(_LLAMA_DEFAULTS, attention_bias=False, mlp_bias=False,
                                           embedding_multiplier=1.0, residual_multiplier=1.0,
                                           attention_multiplier=1.0, logits_scaling=1.0), _read_granite))
register(Family("qwen3_moe", "qwen3_moe", QWEN3_MOE_DEFAULTS, read_qwen3_moe, MOE_IGNORED))
register(Family("mixtral", "mixtral", MIXTRAL_DEFAULTS, read_mixtral, MIXTRAL_IGNORED))
register(Family("gpt_oss", "gpt_oss", GPT_OSS_DEFAULTS, read_gpt_oss, MOE_IGNORED))
