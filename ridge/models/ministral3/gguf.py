"""Ministral 3 from GGUF, as llama.cpp's converter writes it (conversion/mistral3.py,
Mistral3Model.Ministral3Model over LlamaModel; architecture mistral3). The converter writes
Mistral Small 3.1's text model under the same name, without YaRN or a temperature: such a file
reads as plain attention, as llama.cpp runs it.

Metadata: rope.scaling.* YaRN's factor, original context, yarn_beta_fast, yarn_beta_slow (llama.cpp's
defaults 32 and 1 where absent) and yarn_log_multiplier (rope_parameters.mscale_all_dim; 0 where
absent); attention.temperature_scale the query scale's beta (llama_4_scaling_beta; 0 or absent: no
query scale), its period llama.cpp's n_ctx_orig_yarn: rope.scaling.original_context_length, else
context_length. YaRN's own mscale is not in the format: llama.cpp takes it as 1 (llama-context.cpp),
and so does ridge, so a checkpoint with another mscale converts to a file both run with 1. The
format has no window either: llama.cpp's mistral3 attends over the whole context, and ridge with
it; a sliding_window key is refused by name, as every key not read here (yarn_attn_factor,
yarn_ext_factor, attn_factor, expert_count: math llama.cpp's graph would change).

Tensors: q and k permuted for llama.cpp's NORM rope (LlamaModel.modify_tensors), undone on reading."""
from __future__ import annotations

from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_config import GGUFFamily, output_biases

ARCH = "mistral3"
KEYS = frozenset({"rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_log_multiplier",
                  "attention.temperature_scale"})
LLAMA_CPP_YARN = {"rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
                  "rope.scaling.yarn_log_multiplier": 0.0}  # llama-hparams.h's defaults


def _number(a, key: str, default, path) -> float:
    v = a(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ModelLoadError(path, f"{ARCH}.{key}={v!r}: expected a number")
    return float(v)


def _rope(a, kw: dict, path) -> dict | None:
    scaling = kw["rope_scaling"]
    if scaling is None:
        return None
    kind = scaling["rope_type"]
    if kind == "linear":
        return scaling
    if kind != "yarn":
        raise ModelLoadError(path, f"{ARCH}.rope.scaling.type={kind!r}: ridge's {ARCH} reader knows yarn and linear")
    beta_fast, beta_slow, log_mul = (_number(a, k, d, path) for k, d in LLAMA_CPP_YARN.items())
    return dict(scaling, beta_fast=beta_fast, beta_slow=beta_slow, mscale=1.0, mscale_all_dim=log_mul)


def _query_scale(a, path) -> dict | None:
    beta = _number(a, "attention.temperature_scale", 0.0, path)
    if beta == 0.0:
        return None
    period = a("rope.scaling.original_context_length", a("context_length"))
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ModelLoadError(path, f"{ARCH}.rope.scaling.original_context_length={period!r}: the query scale's "
                                   "period, expected a positive integer")
    return dict(beta=beta, period=period)


def read_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    return dict(rope_scaling=_rope(a, kw, path), query_scale=_query_scale(a, path), **output_biases(names))


FAMILY = GGUFFamily(ARCH, read=read_gguf, keys=KEYS, permuted_qk=True)
