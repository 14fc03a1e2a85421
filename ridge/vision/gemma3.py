"""Gemma 3's images (Gemma3ImageProcessor): SigLIP's fixed square, and pan-and-scan crops.

Pan-and-scan (off unless the request or the config turns it on) cuts an image
whose aspect ratio passes a threshold into 2..max crops along its long side; the
model sees the whole image first, then each crop, every one resized to the same
square and each worth `image_seq_length` image tokens (256 for the released
checkpoints)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .pixels import IMAGENET_STANDARD, RESAMPLE_DEFAULTS, Fields, Pixels, PreprocessorConfigError, as_array

DEFAULTS = dict(RESAMPLE_DEFAULTS, resample=Image.Resampling.BILINEAR, size={"height": 224, "width": 224},
                image_mean=IMAGENET_STANDARD[0], image_std=IMAGENET_STANDARD[1],
                # Gemma3Processor's values where preprocessor_config.json leaves them null
                do_pan_and_scan=False, pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4,
                pan_and_scan_min_ratio_to_activate=1.2,
                image_seq_length=256)


@dataclass(frozen=True, slots=True)
class Gemma3Image:
    pixel_values: np.ndarray  # [1 + num_crops, 3, H, W] float32: the whole image, then its crops
    num_crops: int
    num_image_tokens: int  # image_seq_length per picture, crops included


@dataclass(frozen=True, slots=True)
class Gemma3Images:
    pixels: Pixels
    height: int
    width: int
    pan_and_scan: bool
    min_crop_size: int
    max_num_crops: int
    min_ratio: float
    image_seq_length: int

    @classmethod
    def from_config(cls, cfg: dict, *, pan_and_scan: bool | None = None) -> Gemma3Images:
        """`pan_and_scan`: the request's choice, over the config's."""
        f = Fields(cfg, DEFAULTS, "Gemma 3")
        size = f.size("size", default_to_square=True)
        if set(size) != {"height", "width"}:
            f.refuse("size", "Gemma 3 resizes to a fixed height and width")
        ratio = f.get("pan_and_scan_min_ratio_to_activate")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0:
            f.refuse("pan_and_scan_min_ratio_to_activate", "expected a positive number")
        return cls(Pixels.read(f), size["height"], size["width"],
                   f.flag("do_pan_and_scan") if pan_and_scan is None else pan_and_scan,
                   f.integer("pan_and_scan_min_crop_size"), f.integer("pan_and_scan_max_num_crops", 2),
                   float(ratio), f.integer("image_seq_length"))

    def crop_boxes(self, height: int, width: int) -> list[tuple[int, int, int, int]]:
        """Pan-and-scan's crops as (top, left, crop height, crop width); [] when it does not apply.
        The last crop along the long side may run past the edge: it is cut there, as transformers' is."""
        if not self.pan_and_scan:
            return []
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio:
            return []
        # crops near the aspect ratio (half rounded up), each no narrower than the minimum, 2..max of them
        n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / self.min_crop_size)))
        n = min(self.max_num_crops, max(2, n))
        n_w, n_h = (n, 1) if width >= height else (1, n)
        crop_w, crop_h = int(math.ceil(width / n_w)), int(math.ceil(height / n_h))
        if min(crop_w, crop_h) < self.min_crop_size:
            return []
        return [(crop_h * i, crop_w * j, crop_h, crop_w) for i in range(n_h) for j in range(n_w)]

    def num_image_tokens(self, height: int, width: int) -> int:
        """Image tokens the prompt's placeholder expands to, from the size alone (no pixels decoded)."""
        return self.image_seq_length * (1 + len(self.crop_boxes(height, width)))

    def preprocess(self, image: Image.Image) -> Gemma3Image:
        img = as_array(image)
        crops = [img[t:t + h, l:l + w] for t, l, h, w in self.crop_boxes(*img.shape[:2])]
        out = []
        for x in [img] + crops:
            if self.pixels.do_resize:
                x = self.pixels.resize(x, self.height, self.width)
            out.append(self.pixels.to_float(x))
        if len({x.shape for x in out}) != 1:  # only without do_resize
            raise PreprocessorConfigError("do_resize", False, "Gemma 3's crops need resizing to one shape")
        return Gemma3Image(np.stack(out), len(crops), self.image_seq_length * len(out))
