"""Idefics3 and SmolVLM (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration):
a SigLIP vision tower and a pixel-shuffle connector (vision.py) beside a llama text model,
which ridge runs as llama (ridge/models/llama/: its reading, its decoder, its tensor layout).

config.py reads the wrappers' config.json: text_config as the llama, the vision fields honoured
or refused by name. The text conversion reads model.text_model.* and lm_head.* and skips the
tower's and the connector's tensors, which vision.py's load_vision reads beside it."""
from __future__ import annotations

from ridge.quant.hf_config import HFWrapper
from ridge.quant.spec import ModelSpec

from ..llama import SPEC as LLAMA
from .config import MODEL_TYPES, WRAPPER_DEFAULTS, text_config, text_name
from .vision import load_vision


# arch: the text model the wrappers hold, read as llama; no config.json on the Hub names it.
SPEC = ModelSpec("idefics3_text", LLAMA.model, LLAMA.hf, weights=LLAMA.weights,
                 hf_wrappers=tuple(HFWrapper(t, WRAPPER_DEFAULTS, text_config, text_name,
                                             "vision tower and connector", vision=load_vision) for t in MODEL_TYPES))
