"""Image input: safe decoding (decode.py) and each family's preprocessing, read from the checkpoint's
preprocessor_config.json, equal to transformers' image processors (their Pillow + numpy backend).

Torch-free (Pillow and numpy only), a shared low-level package: the gateway
decodes, checks and counts an image's tokens before a request reaches the
engine; the engine's encoder step takes the pixel values. Every family has
`from_config(cfg, ...)`, `preprocess(rgb_image)` (pixel values, the grid or
tiles, and `num_image_tokens`) and `num_image_tokens(height, width)`, the same
count from the header's size alone (`ridge plan`, admission)."""
from __future__ import annotations

from .decode import (ImageHeader, ImageLimits, RemoteImage, decode_image, parse_data_url, parse_image_url,
                     probe_image)
from .gemma3 import Gemma3Images
from .gemma4 import Gemma4Images
from .idefics3 import Idefics3Images
from .pixels import PreprocessorConfigError
from .pixtral import PixtralImages
from .qwen_vl import QwenVLImages

# image_processor_type (transformers' class name, its Fast and Pil variants alike) -> the family's reader
PROCESSORS = {
    "Gemma3ImageProcessor": Gemma3Images,
    "Gemma4ImageProcessor": Gemma4Images,
    "Qwen2VLImageProcessor": QwenVLImages,  # Qwen2-VL, Qwen2.5-VL, Qwen3-VL
    "PixtralImageProcessor": PixtralImages,  # Pixtral, Mistral 3
    "Idefics3ImageProcessor": Idefics3Images,
    "SmolVLMImageProcessor": Idefics3Images,
}


def processor_class(cfg: dict):
    """The family reader a preprocessor_config.json names; its processor-level arguments
    (Pixtral's spatial_merge_size, SmolVLM's image_seq_len) are the caller's to pass."""
    name = cfg.get("image_processor_type") or ""
    base = name.removesuffix("Fast").removesuffix("Pil")
    if base not in PROCESSORS:
        raise PreprocessorConfigError("image_processor_type", name,
                                      f"ridge preprocesses images for {sorted(PROCESSORS)}")
    return PROCESSORS[base]


__all__ = ["ImageHeader", "ImageLimits", "RemoteImage", "decode_image", "parse_data_url", "parse_image_url",
           "probe_image", "PreprocessorConfigError", "PROCESSORS", "processor_class", "Gemma3Images",
           "Gemma4Images", "QwenVLImages", "PixtralImages", "Idefics3Images"]
