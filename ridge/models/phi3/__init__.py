"""Phi-3 and Phi-4: llama's decoder with q, k, v and gate, up shipped fused (qkv_proj,
gate_up_proj: the model's layout), partial rotary, LongRoPE and a window on every layer
(Phi3Config).

GGUF phi3 (llama.cpp's converter: Phi3MiniModel; llama-model.cpp): attn_qkv holds [q | k | v]
and ffn_up [gate | up], HF's fused layout; LongRoPE's factors are the tensors
rope_factors_long / rope_factors_short, with rope.scaling.original_context_length and
rope.scaling.attn_factor; llama.cpp takes the long factors where its context exceeds the
original, as ridge does; rope.dimension_count is the partial rotary width;
attention.sliding_window applies to every layer, 0 meaning none (Phi-4). NEOX rope: stored
unpermuted."""
from __future__ import annotations

import math

import numpy as np

from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import WeightLayout
from ridge.quant.gguf_config import GGUFFamily, output_biases, refuse_yarn_attn_factor
from ridge.quant.hf_config import HFConfig, HFFamily, rope_fields, window_all
from ridge.quant.spec import ModelSpec

from ..layers.decoder import CausalLM
from ..llama import LLAMA_DEFAULTS


def read_phi3(c: HFConfig, kw: dict) -> dict:
    # rope: su and yarn are longrope's old names (Phi3Config); original_max_position_embeddings is a
    # class field, so it overrides rope_parameters' own.
    rope = rope_fields(c, kw["head_dim"], types=("default", "longrope"), aliases={"su": "longrope", "yarn": "longrope"},
                       partial_rotary=True, original_max_field=True)
    return {**rope, **window_all(c, kw["num_layers"])}


def _tensor(reader, name: str) -> list[float]:
    t = next(t for t in reader.tensors if t.name == name)
    return np.array(t.data, dtype=np.float32).reshape(-1).tolist()


def read_phi3_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    out = output_biases(names)
    refuse_yarn_attn_factor("phi3", a, kw, path)
    window = a("attention.sliding_window")
    if window:
        out.update(sliding_window=int(window), layer_types=["sliding_attention"] * kw["num_layers"])
    rotary = int(a("rope.dimension_count", kw["head_dim"]))
    if rotary != kw["head_dim"]:
        if rotary % 2 or not 0 < rotary <= kw["head_dim"]:
            raise ModelLoadError(path, f"phi3.rope.dimension_count={rotary}: ridge needs an even count up to head_dim")
        out["rotary_dim"] = rotary
    if kw["rope_scaling"]:
        raise ModelLoadError(path, f"phi3.rope.scaling.type={kw['rope_scaling']['rope_type']!r}: llama.cpp's phi3 "
                                   "scales by its rope_factors tensors only")
    if "rope_factors_long.weight" in names:
        old = int(a("rope.scaling.original_context_length", kw["max_position"]))
        factor = kw["max_position"] / old
        attn = a("rope.scaling.attn_factor")
        if attn is None:  # the converter's rule, which is transformers' default
            attn = math.sqrt(1 + math.log(factor) / math.log(old)) if factor > 1.0 else 1.0
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": _tensor(reader, "rope_factors_long.weight"),
                               "short_factor": _tensor(reader, "rope_factors_short.weight"),
                               "original_max_position_embeddings": old, "factor": factor,
                               "attention_factor": float(attn)}
    return out


SPEC = ModelSpec(
    "phi3", CausalLM,
    HFFamily(dict(LLAMA_DEFAULTS, vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                  max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                  sliding_window=None, partial_rotary_factor=None),
             read_phi3, frozenset({"resid_pdrop", "embd_pdrop"})),
    GGUFFamily("phi3", read=read_phi3_gguf, keys=frozenset({"attention.sliding_window", "rope.scaling.attn_factor"}),
               names={"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
               config_tensors=("rope_factors_long.weight", "rope_factors_short.weight"), partial_rotary=True),
    WeightLayout(fused_as_shipped=True),
)
