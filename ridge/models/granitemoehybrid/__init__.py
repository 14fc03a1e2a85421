"""Granite 4 hybrid (GraniteMoeHybridConfig; model.py for the math): Mamba2 layers, whose
per-request state lives in the slot pool beside the paged KV (cache/state_cache.py), and
attention layers, in the pattern layer_types gives (its old name layers_block_type, and the old
values mamba and attention, read as transformers remaps them).

Read from config.json: Granite's multipliers (embedding_multiplier, residual_multiplier,
attention_multiplier as the softmax scale, logits_scaling dividing the logits); attention_bias
(q, k, v and o); position_embedding_type (rope, or nope or null: every attention layer NoPE); the
experts (num_local_experts, num_experts_per_tok, intermediate_size wide; 0 experts: the shared
MLP alone) and the shared MLP (shared_intermediate_size); the Mamba2 shape (mamba_n_heads,
mamba_d_head or "auto": mamba_expand * hidden_size / mamba_n_heads, mamba_n_groups,
mamba_d_state, mamba_d_conv), mamba_conv_bias, mamba_proj_bias (in_proj and out_proj) and
time_step_limit (dt's clamp). mamba_chunk_size only orders the scan's arithmetic and is not read.
hidden_act is also the convolution's activation, which ridge's kernels run as SiLU only.
Refused by name: a layer type but those, a model without an attention layer, Mamba2 shapes
transformers would not build, a time_step_limit that is not two ordered numbers.

Tensors: block_sparse_moe.input_linear [E, 2I, H] (rows [gate | up] per expert, ridge's
layout), output_linear [E, H, I] and router.layer (or transformers 5's stacked names);
shared_mlp.input_linear's rows [gate | up] and output_linear; mamba.* the mixer's
(layers/mamba2.py fuse_mamba2). FP8 covers in_proj and out_proj like every projection; the
convolution's taps, A_log, D, dt_bias and the gated norm stay fp32."""
from __future__ import annotations

import math

import torch

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import FP8, WeightLayout, cat_rows
from ridge.quant.hf_config import MOE_IGNORED, HFConfig, HFFamily, experts_count, moe_fields, rope_fields
from ridge.quant.spec import ModelSpec

from ..layers.mamba2 import dt_limit, fuse_mamba2, mamba2_shape
from . import gguf
from .model import GraniteHybridCausalLM

__all__ = ["SPEC", "GraniteHybridCausalLM"]

DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=None, attention_bias=False,
                embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0, attention_multiplier=1.0,
                num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=1024,
                position_embedding_type=None, layer_types=None, mamba_n_heads=128, mamba_n_groups=1,
                mamba_d_state=256, mamba_d_head="auto", mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
                mamba_conv_bias=True, mamba_proj_bias=False, time_step_limit=(0.0, math.inf))
IGNORED = MOE_IGNORED | {"mamba_chunk_size"}  # the scan's order only
LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' remap of old configs
LAYER_TYPES = ("linear_attention", "full_attention")


def _layer_types(c: HFConfig, n: int) -> list[str]:
    key = "layer_types" if "layer_types" in c or "layers_block_type" not in c else "layers_block_type"
    types = c.get(key)
    if types is None:  # GraniteMoeHybridConfig: every layer Mamba2
        types = ["linear_attention"] * n
    if not isinstance(types, list) or len(types) != n or any(LEGACY_TYPES.get(t, t) not in LAYER_TYPES for t in types):
        c.refuse(key, types, f"expected {n} of {', '.join(LAYER_TYPES)} (or mamba, attention)")
    types = [LEGACY_TYPES.get(t, t) for t in types]
    if "full_attention" not in types:
        c.refuse(key, types, "ridge needs at least one full_attention layer (its KV sizes the pool)")
    return types


def read_granitemoehybrid(c: HFConfig, kw: dict) -> dict:
    if kw["hidden_act"] != "silu":  # the convolution's activation too: ridge's kernels run SiLU
        c.refuse("hidden_act", c.get("hidden_act"), "Granite 4's convolution runs it; ridge runs silu there")
    n = kw["num_layers"]
    types = _layer_types(c, n)
    pos = c.get("position_embedding_type")
    if pos not in (None, "nope", "rope"):  # transformers rotates for rope alone; Granite 4's files write nope
        c.refuse("position_embedding_type", pos, "expected rope, or nope or null (no positions)")
    expand = c.positive_int("mamba_expand")
    if expand is None:
        c.refuse("mamba_expand", None, "the Mamba2 layers' width is mamba_expand * hidden_size")
    la = mamba2_shape(c, "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
                      "mamba_d_conv", expand * kw["hidden_size"])
    la.update(conv_bias=c.flag("mamba_conv_bias"), proj_bias=c.flag("mamba_proj_bias"),
              dt_limit=dt_limit(c, "time_step_limit"))
    shared = c.positive_int("shared_intermediate_size")
    if shared is None:
        c.refuse("shared_intermediate_size", None, "every layer runs the shared MLP")
    experts, k = experts_count(c, "num_local_experts")
    moe = moe_fields(experts, k, kw["intermediate_size"], list(range(n)), n, False) if experts else {}
    if moe:
        moe.update(moe_router="topk_softmax", shared_expert_intermediate_size=shared)
    scaling = c.number("logits_scaling")
    if scaling == 0:
        c.refuse("logits_scaling", scaling, "the logits are divided by it")
    bias = c.flag("attention_bias")
    return dict(intermediate_size=shared, attention_bias=bias, o_bias=bias, mlp_bias=False,
                **rope_fields(c, kw["head_dim"]), nope_layers=None if pos == "rope" else list(range(n)),
                embedding_multiplier=c.number("embedding_multiplier"),
                residual_multiplier=c.number("residual_multiplier"),
                softmax_scale=c.number("attention_multiplier"), logits_scaling=scaling,
                linear_layers=[i for i, t in enumerate(types) if t == "linear_attention"] or None,
                linear_attention=la, **moe)


