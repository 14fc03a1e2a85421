"""Gemma 2 and Gemma 3 (text): the fields their transformers models read (Gemma2Config,
Gemma3TextConfig in transformers 5.24, with those classes' defaults), honoured or refused by
name (quant/families.py registers them), and the multimodal Gemma 3 (Gemma3Config) as its text
model. ridge/models/gemma.py runs them."""
from __future__ import annotations

import torch

from .errors import ModelLoadError
from .hf_config import HFConfig, rope_fields, window_from_layer_types

_COMMON = dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
               num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
               tie_word_embeddings=True, rope_parameters=None, attention_bias=False, query_pre_attn_scalar=256,
               sliding_window=4096, layer_types=None)
GEMMA2_DEFAULTS = dict(_COMMON, vocab_size=256000, max_position_embeddings=8192, final_logit_softcapping=30.0,
                       attn_logit_softcapping=50.0, use_bidirectional_attention=None)
# Gemma3TextConfig also takes the pre-transformers-5 keys, which it folds into rope_parameters
# and layer_types: rope_theta, rope_scaling (the full layers'), rope_local_base_freq and
# sliding_window_pattern.
GEMMA3_DEFAULTS = dict(_COMMON, vocab_size=262208, max_position_embeddings=131_072, final_logit_softcapping=None,
                       attn_logit_softcapping=None, use_bidirectional_attention=False, rope_theta=1_000_000.0,
                       rope_scaling=None, rope_local_base_freq=10000.0, sliding_window_pattern=6)
_ROPE_TYPES = ("default", "linear")  # what Gemma checkpoints use


def _cap(c: HFConfig, key: str) -> float | None:
    v = c.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        c.refuse(key, v, "expected a positive number or null")
    return None if v is None else float(v)


def _rope_view(c: HFConfig, params: dict, theta: float, where: str) -> dict:
    """One layer type's RoPE through the common reading (every key checked against its rope_type)."""
    view = HFConfig({"rope_parameters": {"rope_theta": theta, **params}}, f"{c.path} ({where})",
                    {"max_position_embeddings": c.get("max_position_embeddings")})
    return rope_fields(view, c.get("head_dim") or 256, types=_ROPE_TYPES)


def _gemma3_ropes(c: HFConfig) -> dict:
    """Full layers: rope_theta and rope_scaling; sliding layers: their own base. As
    Gemma3TextConfig.convert_rope_params_to_dict: rope_parameters keyed by layer type, a
    rope_scaling updating the full layers' entry, the older keys filling in the bases."""
    params = c.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - {"full_attention", "sliding_attention"}:
        c.refuse("rope_parameters", params, "Gemma 3 keys it by layer type (full_attention, sliding_attention)")
    full = {**(params.get("full_attention") or {"rope_type": "default"}), **(c.get("rope_scaling") or {})}
    local = params.get("sliding_attention") or {"rope_type": "default"}
    f = _rope_view(c, full, full.get("rope_theta", c.get("rope_theta")), "rope_parameters.full_attention")
    s = _rope_view(c, local, local.get("rope_theta", c.get("rope_local_base_freq")),
                   "rope_parameters.sliding_attention")
    return dict(f, rope_local_theta=s["rope_theta"], rope_local_scaling=s["rope_scaling"])


def read_gemma(c: HFConfig, kw: dict) -> dict:
    gemma3 = kw["arch"] == "gemma3_text"
    if kw["hidden_act"] != "gelu_pytorch_tanh":
        c.refuse("hidden_activation", c.get("hidden_activation"), "ridge runs Gemma with gelu_pytorch_tanh")
    if c.get("use_bidirectional_attention"):
        c.refuse("use_bidirectional_attention", True, "ridge runs causal decoders only")
    attn_cap = _cap(c, "attn_logit_softcapping")
    if gemma3 and attn_cap is not None:
        # transformers' Gemma 3 reads the field but never applies it, and llama.cpp's converter
        # refuses it: no reference says what such a model computes.
        c.refuse("attn_logit_softcapping", attn_cap, "Gemma 3 defines no attention soft-cap")
    n = kw["num_layers"]
    period = c.positive_int("sliding_window_pattern") if gemma3 else 2  # 5 : 1 on Gemma 3, alternating on Gemma 2
    default = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]
    window = c.positive_int("sliding_window")
    if window is None and "sliding_attention" in (c.get("layer_types") or default):
        c.refuse("sliding_window", None, "sliding layers need a window (transformers' Gemma cannot run without one)")
    windows = window_from_layer_types(c, n, window, default)
    rope = _gemma3_ropes(c) if gemma3 else rope_fields(c, kw["head_dim"], types=_ROPE_TYPES)
    scalar = c.number("query_pre_attn_scalar")
    if scalar <= 0:
        c.refuse("query_pre_attn_scalar", scalar, "expected a positive number")
    bias = c.flag("attention_bias")  # q, k, v and o
    return dict(qk_norm=gemma3, attention_bias=bias, o_bias=bias, softmax_scale=scalar ** -0.5, **windows, **rope,
                attn_logit_softcapping=attn_cap, final_logit_softcapping=_cap(c, "final_logit_softcapping"))


