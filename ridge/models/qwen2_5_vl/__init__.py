"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration, model_type qwen2_5_vl): a ViT with window
attention and a patch merger (vision.py) beside Qwen2's decoder with multimodal rotary positions
(config.py; ridge/models/layers/mrope.py).

The text conversion reads the language model's tensors (model.* or model.language_model.*, and
lm_head.*) in Qwen2's layout and skips the tower's (visual.*), which vision.py's load_vision reads
beside it.

Images in the prompt (ridge/vision/prompt.py QwenVLPrompt): each image is one run of
<|image_pad|> tokens between <|vision_start|> and <|vision_end|>, one per merged token, its
ImageInput's meta the grid in patches (the encoder's) and in merged tokens (the positions').

From GGUF (gguf.py: llama.cpp's qwen2vl) the text model, its encoder from the projector file
beside it (mmproj.py, `--mmproj`)."""
from __future__ import annotations

from ridge.quant.hf_config import HFFamily, HFWrapper
from ridge.quant.spec import ModelSpec

from ..layers.mrope import MRopeCausalLM
from .config import TEXT_DEFAULTS, WRAPPER_DEFAULTS, read_text, text_config, text_name
from .gguf import FAMILY as GGUF
from .vision import load_vision

# arch: transformers' text config type; checkpoints name the wrapper, read through it.
SPEC = ModelSpec("qwen2_5_vl_text", MRopeCausalLM, HFFamily(TEXT_DEFAULTS, read_text), GGUF,
                 hf_wrappers=(HFWrapper("qwen2_5_vl", WRAPPER_DEFAULTS, text_config, text_name, "vision tower",
                                        vision=load_vision),))
