"""llama.cpp's projector files (`--mmproj FILE`, as llama-server takes them beside a text GGUF): a
GGUF of general.architecture "clip" whose clip.projector_type names the family that reads it
(registry.PROJECTORS: its folder's mmproj.py). What it gives: the image encoder (the engine's
encode() hook, as an HF directory's load_vision gives it) and the image prompt rule, which takes
its three tokens' ids from the text model's vocabulary."""
from __future__ import annotations

from importlib import import_module
from pathlib import Path

import torch

from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_loader import _dequantize, open_gguf


def _open(path) -> tuple[dict, object, object]:
    """-> (its metadata, its reader, the family's mmproj module)."""
    from ridge.tokenizer import gguf_metadata_to_dict

    from .registry import PROJECTORS

    path = Path(path)
    reader = open_gguf(path)
    meta = gguf_metadata_to_dict(reader)
    if meta.get("general.architecture") != "clip":
        raise ModelLoadError(path, f"general.architecture={meta.get('general.architecture')!r}: --mmproj takes a "
                                   "projector file (clip), as llama.cpp's converter writes with --mmproj")
    if meta.get("clip.has_vision_encoder") is not True:
        raise ModelLoadError(path, "clip.has_vision_encoder is not true: ridge reads image encoders only")
    kind = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if kind not in PROJECTORS:
        raise ModelLoadError(path, f"clip.projector_type={kind!r}: ridge reads {', '.join(sorted(PROJECTORS))}")
    return meta, reader, import_module(f"{__package__}.{PROJECTORS[kind]}.mmproj")


def load_mmproj(path, device, dtype: torch.dtype, weights: str, text_hidden_size: int):
    """The image encoder a projector file holds, its weights in dtype on device (e4m3 products
    where weights is "fp8")."""
    meta, reader, family = _open(path)
    width = meta.get("clip.vision.projection_dim")
    if width != text_hidden_size:  # the rows replace the text model's embeddings
        raise ModelLoadError(path, f"clip.vision.projection_dim={width!r}: the text model is {text_hidden_size} wide "
                                   "(a projector of another model)")
    tensors = {}
    for t in reader.tensors:
        try:
            tensors[t.name] = _dequantize(t)
        except Exception as e:
            raise ModelLoadError(path, f"tensor {t.name} ({t.tensor_type.name}) cannot be read: {e}") from None
    return family.load(tensors, meta, Path(path), device, dtype, weights, text_hidden_size)


def mmproj_prompt_rules(path, token_id):
    """The image prompt rule of a projector file; token_id(text) -> the text model's id of a token."""
    meta, _, family = _open(path)
    return family.prompt_rules(meta, Path(path), token_id)


def vocabulary_ids(tokens, token_id, path, model: str) -> list[int]:
    """The text model's ids of a projector's prompt tokens (token_id(text) -> id or None); a token
    its vocabulary lacks says the projector is another model's."""
    ids = [token_id(t) for t in tokens]
    if None in ids:
        raise ModelLoadError(path, f"the text model's vocabulary has no {tokens[ids.index(None)]}: not {model}'s (a "
                                   "projector of another model)")
    return ids
