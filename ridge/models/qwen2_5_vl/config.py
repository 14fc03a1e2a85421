"""Qwen2.5-VL (transformers 5.25's Qwen2_5_VLConfig) read as its text model and its image encoder.

The text model is Qwen2's decoder (q, k and v biases, Qwen2's windows) whose rotary positions are
mrope (ridge/models/layers/mrope.py): rope_parameters' mrope_section splits each head's
frequencies between the three positions. The Hub's files are flat (the text fields at the top,
which transformers moves into text_config); transformers 5 writes text_config: both are read.
vision_config is the ViT with window attention (vision.py); image_token_id is the placeholder
its rows replace."""
from __future__ import annotations

from dataclasses import dataclass

from ridge.quant.hf_config import ACTIVATIONS, HFConfig, TextConfigView, rope_fields, wrapper_names

from ..layers.siglip import VisionView, positive
from ..qwen2 import qwen_windows

WRAPPER_DEFAULTS = dict(text_config=None, vision_config=None, image_token_id=151655, video_token_id=151656,
                        vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=False)
WRAPPER_READ = frozenset({"text_config", "vision_config", "image_token_id", "tie_word_embeddings"})
# Video and the markers around an image are the prompt's (ridge/vision/prompt.py), not the model's math.
WRAPPER_IGNORED = frozenset({"video_token_id", "vision_start_token_id", "vision_end_token_id"})

# Qwen2_5_VLTextConfig's class defaults; rope_theta: its default_theta.
TEXT_DEFAULTS = dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                     num_attention_heads=64, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=32768,
                     rms_norm_eps=1e-5, tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
                     max_window_layers=80, layer_types=None, rope_parameters=None, rope_theta=1_000_000.0,
                     head_dim=None)
TEXT_IGNORED = frozenset({"initializer_range", "use_cache", "attention_dropout"})
MROPE_SECTION = [16, 24, 24]  # Qwen2_5_VLRotaryEmbedding's default

# Qwen2_5_VLVisionConfig's class defaults.
VISION_DEFAULTS = dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                       in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31], rope_parameters=None)
# tokens_per_second times video frames only; in_chans and spatial_patch_size are older names the
# class never reads (in_channels and patch_size are).
VISION_IGNORED = frozenset({"tokens_per_second", "initializer_range", "in_chans", "spatial_patch_size"})
AXIAL_THETA = 10_000.0  # PreTrainedConfig.default_theta: the tower's rope_parameters without rope_theta


@dataclass(frozen=True, slots=True)
class TowerConfig:
    """What the Qwen-VL towers share (read_tower)."""
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    hidden_act: str
    rope_theta: float
    out_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, slots=True)
class VisionConfig(TowerConfig):
    """The ViT and its patch merger."""
    window_size: int  # pixels a side of an attention window
    full_blocks: frozenset  # blocks that attend across the whole image

    @property
    def window_tokens(self) -> int:
        """Merged tokens a side of a window."""
        return self.window_size // self.spatial_merge_size // self.patch_size


def _text_values(c: HFConfig) -> dict:
    if c.get("text_config") is None:  # a flat file: transformers takes the text model's fields from the top
        keys = set(TEXT_DEFAULTS) | TEXT_IGNORED | {"rope_scaling"}
        text = {k: v for k, v in c.values.items() if k in keys}
    else:
        text = sub_config(c, "text_config", "text model")
    return {**text, "tie_word_embeddings": c.flag("tie_word_embeddings") or bool(text.get("tie_word_embeddings"))}


