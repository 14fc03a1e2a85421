"""Qwen3.5's image encoder (transformers 5.25's Qwen3_5VisionModel): Qwen3-VL's tower without
deepstack mergers (ridge/models/qwen3_vl/vision.py runs it), read from the wrapper's
vision_config (Qwen3_5VisionConfig). Its rows replace the <|image_pad|> tokens' embeddings; the
text model's image tokens rotate by three positions, interleaved (ridge/models/layers/mrope.py)."""
from __future__ import annotations

import torch

from ridge.quant.hf_config import HFConfig

from ..layers.siglip import positive
from ..qwen2_5_vl.config import read_tower
from ..qwen2_5_vl.vision import load_tower
from ..qwen3_vl.config import VisionConfig
from ..qwen3_vl.vision import VisionModel

# Qwen3_5VisionConfig's class defaults.
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
                       in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                       num_position_embeddings=2304, rope_parameters=None)
VISION_IGNORED = frozenset({"initializer_range"})


def read_vision(c: HFConfig) -> VisionConfig:
    """The wrapper's vision_config, each field honoured or refused by name."""
    v, kw = read_tower(c, VISION_DEFAULTS)
    return VisionConfig(num_position_embeddings=positive(v, "num_position_embeddings"), deepstack=(), **kw)


def read_wrapper(values: dict, path) -> tuple[HFConfig, VisionConfig]:
    c = HFConfig(values, path, {})
    return c, read_vision(c)


def load_vision(path, device, dtype: torch.dtype, weights: str = "fp32"):
    return load_tower(path, device, dtype, weights, read_wrapper, VisionModel)
