"""Gemma 2 and Gemma 3 GGUFs (general.architecture gemma2, gemma3: llama.cpp's converter), read as
llama.cpp reads them (llama-model.cpp's hparams for both):
- layer types: Gemma 2 alternates from a sliding layer, Gemma 3 repeats 5 sliding : 1 full; the
  window is attention.sliding_window (Gemma 2: 4096 where absent; Gemma 3: no sliding layers);
- the sliding layers' RoPE: base 10000 unscaled on Gemma 3 (rope.freq_base_swa where a file
  has it); the full layers' rope.freq_base and rope.scaling;
- soft-caps attn_logit_softcapping (Gemma 2, default 50) and final_logit_softcapping (default
  30 on Gemma 2, none on Gemma 3);
- no query_pre_attn_scalar in the format: llama.cpp scales by head_dim ** -0.5, except the 27B
  models (46 and 62 layers), which use (hidden / heads) ** -0.5, as their HF configs say;
- norms stored as the multiplier 1 + w (the converter adds the 1), which the model takes as is.
Q and K rows are stored unpermuted (Gemma's RoPE is the rotate-half one)."""
from __future__ import annotations

from .errors import ModelLoadError

GEMMA_GGUF = {"gemma2": "gemma2", "gemma3": "gemma3_text"}  # general.architecture -> ModelConfig.arch
# Gemma's four norms a layer; llama's ffn_norm is Gemma's pre_feedforward_layernorm.
LAYER_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_PERIOD = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def _positive(path, key: str, v):
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        raise ModelLoadError(path, f"{key}={v!r}: expected a positive number")
    return v


def gemma_fields(arch: str, a, kw: dict, names: set[str], path) -> dict:
    """ModelConfig keyword arguments beyond the common ones (kw); a(key, default): the
    architecture's metadata; names: the file's tensors."""
    n = kw["num_layers"]
    period = _PERIOD[arch]
    pattern = a("attention.sliding_window_pattern")
    if pattern is not None and pattern != period:  # llama.cpp's Gemma reads a fixed period
        raise ModelLoadError(path, f"{arch}.attention.sliding_window_pattern={pattern!r}: llama.cpp runs "
                                   f"{arch} with a period of {period}")
    window = _positive(path, f"{arch}.attention.sliding_window",
                       a("attention.sliding_window", 4096 if arch == "gemma2" else None))
    types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]
    heads = kw["num_heads"]
    scalar = kw["hidden_size"] // heads if n == _LAYERS_27B[arch] else kw["head_dim"]
    out = dict(arch=GEMMA_GGUF[arch], hidden_act="gelu_pytorch_tanh", softmax_scale=scalar ** -0.5,
               sliding_window=window, layer_types=types if window is not None else None,
               o_bias="blk.0.attn_output.bias" in names,
               attn_logit_softcapping=_positive(path, f"{arch}.attn_logit_softcapping",
                                                a("attn_logit_softcapping", 50.0)) if arch == "gemma2" else None,
               final_logit_softcapping=_positive(path, f"{arch}.final_logit_softcapping",
                                                 a("final_logit_softcapping", 30.0 if arch == "gemma2" else None)))
    if arch == "gemma3":
        out["rope_local_theta"] = float(_positive(path, f"{arch}.rope.freq_base_swa", a("rope.freq_base_swa", 10000.0)))
    if (kw["rope_scaling"] or {}).get("rope_type") not in (None, "linear"):
        raise ModelLoadError(path, f"{arch}.rope.scaling.type={kw['rope_scaling']['rope_type']!r}: ridge runs "
                                   "Gemma with none or linear")
    return out