def shift_norms(sd: dict[str, torch.Tensor]) -> None:
    """HF stores a Gemma norm's w, which multiplies by 1 + w (in fp32, as transformers adds it);
    the model takes the multiplier, which is what a GGUF stores."""
    for name, t in sd.items():
        if name.endswith("norm.weight"):
            sd[name] = t.float() + 1.0


# -- Gemma 3 as the Hub ships 4B, 12B and 27B: model_type gemma3, Gemma3ForConditionalGeneration
# (transformers 5.24's Gemma3Config), served as text, as llama.cpp and Ollama serve it. Its text
# model is text_config's gemma3_text, read by read_gemma; of the wrapper's own fields only these
# reach text logits: tie_word_embeddings (the wrapper's lm_head ties to the embedding by it, not
# by text_config's) and image_token_index (an id past the vocabulary is embedded as token 0).
GEMMA3_WRAPPER_READ = frozenset({"text_config", "tie_word_embeddings", "image_token_index"})
GEMMA3_WRAPPER_DEFAULTS = dict(tie_word_embeddings=True, image_token_index=262_144)
# Images only: the vision tower's config, the image tokens' count and markers.
GEMMA3_WRAPPER_IGNORED = frozenset({"vision_config", "mm_tokens_per_image", "boi_token_index", "eoi_token_index",
                                    "initializer_range"})


class _TextConfig(HFConfig):
    """text_config's values: a refusal names the field as text_config.<key>."""

    def refuse(self, key: str, value, why: str):
        super().refuse(f"text_config.{key}", value, why)


def gemma3_text_config(c: HFConfig) -> HFConfig:
    """The wrapper's config -> its text model's, as GEMMA3_DEFAULTS' family reads it."""
    text = c.get("text_config")
    if text is None:
        text = {}  # Gemma3Config builds a default Gemma3TextConfig
    if not isinstance(text, dict):
        c.refuse("text_config", text, "expected a JSON object")
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        c.refuse("text_config.model_type", text["model_type"], "Gemma 3's text model is gemma3_text")
    view = _TextConfig({**text, "tie_word_embeddings": c.flag("tie_word_embeddings")}, c.path, GEMMA3_DEFAULTS)
    if view.get("final_logit_softcapping") is not None:
        # Gemma3ForCausalLM caps its logits; Gemma3ForConditionalGeneration never does.
        view.refuse("final_logit_softcapping", view.get("final_logit_softcapping"),
                    "transformers' Gemma3ForConditionalGeneration does not apply it")
    image = c.get("image_token_index")
    if isinstance(image, int) and not isinstance(image, bool) and image >= view.positive_int("vocab_size"):
        c.refuse("image_token_index", image, "past the vocabulary: transformers embeds it as token 0, ridge would not")
    return view


# Its weights: transformers 5 saves model.language_model.* and lm_head.*; earlier versions (most
# files on the Hub) language_model.model.* and language_model.lm_head.*. The vision tower and the
# projector are skipped (ridge serves text); any other name is refused.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def gemma3_text_name(name: str, path) -> str | None:
    """A wrapper checkpoint's tensor -> its text model's name (Gemma3ForCausalLM's), or None for
    the vision tower's and the projector's."""
    for src, dst in _TEXT_PREFIXES:
        if name.startswith(src):
            return dst + name[len(src):]
    if name.startswith(VISION_PREFIXES):
        return None
    raise ModelLoadError(path, f"tensor {name}: neither the language model's nor the vision tower's or projector's "
                               "(Gemma3ForConditionalGeneration's names)")
