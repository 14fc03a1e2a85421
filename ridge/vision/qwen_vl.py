"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL images (Qwen2VLImageProcessor): dynamic resolution.

Each image keeps its aspect ratio and is resized to multiples of patch_size x
merge_size with its pixel count inside [min_pixels, max_pixels] (smart_resize),
then cut into patches laid out so that each merge_size x merge_size block of
neighbours is contiguous (the merger's unit). A still image is repeated over
temporal_patch_size frames, as the encoder's 3D patch embedding expects.
Qwen3-VL's checkpoints use the same processor with patch 16 and mean/std 0.5."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ridge.errors import InvalidRequest

from .pixels import OPENAI_CLIP, RESAMPLE_DEFAULTS, Fields, Pixels, as_array, merged_patches

MAX_ASPECT_RATIO = 200
DEFAULTS = dict(RESAMPLE_DEFAULTS, resample=Image.Resampling.BICUBIC,
                size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                min_pixels=None, max_pixels=None,  # older configs: they override size's two edges
                image_mean=OPENAI_CLIP[0], image_std=OPENAI_CLIP[1],
                patch_size=14, temporal_patch_size=2, merge_size=2)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size (multiples of factor) nearest the image's with its pixels within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequest(f"image is {width}x{height}: Qwen-VL takes aspect ratios up to {MAX_ASPECT_RATIO}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class QwenVLImage:
    pixel_values: np.ndarray  # [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] float32
    image_grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w), in patches
    num_image_tokens: int  # grid_h * grid_w / merge_size**2: the merger's outputs


@dataclass(frozen=True, slots=True)
class QwenVLImages:
    pixels: Pixels
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int

    @classmethod
    def from_config(cls, cfg: dict) -> QwenVLImages:
        if isinstance(cfg.get("size"), dict):  # older files repeat min/max_pixels inside size; the top level wins
            size = {k: v for k, v in cfg["size"].items() if cfg.get(k) is None}
            both = cfg.get("min_pixels") is not None and cfg.get("max_pixels") is not None
            cfg = dict(cfg, size=size or (None if both else size))
        f = Fields(cfg, DEFAULTS, "Qwen-VL")
        size = f.size("size", default_to_square=False)
        edges = {"shortest_edge": size.get("shortest_edge"), "longest_edge": size.get("longest_edge")}
        if f.get("min_pixels") is not None:
            edges["shortest_edge"] = f.integer("min_pixels")
        if f.get("max_pixels") is not None:
            edges["longest_edge"] = f.integer("max_pixels")
        if set(size) - set(edges) or None in edges.values():
            f.refuse("size", "Qwen-VL reads shortest_edge and longest_edge (min and max pixels)")
        return cls(Pixels.read(f), edges["shortest_edge"], edges["longest_edge"], f.integer("patch_size"),
                   f.integer("temporal_patch_size"), f.integer("merge_size"))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        if not self.pixels.do_resize:
            return height, width
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def num_image_tokens(self, height: int, width: int) -> int:
        """Image tokens the prompt's placeholder expands to, from the size alone (no pixels decoded)."""
        return merged_patches(*self.resized(height, width), self.patch_size, self.merge_size)

    def preprocess(self, image: Image.Image) -> QwenVLImage:
        img = as_array(image)
        h, w = self.resized(*img.shape[:2])
        if self.pixels.do_resize:
            img = self.pixels.resize(img, h, w)
        x = self.pixels.to_float(img)  # [C, H, W]
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        if h % (p * m) or w % (p * m):
            raise InvalidRequest(f"image of {w}x{h} is not a multiple of {p * m} pixels (do_resize is off)")
        c, gh, gw = x.shape[0], h // p, w // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # the still image over t frames
        patches = np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p))
        return QwenVLImage(patches, (1, gh, gw), gh * gw // m**2)
