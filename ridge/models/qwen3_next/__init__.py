"""Qwen3-Next (Qwen3NextConfig; model.py for the math): Qwen3.5's hybrid of Gated DeltaNet and gated
full-attention layers (ridge/models/qwen3_5/, read as there: layer_types or full_attention_interval,
the linear layers' shape, partial rotary, hidden_act also the convolution's and so SiLU only), with
a mixture of experts in the sparse layers: a layer is sparse unless it is in mlp_only_layers or
(index + 1) is not a multiple of decoder_sparse_step (as Qwen3-MoE's), and with num_experts 0 none
is. A sparse layer routes each token to num_experts_per_tok of num_experts experts of
moe_intermediate_size (softmax, top k, renormalised where norm_topk_prob) and runs a shared expert
of shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate . h); the others run the
dense MLP of intermediate_size.

Tensors as Qwen3.5's (every RMSNorm but the linear layers' gated norm multiplies by 1 + w, stored
shifted at load; q_proj's rows [q | gate] per head), except that the linear layers ship
in_proj_qkvz and in_proj_ba with their rows grouped by key head ([q | k | v | z] of each key head,
its value heads' v and z together; [b | a] likewise), regrouped at load into Qwen3.5's
in_proj_qkv, in_proj_z, in_proj_b and in_proj_a. The experts as Qwen3-MoE's (one tensor per expert
or stacked), the shared expert's gate, up and down fused as a dense MLP's, its gate row kept as
the router's. The multi-token-prediction layers (mtp.) are not loaded, as transformers does not."""
from __future__ import annotations

import torch

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import FP8, WeightLayout, cat_rows, stacked_experts
from ridge.quant.hf_config import MOE_IGNORED, HFConfig, HFFamily, experts_count, moe_fields
from ridge.quant.spec import ModelSpec

from .. import qwen3_5
from ..qwen3_5 import gguf
from ..qwen3_moe import _sparse_layers
from .model import Qwen3NextCausalLM

__all__ = ["SPEC", "Qwen3NextCausalLM"]

DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                num_attention_heads=16, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=None, attention_bias=False,
                head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512, norm_topk_prob=True,
                mlp_only_layers=None, layer_types=None, full_attention_interval=4, partial_rotary_factor=0.25,
                rope_theta=10000.0)
EXPERTS = ("mlp.", "gate", "gate_proj", "up_proj", "down_proj")  # under model.layers.{i}.


def shared_expert(c: HFConfig, base: dict) -> dict:
    """The sparse layers' shared expert, its output gated per token (SharedExperts), over base's fields
    (read_qwen3_5's: their extra kept)."""
    width = c.positive_int("shared_expert_intermediate_size")
    if width is None:
        c.refuse("shared_expert_intermediate_size", None, "every sparse layer runs a shared expert of this width")
    return dict(base, shared_expert_intermediate_size=width, extra={**base.get("extra", {}), "shared_expert_gate": True})


def experts_width(c: HFConfig) -> int:
    width = c.positive_int("moe_intermediate_size")
    if width is None:
        c.refuse("moe_intermediate_size", None, "the experts' width")
    return width


