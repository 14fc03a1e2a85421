"""Qwen3-VL (transformers 5.25's Qwen3VLConfig) read as its text model and its image encoder.

The text model is Qwen3's decoder (QK-norm per head, attention_bias on q, k, v and o) whose
rotary positions are interleaved mrope (ridge/models/layers/mrope.py: Qwen3VLTextRotaryEmbedding
always interleaves, whatever mrope_interleaved says), and whose first layers add the tower's
deepstack features to the image tokens' hidden states (model.py). vision_config is the ViT with
learned position embeddings and deepstack mergers (vision.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ridge.quant.hf_config import HFConfig, TextConfigView, attention_biases, rope_fields, wrapper_names

from ..layers.siglip import positive
from ..qwen2_5_vl.config import (VISION_PREFIXES, WRAPPER_DEFAULTS, WRAPPER_IGNORED, WRAPPER_READ, TowerConfig,
                                 check_images, mrope_section, read_tower, sub_config, without_mrope)

__all__ = ["WRAPPER_DEFAULTS", "WRAPPER_IGNORED", "WRAPPER_READ", "TEXT_DEFAULTS", "TEXT_IGNORED", "VISION_DEFAULTS",
           "VISION_IGNORED", "VisionConfig", "read_text", "text_config", "text_name", "read_wrapper"]

# Qwen3VLTextConfig's class defaults; rope_theta: its default_theta.
TEXT_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                     max_position_embeddings=128000, rms_norm_eps=1e-6, rope_parameters=None, attention_bias=False,
                     tie_word_embeddings=False, rope_theta=500_000.0)
TEXT_IGNORED = frozenset({"initializer_range", "use_cache", "attention_dropout"})
MROPE_SECTION = [24, 20, 20]  # Qwen3VLTextRotaryEmbedding's default

# Qwen3VLVisionConfig's class defaults.
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
                       in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                       num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24], rope_parameters=None)
VISION_IGNORED = frozenset({"initializer_range"})


@dataclass(frozen=True, slots=True)
class VisionConfig(TowerConfig):
    """The ViT, its merger and its deepstack mergers."""
    num_position_embeddings: int
    deepstack: tuple  # the blocks whose outputs the deepstack mergers take, in the text layers' order

    @property
    def grid_side(self) -> int:
        """Positions a side of the learned table (transformers: int(sqrt(num_position_embeddings)))."""
        return int(self.num_position_embeddings ** 0.5)


def read_text(c: HFConfig, kw: dict) -> dict:
    """The text model's fields -> ModelConfig's: Qwen3's decoder, interleaved mrope."""
    hd = kw["head_dim"]
    section = mrope_section(c, hd, MROPE_SECTION, interleaved=True)
    return dict(qk_norm=True, **attention_biases(c, mlp=False),
                **rope_fields(without_mrope(c, ("mrope_section", "mrope_interleaved")), hd, types=("default",),
                              aliases={"mrope": "default"}),
                extra={"mrope_section": section, "mrope_interleaved": True})


def read_vision(c: HFConfig) -> VisionConfig:
    """The wrapper's vision_config, each field honoured or refused by name."""
    v, kw = read_tower(c, VISION_DEFAULTS)
    deep = v.get("deepstack_visual_indexes")
    if not isinstance(deep, (list, tuple)) or len(set(deep)) != len(deep) or \
            any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < kw["depth"] for i in deep):
        v.refuse("deepstack_visual_indexes", deep, f"expected distinct block indices below depth={kw['depth']}")
    if list(deep) != sorted(deep):  # transformers collects the features in block order, feeds them in list order
        v.refuse("deepstack_visual_indexes", deep, "ridge takes them in increasing order")
    return VisionConfig(num_position_embeddings=positive(v, "num_position_embeddings"), deepstack=tuple(deep), **kw)


def text_config(c: HFConfig) -> TextConfigView:
    """The wrapper's config -> its text model's view (always nested); the image fields checked on the way."""
    text = sub_config(c, "text_config", "text model")
    view = TextConfigView({**text, "tie_word_embeddings": c.flag("tie_word_embeddings")}, c.path, TEXT_DEFAULTS)
    check_images(c, view, read_vision(c))
    return view


text_name = wrapper_names((("model.language_model.", "model."), ("lm_head.", "lm_head.")),
                          VISION_PREFIXES, "vision tower's", "Qwen3VLForConditionalGeneration")


def read_wrapper(values: dict, path) -> tuple[HFConfig, VisionConfig]:
    c = HFConfig(values, path, WRAPPER_DEFAULTS)
    text_config(c)
    return c, read_vision(c)
