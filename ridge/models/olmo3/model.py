"""OLMo 3, as transformers' Olmo3 modeling code computes it: OLMo 2's layer (norms after attention
and the MLP, QK-norm over the whole projections) with sliding-window layers beside full ones
(config.layer_types, 3 sliding : 1 full by default), each layer type with its own RoPE: the
full layers take rope_theta with the checkpoint's scaling (YaRN on the long-context models),
the sliding layers their own table (ModelConfig.rope_local_theta and rope_local_scaling)."""
from __future__ import annotations

from ..olmo2.model import Olmo2CausalLM, Olmo2DecoderLayer


# Its sliding layers' own RoPE table is CausalLM's (cos_sin_local, from rope_local_theta):
# OLMo 3 is OLMo 2's layer and model as they are.
Olmo3DecoderLayer = Olmo2DecoderLayer
Olmo3CausalLM = Olmo2CausalLM
