"""Qwen2.5-VL's text model from GGUF, as llama.cpp's converter writes it (convert_hf_to_gguf.py
Qwen2VLModel: architecture qwen2vl, Qwen2-VL's and Qwen2.5-VL's alike, whose decoders are the same).

Qwen2's keys and tensors (q, k and v biases, stored unpermuted) and rope.dimension_sections:
rope_parameters' mrope_section padded with zeros to four, which llama.cpp's MROPE reads as runs
of frequencies for t, h, w and a fourth axis. llama.cpp runs no sliding window for this
architecture (as transformers runs none without use_sliding_window). The image encoder comes
with the projector file (mmproj.py)."""
from __future__ import annotations

from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_config import GGUFFamily

ARCH = "qwen2vl"
KEYS = frozenset({"rope.dimension_sections"})


def read_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    """The mrope split, as the HF directory's config gives it (config.py read_text)."""
    key = f"{ARCH}.rope.dimension_sections"
    sections = a("rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) != 4 or \
            any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sections):
        raise ModelLoadError(path, f"{key}={sections!r}: expected four counts of frequencies (mrope_section "
                                   "padded to four), as llama.cpp needs")
    if sections[3]:
        raise ModelLoadError(path, f"{key}={sections!r}: a fourth axis, which Qwen2.5-VL's rotation does not have")
    half = kw["head_dim"] // 2
    if sum(sections) != half:
        # transformers splits the head's frequencies by the three runs: they must cover them exactly
        raise ModelLoadError(path, f"{key}={sections!r}: the runs must sum to head_dim / 2 = {half}")
    return dict(extra={"mrope_section": [int(s) for s in sections[:3]], "mrope_interleaved": False})


FAMILY = GGUFFamily(ARCH, read=read_gguf, keys=KEYS)
