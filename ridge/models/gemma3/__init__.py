"""Gemma 3 (text): Gemma 2's model (ridge/models/gemma2/) with QK-norm over each head, 5
sliding layers to 1 full, the sliding layers' own RoPE table, no attention soft-cap; read from
Gemma3TextConfig, from the multimodal Gemma3Config as its text model, and from llama.cpp's
gemma3 GGUFs (config.py). The multimodal checkpoint's SigLIP tower and projector: vision.py."""
from __future__ import annotations

from ridge.quant.gguf_config import GGUFFamily
from ridge.quant.hf_config import HFFamily, HFWrapper
from ridge.quant.spec import ModelSpec

from ..gemma2.config import GGUF_KEYS, GGUF_NAMES, WEIGHTS, shift_norms
from ..gemma2.model import GemmaCausalLM
from .config import GEMMA3_DEFAULTS, WRAPPER_DEFAULTS, read_gemma3, read_gemma3_gguf, text_config, text_name
from .vision import load_vision

SPEC = ModelSpec(
    "gemma3_text", GemmaCausalLM,
    HFFamily(GEMMA3_DEFAULTS, read_gemma3, act_field="hidden_activation", tensors=shift_norms),
    GGUFFamily("gemma3", read=read_gemma3_gguf, keys=GGUF_KEYS | {"rope.freq_base_swa"}, names=GGUF_NAMES),
    WEIGHTS,
    hf_wrappers=(HFWrapper("gemma3", WRAPPER_DEFAULTS, text_config, text_name,
                           "vision tower and projector", vision=load_vision),),
)
