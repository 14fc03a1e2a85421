"""EXAONE 4 (Exaone4Config): OLMo 2's layer placement (norms after attention and the MLP, none
before) with QK-norm over each head, sliding layers beside global ones (3 sliding : 1 global by
default, sliding_window_pattern) and, where the model has a window at all, no RoPE on its global
layers (NoPE: ModelConfig.nope_layers), as transformers' Exaone4Attention computes them.

The released configs give layer_types with sliding_window_pattern as a string ("LLLG"), which
transformers then never reads; without layer_types the pattern must be the integer transformers
takes the layers' indices modulo.

GGUF exaone4 (llama.cpp's converter: Exaone4Model): OLMo 2's tensor names, per-head q and k
norms, rows unpermuted (NEOX rope), a llama3 scaling as the rope_freqs tensor. llama.cpp slides
only the 64-layer model (the 32B): 3 layers in 4, over attention.sliding_window (4096 where
absent), with RoPE on the sliding layers alone; any other depth runs every layer full with RoPE,
so such a file that carries a window, or flags sliding layers, is refused rather than run unlike
its checkpoint."""
from __future__ import annotations

from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_config import GGUFFamily, refuse_yarn_attn_factor
from ridge.quant.hf_config import HFConfig, HFFamily, rope_fields, window_from_layer_types
from ridge.quant.spec import ModelSpec

from ..llama import LLAMA_DEFAULTS
from ..olmo2 import SPEC as OLMO2
from .model import Exaone4CausalLM

__all__ = ["SPEC", "Exaone4CausalLM"]


def _layer_types(c: HFConfig, n: int, window: int | None) -> list[str]:
    types = c.get("layer_types")
    if types is not None:
        return types  # checked by window_from_layer_types
    if window is None:
        c.refuse("layer_types", None, "without a sliding_window transformers' Exaone4Config needs the layer types given")
    every = c.get("sliding_window_pattern")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        c.refuse("sliding_window_pattern", every, "expected a positive integer where layer_types is not given")
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]


def read_exaone4(c: HFConfig, kw: dict) -> dict:
    n, window = kw["num_layers"], c.positive_int("sliding_window")
    types = _layer_types(c, n, window)
    if window is None and isinstance(types, list) and "sliding_attention" in types:
        c.refuse("sliding_window", None, "sliding layers need a window (transformers' EXAONE 4 cannot run without one)")
    windows = window_from_layer_types(c, n, window, types)
    # transformers: RoPE on every layer without a window, else on the sliding layers only
    nope = [] if window is None else [i for i, t in enumerate(types) if t != "sliding_attention"]
    return dict(qk_norm=True, **rope_fields(c, kw["head_dim"]), **windows, nope_layers=nope or None)


def read_exaone4_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    refuse_yarn_attn_factor("exaone4", a, kw, path)
    n, window, flags = kw["num_layers"], a("attention.sliding_window"), a("attention.sliding_window_pattern")
    if n != 64:
        if window is not None or (isinstance(flags, list) and any(flags)):
            key = "window" if window is not None else "window_pattern"
            raise ModelLoadError(path, f"exaone4.attention.sliding_{key}={window if window is not None else flags!r}: "
                                       f"llama.cpp runs {n} layers without sliding windows (only the 64-layer model "
                                       "slides), unlike the checkpoint")
        return dict(qk_norm=True)
    window = 4096 if window is None else window
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(path, f"exaone4.attention.sliding_window={window!r}: expected a positive integer")
    types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    if flags is not None and (not isinstance(flags, list)
                              or [bool(f) for f in flags] != [t == "sliding_attention" for t in types]):
        raise ModelLoadError(path, f"exaone4.attention.sliding_window_pattern={flags!r}: llama.cpp slides 3 layers "
                                   "in 4 whatever the flags say")
    return dict(qk_norm=True, sliding_window=window, layer_types=types,
                nope_layers=[i for i, t in enumerate(types) if t == "full_attention"])


SPEC = ModelSpec(
    "exaone4", Exaone4CausalLM,
    HFFamily(dict(LLAMA_DEFAULTS, vocab_size=102400, intermediate_size=16384, num_key_value_heads=32,
                  rms_norm_eps=1e-5, sliding_window=4096, sliding_window_pattern=4, layer_types=None), read_exaone4),
    GGUFFamily("exaone4", read=read_exaone4_gguf, names=OLMO2.gguf.names,
               keys=frozenset({"rope.scaling.attn_factor", "attention.sliding_window",
                               "attention.sliding_window_pattern"})),
    OLMO2.weights,
)
