"""SmolVLM and Idefics3 images (SmolVLMImageProcessor, Idefics3ImageProcessor; the same steps).

The longest edge is scaled to `size` (up or down), then each side rounded up to
whole tiles of `max_image_size`; an image larger than one tile is cut into
rows x cols tiles, row by row, followed by the whole image squeezed into one
tile. Every tile is worth the processor's image_seq_len image tokens (169 for
Idefics3, 64 for SmolVLM's small checkpoints), each row of tiles introduced by
<row_r_col_c> markers in the prompt."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .pixels import IMAGENET_STANDARD, RESAMPLE_DEFAULTS, Fields, Pixels, as_array

MAX_IMAGE_SIZE = 4096  # transformers' absolute cap on the first resize
DEFAULTS = dict(RESAMPLE_DEFAULTS, resample=Image.Resampling.LANCZOS, size={"longest_edge": 4 * 364},
                image_mean=IMAGENET_STANDARD[0], image_std=IMAGENET_STANDARD[1],
                max_image_size={"longest_edge": 364}, do_image_splitting=True,
                do_pad=True,  # pads a batch to its largest tile count: one image's tiles are all one square
                return_row_col_info=False)


def _scale_to_longest(height: int, width: int, max_len: int) -> tuple[int, int]:
    """The long side to max_len, the other by the aspect ratio, made even, at least 1."""
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _cap(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width, height = max_len, int(max_len / aspect)
    elif height > width and height > max_len:
        height, width = max_len, int(max_len * aspect)
    return max(height, 1), max(width, 1)


def _round_to_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """Each side up to whole tiles; the short one from the long one's ratio, as transformers does."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _tile_grid(height: int, width: int, tile: int) -> tuple[int, int]:
    """(rows, cols) of whole tiles in an image rounded to tiles; (0, 0) when it is one tile."""
    if height > tile or width > tile:
        return (height - tile) // tile + 1, (width - tile) // tile + 1
    return 0, 0


@dataclass(frozen=True, slots=True)
class Idefics3Image:
    pixel_values: np.ndarray  # [rows * cols + 1 (or 1), 3, tile, tile] float32: the tiles, then the whole
    rows: int  # 0 and 0 when the image is a single tile
    cols: int
    num_image_tokens: int  # image_seq_len per tile


@dataclass(frozen=True, slots=True)
class Idefics3Images:
    pixels: Pixels
    longest_edge: int | None  # the first resize's target; None: size gives height and width instead
    size_hw: tuple[int, int] | None
    tile: int
    split: bool
    image_seq_len: int

    @classmethod
    def from_config(cls, cfg: dict, *, image_seq_len: int) -> Idefics3Images:
        """`image_seq_len`: the processor's (processor_config.json), image tokens per tile."""
        f = Fields(cfg, DEFAULTS, "SmolVLM/Idefics3")
        size = f.size("size", default_to_square=True)
        if set(size) == {"longest_edge"}:
            longest, size_hw = size["longest_edge"], None
        elif set(size) == {"height", "width"}:
            longest, size_hw = None, (size["height"], size["width"])
        else:
            f.refuse("size", "expected longest_edge, or height and width")
        tile = f.size("max_image_size", default_to_square=True)
        if set(tile) != {"longest_edge"}:
            f.refuse("max_image_size", "expected longest_edge")
        f.flag("do_pad"), f.flag("return_row_col_info")
        if isinstance(image_seq_len, bool) or not isinstance(image_seq_len, int) or image_seq_len < 1:
            raise ValueError(f"image_seq_len={image_seq_len!r}: expected a positive integer")
        return cls(Pixels.read(f), longest, size_hw, tile["longest_edge"], f.flag("do_image_splitting"),
                   image_seq_len)

    def first_size(self, height: int, width: int) -> tuple[int, int]:
        if not self.pixels.do_resize:
            return height, width
        if self.size_hw:
            return self.size_hw
        return _cap(*_scale_to_longest(height, width, self.longest_edge), MAX_IMAGE_SIZE)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles; (0, 0) for a single tile."""
        if not self.split:
            return 0, 0
        return _tile_grid(*_round_to_tiles(*self.first_size(height, width), self.tile), self.tile)

    def num_image_tokens(self, height: int, width: int) -> int:
        """Image tokens the prompt's placeholder holds, from the size alone (no pixels decoded)."""
        rows, cols = self.grid(height, width)
        return self.image_seq_len * (rows * cols + 1)

    def preprocess(self, image: Image.Image) -> Idefics3Image:
        img = as_array(image)
        if self.pixels.do_resize:
            img = self.pixels.resize(img, *self.first_size(*img.shape[:2]))
        t, rows, cols = self.tile, 0, 0
        if self.split:
            img = self.pixels.resize(img, *_round_to_tiles(*img.shape[:2], t))
            rows, cols = _tile_grid(*img.shape[:2], t)
            tiles = [img[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
            tiles.append(self.pixels.resize(img, t, t) if tiles else img)
        else:
            tiles = [self.pixels.resize(img, t, t)]
        out = np.stack([self.pixels.to_float(x) for x in tiles])
        return Idefics3Image(out, rows, cols, self.image_seq_len * len(tiles))
