"""Qwen3-VL (Qwen3VLForConditionalGeneration, model_type qwen3_vl): a ViT with learned position
embeddings and deepstack mergers (vision.py) beside Qwen3's decoder with interleaved multimodal
rotary positions and deepstack additions (model.py; config.py reads both).

The text conversion reads model.language_model.* and lm_head.* in Qwen3's layout and skips the
tower's (model.visual.*), which vision.py's load_vision reads beside it. Images in the prompt
are Qwen2.5-VL's (ridge/vision/prompt.py QwenVLPrompt: Qwen2VLImageProcessor's patches of 16)."""
from __future__ import annotations

from ridge.quant.hf_config import HFFamily, HFWrapper
from ridge.quant.spec import ModelSpec

from .config import TEXT_DEFAULTS, WRAPPER_DEFAULTS, read_text, text_config, text_name
from .model import Qwen3VLCausalLM
from .vision import load_vision

# arch: transformers' text config type; checkpoints name the wrapper, read through it.
SPEC = ModelSpec("qwen3_vl_text", Qwen3VLCausalLM, HFFamily(TEXT_DEFAULTS, read_text),
                 hf_wrappers=(HFWrapper("qwen3_vl", WRAPPER_DEFAULTS, text_config, text_name, "vision tower",
                                        vision=load_vision),))
