"""Gemma 3 (text): Gemma 2's reading (ridge/models/gemma2/config.py) with Gemma 3's fields
(Gemma3TextConfig in transformers 5.24, with its defaults), and the multimodal Gemma 3
(Gemma3Config) read as its text model.

Gemma3TextConfig also takes the pre-transformers-5 keys, which it folds into rope_parameters
and layer_types: rope_theta, rope_scaling (the full layers'), rope_local_base_freq and
sliding_window_pattern. GGUF gemma3: the sliding layers' RoPE base is 10000 unscaled
(rope.freq_base_swa where a file has it); the full layers' rope.freq_base and rope.scaling."""
from __future__ import annotations

from ridge.quant.errors import ModelLoadError
from ridge.quant.hf_config import HFConfig, nested_text_config, rope_fields, wrapper_names

from ..gemma2.config import GEMMA_COMMON, ROPE_TYPES, positive, read_gemma, read_gemma_gguf

GEMMA3_DEFAULTS = dict(GEMMA_COMMON, vocab_size=262208, max_position_embeddings=131_072, final_logit_softcapping=None,
                       attn_logit_softcapping=None, use_bidirectional_attention=False, rope_theta=1_000_000.0,
                       rope_scaling=None, rope_local_base_freq=10000.0, sliding_window_pattern=6)


def _rope_view(c: HFConfig, params: dict, theta: float, where: str) -> dict:
    """One layer type's RoPE through the common reading (every key checked against its rope_type)."""
    view = HFConfig({"rope_parameters": {"rope_theta": theta, **params}}, f"{c.path} ({where})",
                    {"max_position_embeddings": c.get("max_position_embeddings")})
    return rope_fields(view, c.get("head_dim") or 256, types=ROPE_TYPES)


def _ropes(c: HFConfig, kw: dict) -> dict:
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


def read_gemma3(c: HFConfig, kw: dict) -> dict:
    # 5 sliding : 1 full (sliding_window_pattern); QK-norm over head_dim
    # an image's tokens attend each other both ways (Gemma3Model's block mask; text-only prompts never
    # carry image runs)
    return dict(read_gemma(c, kw, period=lambda c: c.positive_int("sliding_window_pattern"), rope=_ropes,
                           attn_cap=False), qk_norm=True, image_attention_bidirectional=True)


def read_gemma3_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    out = read_gemma_gguf("gemma3", a, kw, names, path, period=6, layers_27b=62, window=None, attn_cap=None,
                          final_cap=None)
    theta = positive(path, "gemma3.rope.freq_base_swa", a("rope.freq_base_swa", 10000.0))
    # images come with a projector file (--mmproj): their tokens see each other both ways, as in the
    # HF checkpoint (and llama.cpp's mtmd decodes them non-causally)
    return dict(out, rope_local_theta=float(theta), image_attention_bidirectional=True)


# -- Gemma 3 as the Hub ships 4B, 12B and 27B: model_type gemma3, Gemma3ForConditionalGeneration
# (transformers 5.24's Gemma3Config), served as text, as llama.cpp and Ollama serve it. Its text
# model is text_config's gemma3_text, read by read_gemma3; of the wrapper's own fields only these
# reach text logits: tie_word_embeddings (the wrapper's lm_head ties to the embedding by it, not
# by text_config's) and image_token_index (an id past the vocabulary is embedded as token 0).
# The images' rows: vision_config (the SigLIP tower) and mm_tokens_per_image (the projector's pool),
# read by vision.py's load_vision.
WRAPPER_READ = frozenset({"text_config", "tie_word_embeddings", "image_token_index", "vision_config",
                          "mm_tokens_per_image"})
WRAPPER_DEFAULTS = dict(tie_word_embeddings=True, image_token_index=262_144, mm_tokens_per_image=256)
# The image's markers are prompt tokens like any other; the processor places them.
WRAPPER_IGNORED = frozenset({"boi_token_index", "eoi_token_index", "initializer_range"})


def text_config(c: HFConfig) -> HFConfig:
    """The wrapper's config -> its text model's, as GEMMA3_DEFAULTS' family reads it."""
    # Gemma3Config builds a default Gemma3TextConfig where the file has none.
    view = nested_text_config(c, "gemma3_text", GEMMA3_DEFAULTS, "Gemma 3")
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
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
# A wrapper checkpoint's tensor -> its text model's name (Gemma3ForCausalLM's), or None for the
# vision tower's and the projector's.
text_name = wrapper_names((("model.language_model.", "model."), ("language_model.model.", "model."),
                           ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")),
                          VISION_PREFIXES, "vision tower's or projector", "Gemma3ForConditionalGeneration")
