"""What every family's preprocessing shares: the config reader, Pillow's resize, rescale and normalize.

numpy on the CPU, not torch: transformers' reference (the PIL backend, its "slow"
processors) is Pillow plus numpy, so doing the same operations in the same
order gives the same float32 values bit for bit, and the gateway can run it
without torch. Images travel as HWC uint8 until rescale: every resize and crop
happens on uint8 pixels, as in transformers."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from ridge.errors import InvalidRequest

# Keys a preprocessor_config.json carries for the loader's bookkeeping, not for the pixels.
BOOKKEEPING = frozenset({"image_processor_type", "processor_class", "feature_extractor_type", "auto_map",
                         "_processor_class", "backend"})
IMAGENET_STANDARD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
OPENAI_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
SIZE_KEYS = frozenset({"height", "width", "shortest_edge", "longest_edge", "max_height", "max_width"})


class PreprocessorConfigError(ValueError):
    """A preprocessor_config.json field ridge cannot honour exactly. The loader (a layer above, which
    knows the path) reports it as a ModelLoadError; this package stays below quant/ so the
    torch-free gateway may import it."""

    def __init__(self, key: str, value, why: str):
        super().__init__(f"preprocessor_config.json: {key}={value!r}: {why}")
        self.key, self.value, self.why = key, value, why


class Fields:
    """A preprocessor config read against a family's defaults: null means the default, as transformers
    reads it, and a key the family does not know is refused rather than silently ignored."""

    def __init__(self, cfg: dict, defaults: dict, family: str):
        unknown = sorted(set(cfg) - set(defaults) - BOOKKEEPING)
        if unknown:
            raise PreprocessorConfigError(unknown[0], cfg[unknown[0]], f"not a field ridge reads for {family}")
        self.cfg, self.defaults = cfg, defaults

    def get(self, key: str):
        v = self.cfg.get(key)
        return self.defaults[key] if v is None else v

    def flag(self, key: str) -> bool:
        v = self.get(key)
        if not isinstance(v, bool):
            raise PreprocessorConfigError(key, v, "expected true or false")
        return v

    def integer(self, key: str, minimum: int = 1) -> int:
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise PreprocessorConfigError(key, v, f"expected an integer >= {minimum}")
        return v

    def size(self, key: str, default_to_square: bool) -> dict:
        """transformers' get_size_dict: an int is a square (or a shortest edge), a pair is (height, width)."""
        v = self.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return {"height": v, "width": v} if default_to_square else {"shortest_edge": v}
        if isinstance(v, (list, tuple)) and len(v) == 2:
            return {"height": v[0], "width": v[1]}
        if isinstance(v, dict) and v and set(v) <= SIZE_KEYS and all(isinstance(x, int) and x > 0 for x in v.values()):
            return dict(v)
        raise PreprocessorConfigError(key, v, f"expected an int or a dict of {sorted(SIZE_KEYS)}")

    def refuse(self, key: str, why: str):
        raise PreprocessorConfigError(key, self.get(key), why)


RESAMPLE_DEFAULTS = dict(do_convert_rgb=True, do_resize=True, do_rescale=True, rescale_factor=1 / 255,
                         do_normalize=True)


@dataclass(frozen=True, slots=True)
class Pixels:
    """The steps every family shares: resample filter, rescale and normalize."""
    resample: Image.Resampling
    do_resize: bool
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: np.ndarray  # [3] float32
    std: np.ndarray  # [3] float32

    @classmethod
    def read(cls, f: Fields) -> Pixels:
        r = f.get("resample")
        if isinstance(r, bool) or r not in tuple(Image.Resampling):
            f.refuse("resample", "expected a PIL resampling filter (0-5)")
        mean, std = f.get("image_mean"), f.get("image_std")
        if isinstance(mean, (int, float)):
            mean = [mean] * 3
        if isinstance(std, (int, float)):
            std = [std] * 3
        for key, v in (("image_mean", mean), ("image_std", std)):
            if len(v) != 3:
                f.refuse(key, "expected 3 values (RGB)")
        if not isinstance(f.get("rescale_factor"), (int, float)):
            f.refuse("rescale_factor", "expected a number")
        # do_convert_rgb false changes nothing here: ridge's decoder hands every family RGB already.
        f.flag("do_convert_rgb")
        return cls(Image.Resampling(r), f.flag("do_resize"), f.flag("do_rescale"), float(f.get("rescale_factor")),
                   f.flag("do_normalize"), np.array(mean, dtype=np.float32), np.array(std, dtype=np.float32))

    def resize(self, img: np.ndarray, height: int, width: int) -> np.ndarray:
        """HWC uint8 -> HWC uint8 at (height, width), by Pillow as transformers resizes."""
        if min(height, width) < 1:
            raise InvalidRequest(f"image of {img.shape[0]}x{img.shape[1]} would resize to {height}x{width}")
        return np.asarray(Image.fromarray(img).resize((width, height), resample=self.resample))

    def to_float(self, img: np.ndarray) -> np.ndarray:
        """HWC uint8 -> CHW float32, rescaled and normalized in transformers' order and precision
        (rescale in float64 then float32; normalize in float32)."""
        x = img.transpose(2, 0, 1)
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = x.astype(np.float32, copy=False)
        if self.do_normalize:
            x = (x - self.mean[:, None, None]) / self.std[:, None, None]
        return np.ascontiguousarray(x)


def merged_patches(height: int, width: int, patch_size: int, merge: int) -> int:
    """Tokens for an image of whole patches when merge x merge neighbours become one token."""
    return (height // patch_size) * (width // patch_size) // merge**2


def as_array(image: Image.Image) -> np.ndarray:
    """An RGB picture (from decode_image) -> HWC uint8."""
    if image.mode != "RGB":
        raise ValueError(f"preprocessing takes RGB images (decode_image's), got mode {image.mode}")
    return np.asarray(image)
