"""Hugging Face names -> the model's fused layout (qkv_proj, gate_up_proj).

Fusing turns seven matrix products per layer into four; a mixture of experts' layer stacks its
experts (fuse_experts). FP8 weights fuse too:
their scales are per output channel, so they concatenate along with the rows
(a per-tensor scale is first broadcast to its rows). What differs between families (which
norms a layer has, checkpoints shipped fused, how experts are shipped) is their WeightLayout."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ridge.config import ModelConfig

from .errors import ModelLoadError

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class WeightLayout:
    """A family's tensors under model.layers.{i}. (Hugging Face names). norms: each layer's;
    fused_as_shipped: the checkpoints ship qkv_proj and gate_up_proj fused, in the model's
    layout; experts(sd, cfg, layer, path): a sparse layer's tensors under `layer` -> the model's
    stacked experts and router (names under experts. and router.; stacked_experts for the
    layouts checkpoints share), None for a family without experts."""
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    fused_as_shipped: bool = False
    experts: Callable | None = None
    # attention(sd, cfg, i, out, path): a family's own token mixer of layer i into out, in place of
    # the q/k/v/o projections and QK-norm read below (a hybrid's linear-attention layers); None: those.
    attention: Callable | None = None
    # global_tensors(sd, out, path): a family's tensors outside the layers beyond the embedding,
    # final norm and head (Gemma 4's per-layer input embeddings); layer_tensors(sd, cfg, i, out,
    # path): its further tensors of layer i. None: none.
    global_tensors: Callable | None = None
    layer_tensors: Callable | None = None
    # mlp(sd, cfg, i, out, path): a family's own MLP of layer i into out (an MLP without a gate, a
    # layer without an MLP), in place of the gated MLP or experts read below; None: those.
    mlp: Callable | None = None


def _row_scale(sd, prefix: str, rows: int) -> torch.Tensor | None:
    s = sd.get(prefix + ".weight_scale")
    if s is None:
        return None
    s = s.float().reshape(-1)
    return s.expand(rows).clone() if s.numel() == 1 else s


def cat_rows(sd, prefixes: list[str], out: dict, name: str, path, bias: bool = False) -> None:
    """bias: the config declares biases on these projections; a checkpoint that disagrees with
    its config is refused rather than run one way or the other."""
    try:
        ws = [sd[p + ".weight"] for p in prefixes]
    except KeyError as e:
        raise ModelLoadError(path, f"missing tensor {e.args[0]}") from None
    out[name + ".weight"] = torch.cat(ws, dim=0)
    if ws[0].dtype == FP8:
        out[name + ".weight_scale"] = torch.cat([_row_scale(sd, p, w.shape[0]) for p, w in zip(prefixes, ws)])
    for p in prefixes:
        if (p + ".bias" in sd) != bias:
            raise ModelLoadError(path, f"missing tensor {p}.bias, which the config declares" if bias else
                                 f"tensor {p}.bias, which the config does not declare (its bias flags are false)")
    if bias:
        out[name + ".bias"] = torch.cat([sd[p + ".bias"] for p in prefixes], dim=0)


def fuse_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, path, layout: WeightLayout
                       ) -> dict[str, torch.Tensor]:
    sd = with_model_prefix(sd)
    out = fuse_globals(sd, cfg, path, layout)
    for i in range(cfg.num_layers):
        fuse_layer(sd, cfg, i, out, path, layout)
    return out


def with_model_prefix(sd):
    """A base model's checkpoint (transformers' Qwen3Model, as embedding models ship) names its
    tensors without the "model." prefix; without lm_head it needs tied embeddings, as below."""
    if "model.embed_tokens.weight" not in sd and "embed_tokens.weight" in sd:
        return {k if k.startswith("lm_head.") else "model." + k: v for k, v in sd.items()}
    return sd


def fuse_globals(sd, cfg: ModelConfig, path="model", layout: WeightLayout | None = None) -> dict[str, torch.Tensor]:
    """The tensors outside the decoder layers: the embedding, the final norm, an untied head, and
    what the family's layout.globals takes."""
    out: dict[str, torch.Tensor] = {}
    for src, dst in (("model.embed_tokens.weight", "embed_tokens.weight"), ("model.norm.weight", "norm.weight")):
        if src not in sd:
            raise ModelLoadError(path, f"missing tensor {src}")
        out[dst] = sd[src]
    if not cfg.tie_word_embeddings:  # tied: the model reuses the embedding table
        cat_rows(sd, ["lm_head"], out, "lm_head", path)
    if layout is not None and layout.global_tensors is not None:
        layout.global_tensors(sd, out, path)
    return out


