"""What the engine's encoder step takes of one image in a prompt: made by the daemon's input
processing (decode, the family's preprocessing, the placeholders in the prompt), read by the
engine (the encoder, its cache, the prefix cache's block identity)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One encoder input of a prompt: an image, or one tile or crop of it where the family
    encodes those apart (each with its own run of placeholders).

    content: what identifies its pixels (image_hash of what was preprocessed, and how): the
    encoder cache's key, and mixed into the name of every KV block its placeholders fall in, so
    that the same image and prompt hit the prefix cache and a different image never does.
    pixel_values: the family's preprocessing (ridge/vision/<family>.py), float32, as the model's
    encoder takes one input. offset, length: the run of placeholder tokens in the prompt the
    encoder's output rows replace, in order (length = its rows). meta: the family's facts about
    the input that the encoder needs beside the pixels (a patch mask, a grid)."""
    content: str
    pixel_values: np.ndarray
    offset: int
    length: int
    meta: dict = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.offset + self.length


def image_hash(pixel_values: np.ndarray, how: str = "") -> str:
    """sha256 of an encoder input's pixels, their shape and dtype, and `how` (the family and its
    preprocessing settings): equal inputs, equal names."""
    h = hashlib.sha256(f"{how}|{pixel_values.dtype}|{pixel_values.shape}".encode())
    h.update(np.ascontiguousarray(pixel_values).tobytes())
    return h.hexdigest()
