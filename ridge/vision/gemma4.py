"""Gemma 4's images (Gemma4ImageProcessor): a patch budget, aspect ratio kept.

The image is resized to the largest size whose sides are whole pooling cells
(pooling_kernel_size x patch_size) and whose patches fit max_soft_tokens x
pooling_kernel_size**2; pixels stay in [0, 1] (the tower was trained so, no
mean or std). Patches are flattened row by row as (patch row, patch column,
channel), padded to the budget with zeros, their (x, y) positions padded with
-1; each pooling_kernel_size**2 patches become one soft token."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ridge.errors import InvalidRequest

from .pixels import RESAMPLE_DEFAULTS, Fields, Pixels, as_array, merged_patches

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
DEFAULTS = dict(RESAMPLE_DEFAULTS, resample=Image.Resampling.BICUBIC, do_normalize=False,
                image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0),
                patch_size=16, max_soft_tokens=280, pooling_kernel_size=3)


@dataclass(frozen=True, slots=True)
class Gemma4Image:
    pixel_values: np.ndarray  # [max_patches, patch_size**2 * 3] float32, zero past the image's patches
    image_position_ids: np.ndarray  # [max_patches, 2] int64 (x, y) per patch, -1 past them
    num_image_tokens: int  # soft tokens: patches / pooling_kernel_size**2


@dataclass(frozen=True, slots=True)
class Gemma4Images:
    pixels: Pixels
    patch_size: int
    max_soft_tokens: int
    pooling_kernel_size: int

    @classmethod
    def from_config(cls, cfg: dict) -> Gemma4Images:
        f = Fields(cfg, DEFAULTS, "Gemma 4")
        if f.get("max_soft_tokens") not in SUPPORTED_SOFT_TOKENS:
            f.refuse("max_soft_tokens", f"Gemma 4 takes one of {SUPPORTED_SOFT_TOKENS}")
        return cls(Pixels.read(f), f.integer("patch_size"), f.get("max_soft_tokens"), f.integer("pooling_kernel_size"))

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The largest (height, width) in whole pooling cells with at most max_patches patches."""
        if not self.pixels.do_resize:
            return height, width
        target_px = self.max_patches * self.patch_size**2
        factor = math.sqrt(target_px / (height * width))
        cell = self.pooling_kernel_size * self.patch_size
        h, w = int(math.floor(factor * height / cell)) * cell, int(math.floor(factor * width / cell)) * cell
        longest = (self.max_patches // self.pooling_kernel_size**2) * cell
        if h == 0 and w == 0:
            raise InvalidRequest(f"image of {width}x{height} resizes to nothing for Gemma 4")
        if h == 0:  # a thin strip: one cell high, as long as its ratio allows
            h, w = cell, min(int(math.floor(width / height)) * cell, longest)
        elif w == 0:
            h, w = min(int(math.floor(height / width)) * cell, longest), cell
        if h * w > target_px:
            raise InvalidRequest(f"image of {width}x{height} exceeds Gemma 4's {self.max_patches} patches")
        return h, w

    def num_image_tokens(self, height: int, width: int) -> int:
        """Soft tokens the prompt's placeholder holds, from the size alone (no pixels decoded)."""
        return merged_patches(*self.resized(height, width), self.patch_size, self.pooling_kernel_size)

    def preprocess(self, image: Image.Image) -> Gemma4Image:
        img = as_array(image)
        h, w = self.resized(*img.shape[:2])
        if (h, w) != img.shape[:2]:  # transformers leaves an image already at its size untouched
            img = self.pixels.resize(img, h, w)
        x, p = self.pixels.to_float(img), self.patch_size
        c, nh, nw = x.shape[0], h // p, w // p
        if nh * nw > self.max_patches:
            raise InvalidRequest(f"image of {w}x{h} exceeds Gemma 4's {self.max_patches} patches")
        patches = x[:, :nh * p, :nw * p].reshape(c, nh, p, nw, p).transpose(1, 3, 2, 4, 0).reshape(nh * nw, -1)
        pixel_values = np.zeros((self.max_patches, p * p * c), dtype=np.float32)
        pixel_values[:nh * nw] = patches
        positions = np.full((self.max_patches, 2), -1, dtype=np.int64)
        grid_x, grid_y = np.meshgrid(np.arange(nw), np.arange(nh), indexing="xy")
        positions[:nh * nw] = np.stack([grid_x, grid_y], axis=-1).reshape(-1, 2)
        return Gemma4Image(pixel_values, positions, nh * nw // self.pooling_kernel_size**2)
