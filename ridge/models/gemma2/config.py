"""Gemma 2's config, and what Gemma 3 reads alike (ridge/models/gemma3/ builds on it).

Hugging Face: the fields Gemma2Config reads in transformers 5.24, with its defaults, honoured or
refused by name. GGUF (general.architecture gemma2, gemma3: llama.cpp's converter), read as
llama.cpp reads them (llama-model.cpp's hparams):
- layer types: Gemma 2 alternates from a sliding layer, Gemma 3 repeats 5 sliding : 1 full; the
  window is attention.sliding_window (Gemma 2: 4096 where absent; Gemma 3: no sliding layers);
- soft-caps attn_logit_softcapping (Gemma 2, default 50) and final_logit_softcapping (default
  30 on Gemma 2, none on Gemma 3);
- no query_pre_attn_scalar in the format: llama.cpp scales by head_dim ** -0.5, except the 27B
  models (46 and 62 layers), which use (hidden / heads) ** -0.5, as their HF configs say;
- norms stored as the multiplier 1 + w (the converter adds the 1), which the model takes as is.
Q and K rows are stored unpermuted (Gemma's RoPE is the rotate-half one)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import WeightLayout
from ridge.quant.hf_config import HFConfig, rope_fields, window_from_layer_types

GEMMA_COMMON = dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                    tie_word_embeddings=True, rope_parameters=None, attention_bias=False, query_pre_attn_scalar=256,
                    sliding_window=4096, layer_types=None)
GEMMA2_DEFAULTS = dict(GEMMA_COMMON, vocab_size=256000, max_position_embeddings=8192, final_logit_softcapping=30.0,
                       attn_logit_softcapping=50.0, use_bidirectional_attention=None)
ROPE_TYPES = ("default", "linear")  # what Gemma checkpoints use
# Gemma norms both branches' inputs and outputs; llama.cpp's ffn_norm is the MLP's input norm.
WEIGHTS = WeightLayout(norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                              "post_feedforward_layernorm"))
GGUF_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GGUF_KEYS = frozenset({"attention.sliding_window", "attention.sliding_window_pattern", "final_logit_softcapping"})


def cap(c: HFConfig, key: str) -> float | None:
    v = c.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        c.refuse(key, v, "expected a positive number or null")
    return None if v is None else float(v)


def read_gemma(c: HFConfig, kw: dict, *, period: Callable[[HFConfig], int], rope: Callable[[HFConfig, dict], dict],
               attn_cap: bool = True) -> dict:
    """period(c): every period-th layer is full, the others slide; rope(c, kw): the RoPE fields;
    attn_cap: the version defines an attention soft-cap (else a config that sets one is refused)."""
    if kw["hidden_act"] != "gelu_pytorch_tanh":
        c.refuse("hidden_activation", c.get("hidden_activation"), "ridge runs Gemma with gelu_pytorch_tanh")
    if c.get("use_bidirectional_attention"):
        c.refuse("use_bidirectional_attention", True, "ridge runs causal decoders only")
    attn = cap(c, "attn_logit_softcapping")
    if not attn_cap and attn is not None:
        # transformers' Gemma 3 reads the field but never applies it, and llama.cpp's converter
        # refuses it: no reference says what such a model computes.
        c.refuse("attn_logit_softcapping", attn, "Gemma 3 defines no attention soft-cap")
    n, every = kw["num_layers"], period(c)
    default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    window = c.positive_int("sliding_window")
    if window is None and "sliding_attention" in (c.get("layer_types") or default):
        c.refuse("sliding_window", None, "sliding layers need a window (transformers' Gemma cannot run without one)")
    windows = window_from_layer_types(c, n, window, default)
    ropes = rope(c, kw)
    scalar = c.number("query_pre_attn_scalar")
    if scalar <= 0:
        c.refuse("query_pre_attn_scalar", scalar, "expected a positive number")
    bias = c.flag("attention_bias")  # q, k, v and o
    return dict(attention_bias=bias, o_bias=bias, softmax_scale=scalar ** -0.5, **windows, **ropes,
                attn_logit_softcapping=attn, final_logit_softcapping=cap(c, "final_logit_softcapping"))


def read_gemma2(c: HFConfig, kw: dict) -> dict:
    return dict(read_gemma(c, kw, period=lambda c: 2, rope=lambda c, kw: rope_fields(c, kw["head_dim"], types=ROPE_TYPES)),
                qk_norm=False)


def shift_norms(sd: dict[str, torch.Tensor]) -> None:
    """HF stores a Gemma norm's w, which multiplies by 1 + w (in fp32, as transformers adds it);
    the model takes the multiplier, which is what a GGUF stores."""
    for name, t in sd.items():
        if name.endswith("norm.weight"):
            sd[name] = t.float() + 1.0


def positive(path, key: str, v):
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        raise ModelLoadError(path, f"{key}={v!r}: expected a positive number")
    return v


def read_gemma_gguf(arch: str, a, kw: dict, names: set[str], path, *, period: int, layers_27b: int,
                    window: int | None, attn_cap: float | None, final_cap: float | None) -> dict:
    """A Gemma GGUF's fields beyond the common ones; arch: its general.architecture, period its
    fixed sliding pattern, layers_27b the 27B model's depth; window, attn_cap (None: the version
    has none) and final_cap: the defaults where the file has no value."""
    pattern = a("attention.sliding_window_pattern")
    if pattern is not None and pattern != period:  # llama.cpp's Gemma reads a fixed period
        raise ModelLoadError(path, f"{arch}.attention.sliding_window_pattern={pattern!r}: llama.cpp runs "
                                   f"{arch} with a period of {period}")
    window = positive(path, f"{arch}.attention.sliding_window", a("attention.sliding_window", window))
    types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(kw["num_layers"])]
    scalar = kw["hidden_size"] // kw["num_heads"] if kw["num_layers"] == layers_27b else kw["head_dim"]
    out = dict(hidden_act="gelu_pytorch_tanh", softmax_scale=scalar ** -0.5,
               sliding_window=window, layer_types=types if window is not None else None,
               o_bias="blk.0.attn_output.bias" in names,
               attn_logit_softcapping=None if attn_cap is None else
               positive(path, f"{arch}.attn_logit_softcapping", a("attn_logit_softcapping", attn_cap)),
               final_logit_softcapping=positive(path, f"{arch}.final_logit_softcapping",
                                                 a("final_logit_softcapping", final_cap)))
    if (kw["rope_scaling"] or {}).get("rope_type") not in (None, "linear"):
        raise ModelLoadError(path, f"{arch}.rope.scaling.type={kw['rope_scaling']['rope_type']!r}: ridge runs "
                                   "Gemma with none or linear")
    return out
