"""gpt-oss: llama's attention with sinks and biases, sliding and full layers alternating, YaRN;
every layer a mixture of experts (ridge/models/layers/moe.py) with biases on the router and the
experts, the top k logits softmaxed, and the clamped SwiGLU. config.py reads it, weights.py
turns its shipped experts (MXFP4 or dequantized, gate and up interleaved) into ridge's layout."""
from __future__ import annotations

from ridge.quant.fuse import WeightLayout
from ridge.quant.gguf_config import EXPERT_KEYS, GGUFFamily
from ridge.quant.hf_config import MOE_IGNORED, HFFamily
from ridge.quant.spec import ModelSpec

from ..layers.moe import MoeCausalLM
from . import weights
from .config import DEFAULTS, read_gguf, read_gpt_oss

SPEC = ModelSpec(
    "gpt_oss", MoeCausalLM,
    HFFamily(DEFAULTS, read_gpt_oss, MOE_IGNORED, quant_methods=("mxfp4",)),
    GGUFFamily("gpt-oss", read=read_gguf, keys=EXPERT_KEYS | {"expert_feed_forward_length", "attention.sliding_window"},
               names=weights.GGUF_NAMES, tensor=weights.gguf_tensor),
    WeightLayout(experts=weights.experts),
)
