"""OLMo 3 (Olmo3Config): OLMo 2's layer (ridge/models/olmo2/) with sliding-window layers, 3
sliding to 1 full unless layer_types says otherwise, and a RoPE per layer type (model.py).

rope_parameters is keyed by layer type (full_attention, sliding_attention), as Olmo3Config saves
it; the older keys fold in as Olmo3Config.convert_rope_params_to_dict folds them: rope_scaling
updates the full layers' entry only, and rope_theta fills the full layers' base while the
sliding layers keep 500000 (refused where it differs: llama.cpp gives both layer types the one
base, so no two references agree on such a file).

GGUF: llama.cpp's converter writes Olmo 3 as olmo2 with attention.sliding_window (and the layer
pattern as attention.sliding_window_pattern, one flag a layer); llama.cpp slides 3 layers in 4
whatever the flags say, so a file whose flags say otherwise is refused. Its sliding layers take
rope.freq_base unscaled, its full layers the file's YaRN."""
from __future__ import annotations

from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_config import GGUFFamily, output_biases, refuse_yarn_attn_factor
from ridge.quant.hf_config import HFConfig, HFFamily, attention_biases, rope_fields, window_from_layer_types
from ridge.quant.spec import ModelSpec

from ..llama import LLAMA_DEFAULTS
from ..olmo2 import SPEC as OLMO2
from .model import Olmo3CausalLM

__all__ = ["SPEC", "Olmo3CausalLM"]

DEFAULT_THETA = 500000.0  # Olmo3Config.default_theta
LAYER_TYPES = ("full_attention", "sliding_attention")


def _pattern(n: int) -> list[str]:
    return ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]


class _LayerTypeRope(HFConfig):
    """One layer type's rope_parameters: a refusal names the field under that layer type."""

    def __init__(self, c: HFConfig, params: dict, where: str):
        super().__init__({"rope_parameters": params}, c.path, {"max_position_embeddings": c.get("max_position_embeddings")})
        self.where = where

    def refuse(self, key: str, value, why: str):
        super().refuse(key.replace("rope_parameters", self.where, 1), value, why)


def _rope_view(c: HFConfig, params: dict, where: str) -> dict:
    """One layer type's RoPE through the common reading (every key checked against its rope_type)."""
    if not isinstance(params, dict):
        c.refuse(where, params, "expected a JSON object")
    out = rope_fields(_LayerTypeRope(c, params, where),
                      c.get("head_dim") or c.require("hidden_size") // c.require("num_attention_heads"))
    if params.get("truncate") is False:
        # transformers' YaRN reads truncate from the top of rope_parameters, which a per-layer-type
        # dict never has: the flag is ignored there and would not be here.
        c.refuse(f"{where}.truncate", False, "transformers' Olmo 3 ignores it (it truncates)")
    return out


def _ropes(c: HFConfig) -> dict:
    params = c.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - set(LAYER_TYPES):
        c.refuse("rope_parameters", params, "Olmo 3 keys it by layer type (full_attention, sliding_attention)")
    full = {"rope_type": "default", **(params.get("full_attention") or {}), **(c.get("rope_scaling") or {})}
    local = {"rope_type": "default", **(params.get("sliding_attention") or {})}
    theta = c.get("rope_theta")
    if theta is not None and "rope_theta" not in local and theta != DEFAULT_THETA:
        c.refuse("rope_theta", theta, "transformers' Olmo 3 gives it to the full layers only (the sliding layers "
                                      f"keep {DEFAULT_THETA:g}) and llama.cpp to both; give rope_parameters per layer type")
    full.setdefault("rope_theta", DEFAULT_THETA if theta is None else theta)
    local.setdefault("rope_theta", DEFAULT_THETA)
    f = _rope_view(c, full, "rope_parameters.full_attention")
    s = _rope_view(c, local, "rope_parameters.sliding_attention")
    return dict(f, rope_local_theta=s["rope_theta"], rope_local_scaling=s["rope_scaling"])


def read_olmo3(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    window = c.positive_int("sliding_window")
    types = c.get("layer_types") or _pattern(n)
    if window is None and "sliding_attention" in types:
        c.refuse("sliding_window", None, "sliding layers need a window (transformers' Olmo 3 cannot run without one)")
    windows = window_from_layer_types(c, n, window, _pattern(n))
    ropes = _ropes(c)
    if windows["layer_types"] is None:  # every layer full: one table
        ropes.update(rope_local_theta=None, rope_local_scaling=None)
    return dict(qk_norm=True, **attention_biases(c, mlp=False), **windows, **ropes)


def claims_gguf(meta) -> bool:
    """An olmo2 file with a sliding window: Olmo 3's (OLMo 2 has none)."""
    return meta("attention.sliding_window") is not None


def read_olmo3_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    refuse_yarn_attn_factor("olmo2", a, kw, path)
    n, window = kw["num_layers"], a("attention.sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(path, f"olmo2.attention.sliding_window={window!r}: expected a positive integer")
    types = _pattern(n)
    flags = a("attention.sliding_window_pattern")
    if flags is not None and (not isinstance(flags, list)
                              or [bool(f) for f in flags] != [t == "sliding_attention" for t in types]):
        raise ModelLoadError(path, f"olmo2.attention.sliding_window_pattern={flags!r}: llama.cpp slides 3 layers "
                                   "in 4 whatever the flags say")
    return dict(output_biases(names), qk_norm=True, sliding_window=window, layer_types=types,
                rope_local_theta=kw["rope_theta"], rope_local_scaling=None)


SPEC = ModelSpec(
    "olmo3", Olmo3CausalLM,
    HFFamily(dict(LLAMA_DEFAULTS, vocab_size=50304, rms_norm_eps=1e-5, attention_bias=False, sliding_window=4096,
                  layer_types=None, rope_theta=None), read_olmo3),
    GGUFFamily("olmo2", claims=claims_gguf, read=read_olmo3_gguf,
               keys=frozenset({"rope.scaling.attn_factor", "attention.sliding_window",
                               "attention.sliding_window_pattern"}),
               names=OLMO2.gguf.names),
    OLMO2.weights,
)
