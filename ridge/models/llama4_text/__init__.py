"""Llama 4 text (Llama4TextConfig; model.py for the math): llama's decoder with NoPE layers
(no_rope_layers, every fourth by default), a weightless QK-norm on the RoPE layers
(use_qk_norm), temperature tuning on the NoPE layers (attn_temperature_tuning, attn_scale,
floor_scale), chunked attention on the RoPE layers (attention_chunk_size, layer_types), and
mixtures of experts in moe_layers (every interleave_moe_layer_step-th by default): num_local_experts
experts of intermediate_size, a shared expert of the same width, the dense layers' MLP of
intermediate_size_mlp.

Chunked attention: a query sees only the keys of its own attention_chunk_size-token chunk. Within
the first chunk that is causal attention, and ridge's kernels do not yet mask by chunk, so ridge
serves Llama 4 at contexts up to attention_chunk_size (8192 on Scout and Maverick), where it is
exact: max_position is capped there. router_jitter_noise is training's.

The Hub ships Scout and Maverick as Llama4ForConditionalGeneration (model_type llama4): read as
its text model, text_config (a llama4_text), served as text; the vision model and the projector
are not loaded. Its language_model is a Llama4ForCausalLM built from text_config, so
text_config's tie_word_embeddings ties the head (the wrapper's own flag does not).

GGUF llama4 (llama.cpp's converter: Llama4Model): rows as the checkpoint's (reordered by the
model as from Hugging Face), experts stacked (ffn_*_exps), the router ffn_gate_inp, the shared
expert ffn_*_shexp, interleave_moe_layer_step, a llama3 scaling as the rope_freqs tensor. What
llama.cpp fixes rather than reads, ridge takes as it does: 8192-token chunks on 3 layers in 4
(the fourth NoPE), temperature tuning 0.1 over 8192 tokens, QK-norm unless 128 experts
(Maverick). A file with attention.sliding_window (llama.cpp's MobileLLM variant) is refused."""
from __future__ import annotations

import torch

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import FP8, WeightLayout
from ridge.quant.gguf_config import EXPERT_KEYS, GGUFFamily, expert_fields, refuse_yarn_attn_factor
from ridge.quant.hf_config import (HFConfig, HFFamily, HFWrapper, MOE_IGNORED, attention_biases, experts_count,
                                    nested_text_config, rope_fields, wrapper_names)
from ridge.quant.spec import ModelSpec

from .model import Llama4CausalLM

__all__ = ["SPEC", "Llama4CausalLM"]

DEFAULTS = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, tie_word_embeddings=False,
                num_experts_per_tok=1, num_local_experts=16, moe_layers=None, interleave_moe_layer_step=1,
                use_qk_norm=True, rope_parameters=None, no_rope_layers=None, no_rope_layer_interval=4,
                attention_chunk_size=8192, layer_types=None, attn_temperature_tuning=True, floor_scale=8192,
                attn_scale=0.1, attention_bias=False, rope_theta=500000.0)
LAYER_TYPES = ("full_attention", "chunked_attention")


def _int_list(c: HFConfig, key: str, n: int | None = None) -> list[int] | None:
    v = c.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in v) or \
            (n is not None and len(v) != n):
        c.refuse(key, v, "expected a list of integers" + (f", one a layer ({n})" if n is not None else ""))
    return v


def _rotary(c: HFConfig, n: int) -> list[bool]:
    flags = _int_list(c, "no_rope_layers")
    if not flags:  # Llama4TextConfig: an empty list takes the default too
        every = c.positive_int("no_rope_layer_interval")
        return [(i + 1) % every != 0 for i in range(n)]
    if len(flags) != n or any(f not in (0, 1) for f in flags):
        c.refuse("no_rope_layers", flags, f"expected {n} flags, 1 where the layer applies RoPE")
    return [bool(f) for f in flags]


