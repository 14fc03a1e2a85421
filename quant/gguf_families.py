"""Phi-3/4, OLMo 2 and Granite GGUFs (general.architecture phi3, olmo2, granite), as
llama.cpp's converter writes them (convert_hf_to_gguf.py: Phi3MiniModel, Olmo2Model,
GraniteModel) and llama.cpp reads them (llama-model.cpp):
- phi3: attn_qkv holds [q | k | v] and ffn_up [gate | up], HF's fused layout; LongRoPE's
  factors are the tensors rope_factors_long / rope_factors_short, with
  rope.scaling.original_context_length and rope.scaling.attn_factor; llama.cpp takes the long
  factors where its context exceeds the original, as ridge does; rope.dimension_count is the
  partial rotary width; attention.sliding_window applies to every layer, 0 meaning none (Phi-4);
- olmo2: post_attention_norm and post_ffw_norm, no input norm; q and k norms over the whole
  projection; attention.sliding_window is Olmo 3's (a 3-sliding-to-1-full pattern), refused;
- granite: the multipliers as attention.scale, embedding_scale, residual_scale and logit_scale,
  each written only where non-zero (absent: head_dim ** -0.5 and 1).
phi3 and olmo2 use llama.cpp's NEOX rope, stored unpermuted; granite's rows are permuted as
llama's."""
from __future__ import annotations

import math

import numpy as np

from .errors import ModelLoadError
from .gguf_moe import MOE_KEYS

FAMILY_GGUF = ("phi3", "olmo2", "granite")
# llama.cpp's NORM rope: the converter interleaves Q and K rows (ModelConfig.arch; Mixtral is written as llama)
PERMUTED_QK = ("llama", "granite", "mixtral")
_BIASES = {"attn_output.bias": "self_attn.o_proj.bias", "ffn_gate.bias": "mlp.gate_proj.bias",
           "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias"}
LAYER_NAMES = {  # per architecture, over llama's names
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "olmo2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight", **_BIASES},
    "granite": _BIASES,
}
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # read into the config
# The {arch}.* keys read for llama, qwen2, qwen3, gemma2, gemma3 and these three; any other key under the
# architecture may change the math (an expert count, a yarn multiplier, a window) and is refused.
KNOWN_KEYS = {
    "common": {"block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
               "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
               "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
               "rope.scaling.factor", "rope.scaling.original_context_length",
               "pooling_type"},  # an embedding model's pooling: read by engine/pooling.py
    "phi3": {"attention.sliding_window", "rope.scaling.attn_factor"},
    "olmo2": {"rope.scaling.attn_factor"},
    "granite": {"attention.scale", "embedding_scale", "residual_scale", "logit_scale"},
    **MOE_KEYS,  # quant/gguf_moe.py's: llama's experts (Mixtral) and qwen3moe's
    # quant/gguf_gemma.py's
    "gemma2": {"attention.sliding_window", "attention.sliding_window_pattern", "attn_logit_softcapping",
               "final_logit_softcapping"},
    "gemma3": {"attention.sliding_window", "attention.sliding_window_pattern", "final_logit_softcapping",
               "rope.freq_base_swa"},
}


def check_keys(arch: str, keys, head_dim: int, rotary: int | None, path) -> None:
    """keys: the file's metadata keys. rotary: rope.dimension_count, which only phi3 may set below
    head_dim (partial rotary)."""
    known = KNOWN_KEYS["common"] | KNOWN_KEYS.get(arch, set())
    for key in keys:
        if key.startswith(arch + ".") and key[len(arch) + 1:] not in known:
            raise ModelLoadError(path, f"{key}: a key ridge's {arch} reader does not honour")
    if arch != "phi3" and rotary is not None and int(rotary) != head_dim:
        raise ModelLoadError(path, f"{arch}.rope.dimension_count={rotary}: partial rotary, which {arch} does not have")


def _tensor(reader, name: str) -> list[float]:
    t = next(t for t in reader.tensors if t.name == name)
    return np.array(t.data, dtype=np.float32).reshape(-1).tolist()


def family_fields(arch: str, a, kw: dict, names: set[str], reader, path) -> dict:
    """ModelConfig keyword arguments beyond the common ones (kw); a(key, default): the
    architecture's metadata; names: the file's tensors."""
    out = dict(o_bias="blk.0.attn_output.bias" in names, mlp_bias="blk.0.ffn_down.bias" in names)
    if kw["rope_scaling"] and kw["rope_scaling"]["rope_type"] == "yarn" and a("rope.scaling.attn_factor") is not None:
        raise ModelLoadError(path, f"{arch}.rope.scaling.attn_factor={a('rope.scaling.attn_factor')!r} with yarn: "
                                   "ridge does not know how llama.cpp combines it with yarn's own scale")
    if arch == "phi3":
        out.update(_phi3(a, kw, names, reader, path))
    elif arch == "olmo2":
        if a("attention.sliding_window") is not None:
            raise ModelLoadError(path, f"olmo2.attention.sliding_window={a('attention.sliding_window')!r}: an "
                                       "Olmo 3 file, which ridge does not run")
        out["qk_norm"] = True
    elif arch == "granite":
        out.update(softmax_scale=a("attention.scale"), embedding_multiplier=a("embedding_scale", 1.0),
                   residual_multiplier=a("residual_scale", 1.0), logits_scaling=a("logit_scale", 1.0))
    return out


def _phi3(a, kw: dict, names: set[str], reader, path) -> dict:
    out: dict = {}
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
