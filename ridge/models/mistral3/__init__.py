"""Mistral 3 (Mistral3ForConditionalGeneration, model_type mistral3: Mistral Small 3.1 and 3.2,
the Ministral 3 checkpoints): a Pixtral vision tower and the Mistral 3 projector (vision.py)
beside a text model ridge already runs, a mistral or a ministral3 (config.py: read and run by
that family, its arch on the ModelConfig).

The text conversion reads model.language_model.* and lm_head.* and skips the tower's and the
projector's tensors, which vision.py's load_vision reads beside it.

Images in the prompt (ridge/vision/prompt.py, as PixtralProcessor writes them): an image of R x C
cells (patch_size x spatial_merge_size pixels each) is R rows of C [IMG] tokens, each row closed
by [IMG_BREAK], the last by [IMG_END] instead. Its placeholders are not one run, so one ImageInput
is one row: offset and length (C) its run of [IMG], content its own hash (the image's hash and
the row; the engine's encoder cache and the prefix cache key by it), meta the image's hash, the
row and the grid. vision.py encodes a whole image once and hands back the rows asked for,
keeping the last images' outputs by image hash for the rows a later prefill chunk asks for."""
from __future__ import annotations

from ridge.quant.hf_config import HFFamily, HFWrapper
from ridge.quant.spec import ModelSpec

from ..layers.decoder import CausalLM
from .config import WRAPPER_DEFAULTS, read_text, text_config, text_name
from .vision import load_vision

# arch: no config.json names it and no ModelConfig carries it: read_text gives the text family's
# arch (mistral or ministral3), whose model and tensor layout then run the text model.
SPEC = ModelSpec("mistral3_text", CausalLM, HFFamily({}, read_text),
                 hf_wrappers=(HFWrapper("mistral3", WRAPPER_DEFAULTS, text_config, text_name,
                                        "vision tower and projector", vision=load_vision),))