def _context(c: HFConfig, rotary: list[bool], kw: dict) -> int:
    """max_position: within one chunk where any layer is chunked (see the module's docstring)."""
    chunk = c.positive_int("attention_chunk_size")
    types = c.get("layer_types")
    if types is None:
        types = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rotary]
    if not isinstance(types, list) or len(types) != len(rotary) or any(t not in LAYER_TYPES for t in types):
        c.refuse("layer_types", types, f"expected {len(rotary)} of {', '.join(LAYER_TYPES)}")
    if "chunked_attention" not in types:
        return kw["max_position"]
    if chunk is None:
        c.refuse("attention_chunk_size", None, "chunked layers need a chunk size")
    return min(kw["max_position"], chunk)


def _moe(c: HFConfig, n: int) -> dict:
    experts, k = experts_count(c, "num_local_experts")
    layers = _int_list(c, "moe_layers")
    if layers is None:
        step = c.positive_int("interleave_moe_layer_step")
        layers = list(range(step - 1, n, step))
    if any(not 0 <= i < n for i in layers):
        c.refuse("moe_layers", layers, f"layer indices run 0 to {n - 1}")
    layers = sorted(set(layers)) if experts else []
    if not layers:
        return {}
    width = c.positive_int("intermediate_size")
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=width, moe_router="topk_sigmoid",
                moe_layers=None if len(layers) == n else layers, shared_expert_intermediate_size=width)


