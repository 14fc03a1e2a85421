"""Idefics3 and SmolVLM (Idefics3Config, SmolVLMConfig in transformers 5.25: one layout) read as
their text model, a llama (text_config), and their vision tower's and connector's fields
(vision_config, scale_factor), which ridge/models/idefics3/vision.py runs.

Of the wrapper's own fields these reach the logits: tie_word_embeddings (the wrapper's lm_head
ties to the text model's embedding by it, not by text_config's), image_token_id (its rows are
replaced by the image's), scale_factor and vision_config (the image rows' values)."""
from __future__ import annotations

from dataclasses import dataclass

from ridge.quant.hf_config import HFConfig, nested_text_config, wrapper_names

from ..layers.siglip import positive, read_tower
from ..llama import SPEC as LLAMA

# The wrappers' model_types (each its transformers class; one layout, one reading).
MODEL_TYPES = ("idefics3", "smolvlm")

# The wrappers' class defaults (equal in Idefics3Config and SmolVLMConfig).
WRAPPER_READ = frozenset({"text_config", "tie_word_embeddings", "image_token_id", "vision_config", "scale_factor"})
WRAPPER_DEFAULTS = dict(tie_word_embeddings=False, image_token_id=128_257, scale_factor=2)
WRAPPER_IGNORED = frozenset()
# Idefics3VisionConfig's and SmolVLMVisionConfig's defaults (the same numbers).
VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                       num_channels=3, image_size=224, patch_size=32, hidden_act="gelu_pytorch_tanh",
                       layer_norm_eps=1e-6)
# Training-time fields of the vision config; the tower's math never reads them.
VISION_IGNORED = frozenset({"attention_dropout", "initializer_range"})
# Where text_config is absent both wrappers build LlamaConfig(rms_norm_eps=1e-5).
ABSENT_TEXT = {"rms_norm_eps": 1e-5}


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The vision tower (a SigLIP encoder over patches) and the connector (pixel shuffle by
    scale_factor, then a bias-free projection to the text model's width)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # the positions' grid is image_size // patch_size a side
    patch_size: int
    hidden_act: str  # ridge's name (quant/hf_config.py ACTIVATIONS)
    layer_norm_eps: float
    scale_factor: int
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def read_vision(c: HFConfig, text_hidden_size: int) -> VisionConfig:
    """The wrapper's vision_config and scale_factor, each honoured or refused by name."""
    v, tower = read_tower(c, VISION_DEFAULTS)
    # scale_factor must divide a tile's patches a side: checked per tile (vision.py), whose size
    # the preprocessor's max_image_size sets
    scale = positive(c, "scale_factor")
    if tower["patch_size"] > tower["image_size"]:
        v.refuse("patch_size", tower["patch_size"], f"larger than image_size={tower['image_size']}: no position table")
    return VisionConfig(**tower, scale_factor=scale, text_hidden_size=text_hidden_size)


def text_config(c: HFConfig) -> HFConfig:
    """The wrapper's config -> its llama's, the vision fields checked on the way (the checkpoint
    is one model: a tower ridge cannot run is refused however the model is served)."""
    if c.get("text_config") is None:
        c = HFConfig({**c.values, "text_config": dict(ABSENT_TEXT)}, c.path, c.defaults)
    view = nested_text_config(c, LLAMA.arch, LLAMA.hf.defaults, "Idefics3 and SmolVLM")
    vocab = view.positive_int("vocab_size")
    image = c.get("image_token_id")
    if isinstance(image, bool) or not isinstance(image, int) or not 0 <= image < vocab:
        # transformers embeds every prompt token, the image's too, before placing the image rows
        c.refuse("image_token_id", image, f"expected a token of the {vocab}-token vocabulary")
    read_vision(c, view.positive_int("hidden_size"))
    return view


# The vision tower's and the connector's tensors: the text conversion skips them, vision.py reads them.
VISION_PREFIXES = ("model.vision_model.", "model.connector.")
text_name = wrapper_names((("model.text_model.", "model."), ("lm_head.", "lm_head.")), VISION_PREFIXES,
                          "vision tower's or connector", "Idefics3ForConditionalGeneration")


def read_wrapper(values: dict, path) -> tuple[HFConfig, VisionConfig]:
    """config.json's values -> (the wrapper's view, the vision config), as text_config checks them."""
    c = HFConfig(values, path, WRAPPER_DEFAULTS)
    text = text_config(c)
    return c, read_vision(c, text.positive_int("hidden_size"))