def mrope_section(c: HFConfig, head_dim: int, default: list[int], interleaved: bool = False) -> list[int]:
    """rope_parameters' (or rope_scaling's) mrope_section: three counts of frequencies, one per axis.
    Split (Qwen2-VL), the three runs cover the head's frequencies exactly (transformers splits by
    them); interleaved (Qwen3-VL), they bound the frequencies h and w take, the rest are t's."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    section = params.get("mrope_section", default) if isinstance(params, dict) else default
    if not isinstance(section, list) or len(section) != 3 or \
            any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in section):
        c.refuse("rope_parameters.mrope_section", section, "expected three counts of frequencies")
    if not interleaved and sum(section) != head_dim // 2:
        c.refuse("rope_parameters.mrope_section", section,
                 f"expected three counts of frequencies summing to head_dim / 2 = {head_dim // 2}")
    return section


def without_mrope(c: HFConfig, keys=("mrope_section",)) -> HFConfig:
    """c without the mrope keys in its rope parameters: the plain rotation they build on."""
    out = dict(c.values)
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(out.get(key), dict):
            out[key] = {k: v for k, v in out[key].items() if k not in keys}
    return TextConfigView(out, c.path, c.defaults)


def read_text(c: HFConfig, kw: dict) -> dict:
    """The text model's fields -> ModelConfig's: Qwen2's decoder, the rotation's mrope split."""
    hd = kw["head_dim"]
    if hd * kw["num_heads"] != kw["hidden_size"]:  # Qwen2_5_VLAttention: hidden_size // num_attention_heads
        c.refuse("head_dim", c.get("head_dim"), f"Qwen2.5-VL's heads are hidden_size / num_attention_heads")
    section = mrope_section(c, hd, MROPE_SECTION)
    return dict(attention_bias=True, **rope_fields(without_mrope(c), hd, types=("default",),
                                                   aliases={"mrope": "default"}),
                **qwen_windows(c, kw["num_layers"]), extra={"mrope_section": section, "mrope_interleaved": False})


def sub_config(c: HFConfig, key: str, what: str) -> dict:
    """A sub-config's values ({} where the file has none: the class's defaults)."""
    values = c.get(key)
    if values is None:
        values = {}
    if not isinstance(values, dict):
        c.refuse(key, values, f"expected the {what}'s config (a JSON object)")
    return values


def read_tower(c: HFConfig, defaults: dict) -> tuple[VisionView, dict]:
    """vision_config's fields the Qwen-VL towers share -> (its view, VisionConfig keyword arguments)."""
    v = VisionView(sub_config(c, "vision_config", "vision tower"), c.path, defaults)
    hidden, heads = positive(v, "hidden_size"), positive(v, "num_heads")
    if hidden % heads or (hidden // heads) % 4:
        # heads split hidden_size evenly; a quarter of a head turns by row, a quarter by column
        v.refuse("num_heads", heads, f"hidden_size={hidden} must split into heads of a multiple of 4")
    act = v.get("hidden_act")
    if act not in ACTIVATIONS:
        v.refuse("hidden_act", act, f"ridge runs {', '.join(ACTIVATIONS)}")
    rope = v.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") not in ("axial", "default") or \
            set(rope) - {"rope_type", "rope_theta"}:
        v.refuse("rope_parameters", rope, "the tower runs axial rotary positions (rope_type, rope_theta)")
    theta = rope.get("rope_theta", AXIAL_THETA)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        v.refuse("rope_parameters.rope_theta", theta, "expected a positive number")
    return v, dict(depth=positive(v, "depth"), hidden_size=hidden, intermediate_size=positive(v, "intermediate_size"),
                   num_heads=heads, in_channels=positive(v, "in_channels"), patch_size=positive(v, "patch_size"),
                   temporal_patch_size=positive(v, "temporal_patch_size"),
                   spatial_merge_size=positive(v, "spatial_merge_size"), hidden_act=ACTIVATIONS[act],
                   rope_theta=float(theta), out_hidden_size=positive(v, "out_hidden_size"))


def read_vision(c: HFConfig) -> VisionConfig:
    """The wrapper's vision_config, each field honoured or refused by name."""
    v, kw = read_tower(c, VISION_DEFAULTS)
    full = v.get("fullatt_block_indexes")
    if not isinstance(full, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in full):
        v.refuse("fullatt_block_indexes", full, "expected a list of block indices")
    merge, patch, window = kw["spatial_merge_size"], kw["patch_size"], positive(v, "window_size")
    if window // merge // patch < 1:
        v.refuse("window_size", window, f"a window must hold a merged token ({merge * patch} pixels)")
    return VisionConfig(window_size=window, full_blocks=frozenset(full), **kw)


def check_images(c: HFConfig, text: HFConfig, vision) -> None:
    """The wrapper's image fields against its text model: the placeholder a token of its vocabulary,
    the merger's rows as wide as its embeddings (the checkpoint is one model: a tower ridge cannot
    run is refused however it is served)."""
    vocab = text.positive_int("vocab_size")
    image = c.get("image_token_id")
    if isinstance(image, bool) or not isinstance(image, int) or not 0 <= image < vocab:
        # transformers embeds every prompt token, the image's too, before placing the image rows
        c.refuse("image_token_id", image, f"expected a token of the {vocab}-token vocabulary")
    if vision.out_hidden_size != text.positive_int("hidden_size"):
        c.refuse("vision_config.out_hidden_size", vision.out_hidden_size,
                 f"the merger's rows replace embeddings of hidden_size={text.get('hidden_size')}")


def text_config(c: HFConfig) -> TextConfigView:
    """The wrapper's config -> its text model's view; the image fields checked on the way."""
    view = TextConfigView(_text_values(c), c.path, TEXT_DEFAULTS)
    check_images(c, view, read_vision(c))
    return view


# transformers 5 writes the text model as model.* and the tower as visual.*; its in-memory names
# (model.language_model.*, model.visual.*) are read too.
VISION_PREFIXES = ("visual.", "model.visual.")
text_name = wrapper_names((("model.language_model.", "model."), ("model.layers.", "model.layers."),
                           ("model.embed_tokens.", "model.embed_tokens."), ("model.norm.", "model.norm."),
                           ("lm_head.", "lm_head.")),
                          VISION_PREFIXES, "vision tower's", "Qwen2_5_VLForConditionalGeneration")


def read_wrapper(values: dict, path) -> tuple[HFConfig, VisionConfig]:
    c = HFConfig(values, path, WRAPPER_DEFAULTS)
    text_config(c)
    return c, read_vision(c)