def fuse_layer(sd, cfg: ModelConfig, i: int, out: dict, path, layout: WeightLayout) -> dict[str, torch.Tensor]:
    """Layer i's tensors (HF names; sd needs hold no other layer's) -> its fused ones, into out."""
    def take(src: str, dst: str):
        if src not in sd:
            raise ModelLoadError(path, f"missing tensor {src}")
        out[dst] = sd[src]

    p, q = f"model.layers.{i}.", f"layers.{i}."
    for norm in layout.norms:
        take(p + norm + ".weight", q + norm + ".weight")
    a, m = p + "self_attn.", p + "mlp."
    shipped = layout.fused_as_shipped  # rows [q | k | v] and [gate | up], as ours
    if layout.attention is not None:
        layout.attention(sd, cfg, i, out, path)
    else:
        cat_rows(sd, [a + "qkv_proj"] if shipped else [a + "q_proj", a + "k_proj", a + "v_proj"], out, q + "qkv_proj",
             path, cfg.attention_bias)
        cat_rows(sd, [a + "o_proj"], out, q + "o_proj", path, cfg.o_bias)
    if layout.mlp is not None:
        layout.mlp(sd, cfg, i, out, path)
    elif cfg.is_moe_layer(i):
        fuse_experts(sd, cfg, i, out, path, layout)
    else:
        cat_rows(sd, [m + "gate_up_proj"] if shipped else [m + "gate_proj", m + "up_proj"], out, q + "gate_up_proj",
             path, cfg.mlp_bias)
        cat_rows(sd, [m + "down_proj"], out, q + "down_proj", path, cfg.mlp_bias)
    if cfg.qk_norm and layout.attention is None:
        take(a + "q_norm.weight", q + "q_norm.weight")
        take(a + "k_norm.weight", q + "k_norm.weight")
    if cfg.attention_sinks:
        take(a + "sinks", q + "sinks")
    if layout.layer_tensors is not None:
        layout.layer_tensors(sd, cfg, i, out, path)
    return out


# -- mixtures of experts: a sparse layer's tensors -> the model's stacked experts and router.
# Checkpoints ship experts one tensor per expert and projection (mlp.experts.{e}.gate_proj /
# up_proj / down_proj, or w1 / w3 / w2 under another block name), or, saved by transformers 5
# without its conversion reversed, already stacked (mlp.experts.gate_up_proj [E, 2I, H],
# mlp.experts.down_proj [E, H, I]). Either way the model gets, per layer:
# experts.gate_up_proj.weight [E, 2I, H] (rows [gate | up] per expert),
# experts.down_proj.weight [E, H, I], and router.weight [E, H] (its source dtype: the router runs
# in fp32); from an FP8 checkpoint each weight's _scale [E, rows]. A family that ships its own
# stacked layout (with biases, say) gives its own WeightLayout.experts.
# A family's names under model.layers.{i}.: (the MoE block, router, per-expert gate, up, down),
# one tuple per naming its checkpoints use.
ExpertNames = tuple[str, str, str, str, str]


