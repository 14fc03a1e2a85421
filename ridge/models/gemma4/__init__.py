"""Gemma 4 (text): Gemma 3's decoder with per-layer input embeddings, KV-shared layers, its own
norms and RoPE per layer type (model.py); read from Gemma4TextConfig, and from the multimodal
Gemma4Config as its text model (config.py) beside its image encoder (vision.py), and from
llama.cpp's gemma4 GGUF (gguf.py)."""
from __future__ import annotations

from ridge.quant.hf_config import HFFamily, HFWrapper
from ridge.quant.spec import ModelSpec

from . import gguf
from .config import GEMMA4_DEFAULTS, WEIGHTS, WRAPPER_DEFAULTS, read_gemma4, text_config, text_name
from .model import Gemma4CausalLM
from .vision import load_vision

SPEC = ModelSpec("gemma4_text", Gemma4CausalLM, HFFamily(GEMMA4_DEFAULTS, read_gemma4, act_field="hidden_activation"),
                 gguf=gguf.FAMILY,  # GGUF as llama.cpp writes it: gguf.py
                 weights=WEIGHTS, hf_wrappers=(HFWrapper("gemma4", WRAPPER_DEFAULTS, text_config, text_name,
                                                         "audio tower", vision=load_vision),))
