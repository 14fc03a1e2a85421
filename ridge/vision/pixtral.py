"""Pixtral and Mistral 3 images (PixtralImageProcessor): the longest edge capped, sides rounded up
to whole patches.

The prompt's placeholder is a grid: each row of [IMG] tokens ends in
[IMG_BREAK], the last in [IMG_END] instead. Mistral 3 merges 2x2 patches
after the encoder (the processor's spatial_merge_size), so its grid counts
patch_size x spatial_merge_size cells, and the resize rounds to that too."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .pixels import OPENAI_CLIP, RESAMPLE_DEFAULTS, Fields, Pixels, as_array

DEFAULTS = dict(RESAMPLE_DEFAULTS, resample=Image.Resampling.BICUBIC, size={"longest_edge": 1024},
                image_mean=OPENAI_CLIP[0], image_std=OPENAI_CLIP[1], patch_size={"height": 16, "width": 16},
                do_pad=True,  # pads a batch to its largest image: the sizes travel beside, as here
                do_center_crop=False, crop_size=None)


@dataclass(frozen=True, slots=True)
class PixtralImage:
    pixel_values: np.ndarray  # [3, H, W] float32, H and W whole cells
    image_size: tuple[int, int]  # (H, W)
    rows: int  # cells down: the placeholder's rows, each closed by [IMG_BREAK] (the last by [IMG_END])
    cols: int  # [IMG] tokens per row
    num_image_tokens: int  # rows * cols [IMG] tokens

    @property
    def num_placeholder_tokens(self) -> int:
        return self.rows * (self.cols + 1)


@dataclass(frozen=True, slots=True)
class PixtralImages:
    pixels: Pixels
    max_height: int
    max_width: int
    cell: tuple[int, int]  # (height, width) of a cell: patch_size x spatial_merge_size

    @classmethod
    def from_config(cls, cfg: dict, *, spatial_merge_size: int = 1) -> PixtralImages:
        """`spatial_merge_size`: the processor's (processor_config.json), 2 for Mistral 3, 1 for Pixtral."""
        f = Fields(cfg, DEFAULTS, "Pixtral")
        if f.flag("do_center_crop"):
            f.refuse("do_center_crop", "Pixtral's grid is the whole image; ridge does not crop it")
        f.flag("do_pad")
        size = f.size("size", default_to_square=True)
        if "longest_edge" in size and len(size) == 1:
            max_h = max_w = size["longest_edge"]
        elif set(size) == {"height", "width"}:
            max_h, max_w = size["height"], size["width"]
        else:
            f.refuse("size", "Pixtral reads longest_edge, or height and width")
        patch = f.size("patch_size", default_to_square=True)
        if set(patch) != {"height", "width"}:
            f.refuse("patch_size", "expected an int or height and width")
        return cls(Pixels.read(f), max_h, max_w,
                   (patch["height"] * spatial_merge_size, patch["width"] * spatial_merge_size))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        if not self.pixels.do_resize:
            return height, width
        ratio = max(height / self.max_height, width / self.max_width)
        if ratio > 1:  # floor, not round: the result never passes the cap
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        ch, cw = self.cell
        return ((height - 1) // ch + 1) * ch, ((width - 1) // cw + 1) * cw

    def grid(self, height: int, width: int) -> tuple[int, int]:
        h, w = self.resized(height, width)
        return h // self.cell[0], w // self.cell[1]

    def num_image_tokens(self, height: int, width: int) -> int:
        """[IMG] tokens the placeholder holds, from the size alone (no pixels decoded); the prompt
        also gets one [IMG_BREAK] or [IMG_END] per row."""
        rows, cols = self.grid(height, width)
        return rows * cols

    def preprocess(self, image: Image.Image) -> PixtralImage:
        img = as_array(image)
        if self.pixels.do_resize:
            img = self.pixels.resize(img, *self.resized(*img.shape[:2]))
        rows, cols = img.shape[0] // self.cell[0], img.shape[1] // self.cell[1]
        return PixtralImage(self.pixels.to_float(img), img.shape[:2], rows, cols, rows * cols)
