"""Mistral 3 (transformers 5.25's Mistral3Config) read as its text model and its image encoder.

text_config is a mistral (Mistral Small 3.1 / 3.2, the config class's default) or a ministral3
(the Ministral 3 checkpoints): each read by its own family (ridge/models/mistral/,
ridge/models/ministral3/), whose arch the ModelConfig carries, so the text model runs exactly as
that family's checkpoints do. vision_config is a pixtral tower; the wrapper's own fields set the
projector (projector_hidden_act, multimodal_projector_bias, spatial_merge_size,
vision_feature_layer) and which token's rows the image replaces (image_token_index).

transformers builds a missing sub-config from the wrapper's init_kwargs (ABSENT_TEXT,
ABSENT_VISION) and a given one from its class's defaults; ridge reads both the same way."""
from __future__ import annotations

from dataclasses import dataclass

from ridge.quant.hf_config import ACTIVATIONS, HFConfig, nested_text_config, wrapper_names

from ..layers.siglip import VisionView, positive
from ..ministral3 import SPEC as MINISTRAL3
from ..mistral import SPEC as MISTRAL

# text_config's model_type -> the family that reads and runs it (each named by its own folder).
TEXT_FAMILIES = {spec.arch: spec for spec in (MISTRAL, MINISTRAL3)}

WRAPPER_READ = frozenset({"text_config", "vision_config", "tie_word_embeddings", "image_token_index",
                          "projector_hidden_act", "vision_feature_layer", "multimodal_projector_bias",
                          "spatial_merge_size"})
WRAPPER_DEFAULTS = dict(tie_word_embeddings=True, image_token_index=10, projector_hidden_act="gelu",
                        vision_feature_layer=-1, multimodal_projector_bias=False, spatial_merge_size=2)
WRAPPER_IGNORED = frozenset()

# Mistral3Config.sub_configs_defaults: what transformers builds where the file has no sub-config.
ABSENT_TEXT = dict(model_type=MISTRAL.arch, head_dim=128, hidden_act="silu", hidden_size=5120, intermediate_size=32768,
                   max_position_embeddings=131072, num_attention_heads=32, num_hidden_layers=40,
                   num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1_000_000_000.0, sliding_window=None,
                   vocab_size=131072)
ABSENT_VISION = dict(model_type="pixtral", intermediate_size=4096, hidden_size=1024, patch_size=14, image_size=1540,
                     num_hidden_layers=24, num_attention_heads=16, head_dim=64, hidden_act="gelu")
# PixtralVisionConfig's class defaults (a vision_config given without a field).
VISION_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       num_channels=3, patch_size=16, hidden_act="gelu", rope_parameters=None)
# Not read by the tower's math: image_size (positions are rotary, per patch, with no table to
# size), head_dim (PixtralVisionConfig recomputes it as hidden_size // num_attention_heads), and
# training-time fields.
VISION_IGNORED = frozenset({"image_size", "head_dim", "attention_dropout", "initializer_range", "vocab_size"})
AXIAL_THETA = 10_000.0  # PreTrainedConfig.default_theta: rope_parameters without rope_theta


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The Pixtral tower and the Mistral 3 projector."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    patch_size: int
    hidden_act: str  # ridge's name (quant/hf_config.py ACTIVATIONS)
    rope_theta: float
    feature_layer: int  # the hidden state the projector takes: 0 is ln_pre's output, i layer i's
    spatial_merge_size: int
    projector_act: str
    projector_bias: bool
    projector_eps: float  # the projector's RMSNorm: the text model's rms_norm_eps
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def cell(self) -> int:
        """Pixels a side of one image token: a merged block of patches."""
        return self.patch_size * self.spatial_merge_size