def split_shared_mlp(sd: dict[str, torch.Tensor]) -> None:
    """shared_mlp.input_linear's rows [gate | up] -> mlp.gate_proj and mlp.up_proj (each with its
    rows' FP8 scales; a scale for the whole tensor serves both), output_linear -> mlp.down_proj:
    the names a dense MLP's fusion reads."""
    for name in [n for n in sd if ".shared_mlp." in n]:
        head, _, tail = name.partition(".shared_mlp.")
        t = sd.pop(name)
        if tail.startswith("output_linear."):
            sd[f"{head}.mlp.down_proj.{tail[len('output_linear.'):]}"] = t
        elif tail.startswith("input_linear.") and (t.dim() and t.numel() > 1):
            gate, up = t.chunk(2, dim=0)
            sd[f"{head}.mlp.gate_proj.{tail[len('input_linear.'):]}"] = gate
            sd[f"{head}.mlp.up_proj.{tail[len('input_linear.'):]}"] = up
        elif tail.startswith("input_linear."):
            for part in ("gate_proj", "up_proj"):
                sd[f"{head}.mlp.{part}.{tail[len('input_linear.'):]}"] = t
        else:
            sd[name] = t


def fuse_mixer(sd, cfg: ModelConfig, i: int, out: dict, path) -> None:
    """Layer i's token mixer: Mamba2's tensors, or the attention's projections."""
    p, q = f"model.layers.{i}.", f"layers.{i}."
    if cfg.is_linear_layer(i):
        fuse_mamba2(sd, cfg, p + "mamba.", q + "mixer.", out, path)
        return
    a = p + "self_attn."
    cat_rows(sd, [a + "q_proj", a + "k_proj", a + "v_proj"], out, q + "qkv_proj", path, cfg.attention_bias)
    cat_rows(sd, [a + "o_proj"], out, q + "o_proj", path, cfg.o_bias)


# block_sparse_moe's names: (router, gate_up [E, 2I, H], down [E, H, I]) as checkpoints ship them,
# and as transformers 5 names them in memory.
EXPERT_NAMES = (("router.layer", "input_linear.weight", "output_linear.weight"),
                ("router", "experts.gate_up_proj", "experts.down_proj"))


def experts(sd, cfg: ModelConfig, layer: str, path) -> dict[str, torch.Tensor]:
    """A layer's router, stacked experts and shared MLP (split_shared_mlp's names)."""
    m = layer + "block_sparse_moe."
    names = next((n for n in EXPERT_NAMES if m + n[0] + ".weight" in sd), None)
    if names is None:
        raise ModelLoadError(path, f"missing tensor {m}router.layer.weight (layer {layer.split('.')[2]}'s router)")
    router, gate_up, down = names
    if m + router + ".bias" in sd:
        raise ModelLoadError(path, f"tensor {m}{router}.bias: Granite 4's router has no bias")
    out = {"router.weight": sd[m + router + ".weight"]}
    for src, dst in ((gate_up, "gate_up_proj"), (down, "down_proj")):
        t = sd.get(m + src)
        if t is None:
            raise ModelLoadError(path, f"missing tensor {m}{src}")
        if t.dtype == FP8:
            raise ModelLoadError(path, f"tensor {m}{src}: stacked FP8 experts, whose scales ridge does not know")
        out[f"experts.{dst}.weight"] = t
    shared: dict[str, torch.Tensor] = {}
    cat_rows(sd, [layer + "mlp.gate_proj", layer + "mlp.up_proj"], shared, "shared_experts.gate_up_proj", path)
    cat_rows(sd, [layer + "mlp.down_proj"], shared, "shared_experts.down_proj", path)
    return {**out, **shared}


SPEC = ModelSpec("granitemoehybrid", GraniteHybridCausalLM,
                 HFFamily(DEFAULTS, read_granitemoehybrid, ignored=IGNORED, tensors=split_shared_mlp),
                 gguf=gguf.FAMILY,  # GGUF as llama.cpp writes it: gguf.py
                 weights=WeightLayout(attention=fuse_mixer, experts=gguf.experts(experts)))