def read_llama4_text(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    rotary = _rotary(c, n)
    nope = [i for i, r in enumerate(rotary) if not r]
    scale = None
    if c.flag("attn_temperature_tuning") and nope:
        scale = dict(beta=c.number("attn_scale"), period=c.positive_int("floor_scale"), offset=1)
    return dict(**attention_biases(c, mlp=False), **rope_fields(c, kw["head_dim"]),
                intermediate_size=c.positive_int("intermediate_size_mlp"), max_position=_context(c, rotary, kw),
                nope_layers=nope or None, query_scale=scale, extra={"weightless_qk_norm": c.flag("use_qk_norm")},
                **_moe(c, n))


# Llama4ForCausalLM's names: a layer's MLP is feed_forward (dense: gate, up and down; sparse: router,
# experts stacked [E, H, 2I] and [E, I, H], shared_expert).
def dense_as_mlp(sd: dict) -> None:
    """The dense layers' feed_forward.{gate,up,down}_proj under the mlp. names the fusion reads."""
    for name in [n for n in sd if ".feed_forward." in n and n.split(".feed_forward.")[1].split(".")[0]
                 in ("gate_proj", "up_proj", "down_proj")]:
        sd[name.replace(".feed_forward.", ".mlp.")] = sd.pop(name)


def _stacked(sd, m: str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> the experts' ([E, 2I, H] rows [gate | up], [E, H, I]): from Hugging Face's [E, H, 2I] and
    [E, I, H], or from a GGUF's (gguf_tensor) gate, up [E, I, H] and down [E, H, I]."""
    if m + "experts.gate_up_proj" in sd:
        return sd[m + "experts.gate_up_proj"].transpose(1, 2).contiguous(), \
            sd[m + "experts.down_proj"].transpose(1, 2).contiguous()
    return torch.cat([sd[m + "experts.gate_proj.weight"], sd[m + "experts.up_proj.weight"]], dim=1), \
        sd[m + "experts.down_proj.weight"]


def experts(sd, cfg: ModelConfig, layer: str, path) -> dict[str, torch.Tensor]:
    m = layer + "feed_forward."
    try:
        (gate_up, down), router = _stacked(sd, m), sd[m + "router.weight"]
    except KeyError as e:
        raise ModelLoadError(path, f"missing tensor {e.args[0]}") from None
    if FP8 in (gate_up.dtype, down.dtype):
        raise ModelLoadError(path, f"tensor {m}experts.gate_up_proj: stacked FP8 experts, whose scales ridge does not know")
    out = {"router.weight": router, "experts.gate_up_proj.weight": gate_up, "experts.down_proj.weight": down}
    s = m + "shared_expert."
    for name, parts in (("gate_up_proj", ["gate_proj", "up_proj"]), ("down_proj", ["down_proj"])):
        try:
            ws = [sd[s + p + ".weight"] for p in parts]
        except KeyError as e:
            raise ModelLoadError(path, f"missing tensor {e.args[0]}") from None
        if ws[0].dtype == FP8:
            raise ModelLoadError(path, f"tensor {s}{parts[0]}.weight: an FP8 shared expert, which ridge does not read")
        out[f"shared_experts.{name}.weight"] = torch.cat(ws)
    return out


# -- Llama4ForConditionalGeneration (transformers 5.25's Llama4Config) served as text.
WRAPPER_DEFAULTS = dict(tie_word_embeddings=False, boi_token_index=200080, eoi_token_index=200081,
                        image_token_index=200092)
# Images only, and the wrapper's tie flag, which its Llama4ForCausalLM does not read.
WRAPPER_IGNORED = frozenset({"vision_config", "boi_token_index", "eoi_token_index", "image_token_index",
                             "tie_word_embeddings"})


def text_config(c: HFConfig) -> HFConfig:
    # Llama4Config builds a default Llama4TextConfig; its Llama4ForCausalLM ties by its own flag.
    return nested_text_config(c, "llama4_text", DEFAULTS, "Llama 4", tie=False)


text_name = wrapper_names((("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                           ("model.language_model.", "model."), ("lm_head.", "lm_head.")),
                          ("vision_model.", "multi_modal_projector.", "model.vision_model.",
                           "model.multi_modal_projector."),
                          "vision model's or projector", "Llama4ForConditionalGeneration")


LLAMA_CPP_CHUNK = 8192  # llama.cpp's hparams for llama4: its chunk, temperature period and scale
LLAMA_CPP_TEMPERATURE = dict(beta=0.1, period=8192, offset=1)


def read_llama4_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    refuse_yarn_attn_factor("llama4", a, kw, path)
    n, step = kw["num_layers"], a("interleave_moe_layer_step")
    moe = expert_fields(a, kw, names, path)
    if not isinstance(step, int) or step < 1 or (moe["moe_layers"] or list(range(n))) != \
            [i for i in range(n) if (i + 1) % step == 0]:
        raise ModelLoadError(path, f"llama4.interleave_moe_layer_step={step!r}: the routers are on layers "
                                   f"{moe['moe_layers'] or list(range(n))}")
    nope = [i for i in range(n) if (i + 1) % 4 == 0]
    return dict(moe, moe_router="topk_sigmoid", norm_topk_prob=False,
                shared_expert_intermediate_size=moe["moe_intermediate_size"],
                max_position=min(kw["max_position"], LLAMA_CPP_CHUNK), nope_layers=nope or None,
                query_scale=dict(LLAMA_CPP_TEMPERATURE) if nope else None,
                extra={"weightless_qk_norm": moe["num_experts"] != 128})


def gguf_tensor(idx: str, rest: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Stacked experts [E, I, H] / [E, H, I] and the router under the names experts() reads."""
    m = f"model.layers.{idx}.feed_forward."
    if rest == "ffn_gate_inp.weight":
        return {m + "router.weight": w}
    for kind in ("gate", "up", "down"):
        if rest == f"ffn_{kind}_exps.weight":
            return {f"{m}experts.{kind}_proj.weight": w}
    return None


SPEC = ModelSpec(
    "llama4_text", Llama4CausalLM,
    HFFamily(DEFAULTS, read_llama4_text, MOE_IGNORED | {"router_jitter_noise"}, tensors=dense_as_mlp),
    GGUFFamily("llama4", read=read_llama4_gguf, tensor=gguf_tensor,
               keys=EXPERT_KEYS | {"expert_feed_forward_length", "interleave_moe_layer_step", "rope.scaling.attn_factor"},
               names={f"ffn_{p}_shexp.weight": f"feed_forward.shared_expert.{p}_proj.weight"
                      for p in ("gate", "up", "down")}),
    WeightLayout(experts=experts),
    hf_wrappers=(HFWrapper("llama4", WRAPPER_DEFAULTS, text_config, text_name, "vision model and projector"),),
)