def _act(c: HFConfig, key: str) -> str:
    act = c.get(key)
    if act not in ACTIVATIONS:
        c.refuse(key, act, f"ridge runs {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def _feature_layer(c: HFConfig, num_layers: int) -> int:
    """vision_feature_layer as an index of the tower's hidden states (num_layers + 1 of them)."""
    v = c.get("vision_feature_layer")
    n = num_layers + 1
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
    elif isinstance(v, list):
        # transformers concatenates the layers, then norms and merges hidden_size-wide features
        c.refuse("vision_feature_layer", v, "the projector's norm and patch merger take one layer's features")
    if isinstance(v, bool) or not isinstance(v, int) or not -n <= v < n:
        c.refuse("vision_feature_layer", v, f"expected an index of the tower's {n} hidden states")
    return v % n


def read_vision(c: HFConfig, text: HFConfig) -> VisionConfig:
    """The wrapper's vision_config and projector fields, each honoured or refused by name."""
    values = c.get("vision_config")
    if values is None:
        values = dict(ABSENT_VISION)
    if not isinstance(values, dict):
        c.refuse("vision_config", values, "expected the vision tower's config (a JSON object)")
    v = VisionView(values, c.path, VISION_DEFAULTS)
    if v.get("model_type") not in (None, "pixtral"):
        v.refuse("model_type", v.get("model_type"), "Mistral 3's vision tower is pixtral")
    hidden, heads = positive(v, "hidden_size"), positive(v, "num_attention_heads")
    if hidden % heads or (hidden // heads) % 2:
        # heads split hidden_size evenly, and the rotary turns pairs of a head's dimensions
        v.refuse("num_attention_heads", heads, f"hidden_size={hidden} must split into heads of an even size")
    rope = v.get("rope_parameters") or {"rope_type": "axial"}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial" or set(rope) - {"rope_type",
                                                                                                "rope_theta"}:
        v.refuse("rope_parameters", rope, "Pixtral's tower runs axial rotary positions (rope_type, rope_theta)")
    theta = rope.get("rope_theta", AXIAL_THETA)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        v.refuse("rope_parameters.rope_theta", theta, "expected a positive number")
    layers = positive(v, "num_hidden_layers")
    bias = c.flag("multimodal_projector_bias")
    return VisionConfig(hidden, positive(v, "intermediate_size"), layers, heads, positive(v, "num_channels"),
                        positive(v, "patch_size"), _act(v, "hidden_act"), float(theta), _feature_layer(c, layers),
                        positive(c, "spatial_merge_size"), _act(c, "projector_hidden_act"), bias,
                        text.number("rms_norm_eps"), text.positive_int("hidden_size"))


def text_config(c: HFConfig) -> HFConfig:
    """The wrapper's config -> its text model's, of the family its model_type names; the image
    fields checked on the way (the checkpoint is one model: a tower ridge cannot run is refused
    however it is served)."""
    text = c.get("text_config")
    if text is None:
        text = dict(ABSENT_TEXT)
    if not isinstance(text, dict):
        c.refuse("text_config", text, "expected the text model's config (a JSON object)")
    text = {"model_type": MISTRAL.arch, **text}  # the class's sub-config type where the file names none
    c = HFConfig({**c.values, "text_config": text}, c.path, c.defaults)
    kind = text["model_type"]
    if kind not in TEXT_FAMILIES:
        c.refuse("text_config.model_type", kind, f"Mistral 3's text model is one of {', '.join(TEXT_FAMILIES)}")
    family = TEXT_FAMILIES[kind]
    view = nested_text_config(c, kind, family.hf.defaults, "Mistral 3")
    vocab = view.positive_int("vocab_size")
    image = c.get("image_token_index")
    if isinstance(image, bool) or not isinstance(image, int) or not 0 <= image < vocab:
        # transformers embeds every prompt token, the image's too, before placing the image rows
        c.refuse("image_token_index", image, f"expected a token of the {vocab}-token vocabulary")
    read_vision(c, view)
    return view


def read_text(c: HFConfig, kw: dict) -> dict:
    """The text model's own fields by its family's reader; arch: that family's, which runs it."""
    family = TEXT_FAMILIES.get(c.get("model_type"))
    if family is None:
        c.refuse("model_type", c.get("model_type"), "read only as a Mistral 3 checkpoint's text_config")
    return {**family.hf.read(c, kw), "arch": family.arch}


# The vision tower's and the projector's tensors: the text conversion skips them, vision.py reads
# them. transformers 5 saves them under model.; earlier checkpoints without it.
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
text_name = wrapper_names((("model.language_model.", "model."), ("language_model.model.", "model."),
                           ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")),
                          VISION_PREFIXES, "vision tower's or projector", "Mistral3ForConditionalGeneration")


def read_wrapper(values: dict, path) -> tuple[HFConfig, VisionConfig]:
    """config.json's values -> (the wrapper's view, the vision config), as text_config checks them."""
    c = HFConfig(values, path, WRAPPER_DEFAULTS)
    return c, read_vision(c, text_config(c))
