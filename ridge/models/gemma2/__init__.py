"""Gemma 2 (Gemma2Config): llama's decoder with Gemma's four norms a layer, soft-capped
attention scores and logits, alternating sliding and full layers (model.py); config.py reads
it from config.json and from llama.cpp's gemma2 GGUFs."""
from __future__ import annotations

from ridge.quant.gguf_config import GGUFFamily
from ridge.quant.hf_config import HFFamily
from ridge.quant.spec import ModelSpec

from .config import GEMMA2_DEFAULTS, GGUF_KEYS, GGUF_NAMES, WEIGHTS, read_gemma2, read_gemma_gguf, shift_norms
from .model import GemmaCausalLM

def _read_gguf(a, kw, names, reader, path):
    return read_gemma_gguf("gemma2", a, kw, names, path, period=2, layers_27b=46, window=4096, attn_cap=50.0,
                           final_cap=30.0)

SPEC = ModelSpec(
    "gemma2", GemmaCausalLM,
    HFFamily(GEMMA2_DEFAULTS, read_gemma2, act_field="hidden_activation", tensors=shift_norms),
    GGUFFamily("gemma2", read=_read_gguf, keys=GGUF_KEYS | {"attn_logit_softcapping"}, names=GGUF_NAMES),
    WEIGHTS,
)