def _stack(sd, names: list[list[str]], path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """names[e]: expert e's weights, concatenated along their rows; -> ([E, rows, in], scales)."""
    try:
        per_expert = [[sd[n] for n in ns] for ns in names]
    except KeyError as e:
        raise ModelLoadError(path, f"missing tensor {e.args[0]}") from None
    w = torch.stack([torch.cat(ws, dim=0) for ws in per_expert])
    if w.dtype != FP8:
        return w, None
    scales = [torch.cat([_row_scale(sd, n.removesuffix(".weight"), t.shape[0]) for n, t in zip(ns, ws)])
              for ns, ws in zip(names, per_expert)]
    return w, torch.stack(scales)


def _prefix(sd, namings: tuple[ExpertNames, ...], layer: str, path) -> ExpertNames:
    for names in namings:
        if layer + names[0] + names[1] + ".weight" in sd:
            return names
    block, gate = namings[0][:2]
    raise ModelLoadError(path, f"missing tensor {layer}{block}{gate}.weight (layer {layer.split('.')[2]}'s router)")


def fuse_experts(sd: dict[str, torch.Tensor], cfg: ModelConfig, i: int, out: dict, path, layout: WeightLayout) -> None:
    """Layer i's experts and router into out (the model's names)."""
    layer, q = f"model.layers.{i}.", f"layers.{i}."
    if layout.experts is None:
        raise ModelLoadError(path, f"layer {i} is a mixture of experts, which {cfg.arch} does not have")
    tensors = layout.experts(sd, cfg, layer, path)
    E, inter, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    want = {"experts.gate_up_proj.weight": (E, 2 * inter, H), "experts.down_proj.weight": (E, H, inter),
            "router.weight": (E, H), "experts.gate_up_proj.bias": (E, 2 * inter), "experts.down_proj.bias": (E, H),
            "router.bias": (E,)}
    for name, t in tensors.items():
        if name in want and tuple(t.shape) != want[name]:
            raise ModelLoadError(path, f"layer {i}'s {name} is {tuple(t.shape)}; the config makes it {want[name]}")
        out[q + name] = t


def stacked_experts(*namings: ExpertNames) -> Callable:
    """WeightLayout.experts for checkpoints that ship one tensor per expert and projection under
    one of `namings` (or, from transformers 5, stacked), and a router without a bias."""
    return partial(_stacked_experts, namings)


def _stacked_experts(namings, sd, cfg: ModelConfig, layer: str, path) -> dict[str, torch.Tensor]:
    block, gate, g, u, d = _prefix(sd, namings, layer, path)
    m = layer + block
    if m + gate + ".bias" in sd:
        raise ModelLoadError(path, f"tensor {m}{gate}.bias: {cfg.arch}'s router has no bias")
    stacked = m + "experts.gate_up_proj"
    out = {"router.weight": sd[m + gate + ".weight"]}
    if stacked in sd:  # transformers 5's own layout
        gate_up, down = sd[stacked], sd.get(m + "experts.down_proj")
        if down is None:
            raise ModelLoadError(path, f"missing tensor {m}experts.down_proj")
        if FP8 in (gate_up.dtype, down.dtype):
            raise ModelLoadError(path, f"tensor {stacked}: stacked FP8 experts, whose scales ridge does not know")
        return {**out, "experts.gate_up_proj.weight": gate_up, "experts.down_proj.weight": down}
    E = cfg.num_experts
    if f"{m}experts.{E}.{g}.weight" in sd:
        raise ModelLoadError(path, f"tensor {m}experts.{E}.{g}.weight: more experts than num_experts={E}")
    e_ = [f"{m}experts.{e}." for e in range(E)]
    for name, names in (("gate_up_proj", [[p + g + ".weight", p + u + ".weight"] for p in e_]),
                        ("down_proj", [[p + d + ".weight"] for p in e_])):
        w, s = _stack(sd, names, path)
        out[f"experts.{name}.weight"] = w
        if s is not None:
            out[f"experts.{name}.weight_scale"] = s
    return out