def read_qwen3_next(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    experts_n, k = experts_count(c, "num_experts")
    layers = _sparse_layers(c, n, experts_n)
    if not layers:  # every layer dense: the model transformers builds reads no expert field
        return qwen3_5.read_qwen3_5(c, kw)
    moe = moe_fields(experts_n, k, experts_width(c), layers, n, c.flag("norm_topk_prob"))
    return dict(shared_expert(c, qwen3_5.read_qwen3_5(c, kw)), **moe)


def _regrouped(sd, la: str, cfg: ModelConfig, path) -> dict[str, torch.Tensor]:
    """in_proj_qkvz's and in_proj_ba's rows, grouped by key head, -> Qwen3.5's four projections
    (in_proj_qkv: every q row, then every k, then every v; value head g * Hv/Hk + j is key head g's
    j-th), each with its scales."""
    sh = cfg.linear_attention
    hk, dk, dv = sh["num_key_heads"], sh["key_head_dim"], sh["value_head_dim"]
    r = sh["num_value_heads"] // hk
    qkvz = torch.arange(hk * (2 * dk + 2 * r * dv)).view(hk, -1).split([dk, dk, r * dv, r * dv], dim=1)
    ba = torch.arange(hk * 2 * r).view(hk, -1).split([r, r], dim=1)
    out = {}
    for src, parts in (("in_proj_qkvz", {"in_proj_qkv": qkvz[:3], "in_proj_z": qkvz[3:]}),
                       ("in_proj_ba", {"in_proj_b": ba[:1], "in_proj_a": ba[1:]})):
        if la + src + ".bias" in sd:
            raise ModelLoadError(path, f"tensor {la}{src}.bias: Qwen3-Next's projections have no bias")
        rows = sum(p.numel() for ps in parts.values() for p in ps)
        for suffix in (".weight", ".weight_scale"):
            t = sd.get(la + src + suffix)
            if t is None:
                if suffix == ".weight":
                    raise ModelLoadError(path, f"missing tensor {la}{src}.weight")
                continue
            for dst, ps in parts.items():
                if suffix == ".weight_scale" and t.numel() == 1:  # one scale for the tensor: every part takes it
                    out[la + dst + suffix] = t
                elif t.shape[0] != rows:
                    raise ModelLoadError(path, f"tensor {la}{src}{suffix}: {tuple(t.shape)}, the config makes it "
                                               f"{rows} rows")
                else:
                    out[la + dst + suffix] = t[torch.cat([p.reshape(-1) for p in ps])]
    return out


def fuse_mixer(sd, cfg: ModelConfig, i: int, out: dict, path) -> None:
    """Layer i's token mixer as Qwen3.5's, from Qwen3-Next's grouped projections."""
    if cfg.is_linear_layer(i):
        sd = {**sd, **_regrouped(sd, f"model.layers.{i}.linear_attn.", cfg, path)}
    qwen3_5.fuse_mixer(sd, cfg, i, out, path)


_routed = stacked_experts(EXPERTS)


def experts(sd, cfg: ModelConfig, layer: str, path) -> dict[str, torch.Tensor]:
    """A sparse layer's router and experts (as Qwen3-MoE's), its shared expert's fused gate_up and
    down, and the shared expert's gate row."""
    out = _routed(sd, cfg, layer, path)
    s = layer + "mlp.shared_expert"
    cat_rows(sd, [s + ".gate_proj", s + ".up_proj"], out, "shared_experts.gate_up_proj", path)
    cat_rows(sd, [s + ".down_proj"], out, "shared_experts.down_proj", path)
    gate = sd.get(s + "_gate.weight")
    if gate is None:
        raise ModelLoadError(path, f"missing tensor {s}_gate.weight")
    if gate.dtype == FP8 or tuple(gate.shape) != (1, cfg.hidden_size):
        raise ModelLoadError(path, f"tensor {s}_gate.weight: {gate.dtype} {tuple(gate.shape)}, expected one "
                                   f"unquantized row of {cfg.hidden_size}")
    if s + "_gate.bias" in sd:
        raise ModelLoadError(path, f"tensor {s}_gate.bias: the shared expert's gate has no bias")
    out["shared_experts.gate.weight"] = gate
    return out


SPEC = ModelSpec("qwen3_next", Qwen3NextCausalLM,
                 HFFamily(DEFAULTS, read_qwen3_next, MOE_IGNORED, tensors=qwen3_5.shift_norms),
                 gguf=gguf.family("qwen3next", moe=True),  # GGUF as llama.cpp writes it: qwen3_5/gguf.py
                 weights=WeightLayout(experts=experts, attention=gguf.mixer(qwen3_5.fuse_mixer, fuse_mixer)))
