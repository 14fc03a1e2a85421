"""Granite 4 hybrid from GGUF, as llama.cpp's converter writes it (convert_hf_to_gguf.py
GraniteHybridModel over GraniteMoeModel, LlamaModel and Mamba2Model; architecture granitehybrid).

Metadata: attention.head_count_kv one count a layer, 0 on the Mamba2 layers; ssm.inner_size the
Mamba2 width (mamba_expand * hidden_size), ssm.time_step_rank its heads (mamba_n_heads), ssm.group_count,
ssm.state_size, ssm.conv_kernel; Granite's multipliers as attention.scale (the softmax scale),
embedding_scale, residual_scale and logit_scale (dividing the logits), each absent where it is
falsy; rope.scaling.finetuned whether the attention layers rotate (the converter writes false for
every hybrid whatever position_embedding_type says: llama.cpp runs them NoPE); expert_count (0: the
shared MLP alone, as the dense ffn_*), expert_used_count, feed_forward_length the experts' width,
expert_shared_feed_forward_length the shared MLP's. The file carries no time_step_limit: dt is not
clamped (transformers' default).

Tensors, undone on reading: q and k rows permuted for llama.cpp's NORM rope (LlamaModel's
permute, applied even where no layer rotates); ssm_a holds -exp(A_log), shaped [H, 1] as ssm_d;
ssm_conv1d squeezed to [channels, taps]; ssm_norm [groups, width / groups]; the experts' fused
input_linear split into ffn_gate_exps and ffn_up_exps, the shared MLP's into ffn_gate_shexp and
ffn_up_shexp (ffn_gate and ffn_up without experts)."""
from __future__ import annotations

import math

import torch

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_config import GGUFFamily
from ridge.quant.hf_config import moe_fields

ARCH = "granitehybrid"
KEYS = frozenset({"ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
                  "attention.scale", "embedding_scale", "residual_scale", "logit_scale", "rope.scaling.finetuned",
                  "expert_count", "expert_used_count", "expert_shared_feed_forward_length"})
EXPERTS = "block_sparse_moe.gguf."  # the split gate and up experts, until experts() stacks them again
NAMES = {"attn_output.bias": "self_attn.o_proj.bias",
         "ffn_gate_shexp.weight": "mlp.gate_proj.weight", "ffn_up_shexp.weight": "mlp.up_proj.weight",
         "ffn_down_shexp.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
         "ffn_gate_exps.weight": EXPERTS + "gate", "ffn_up_exps.weight": EXPERTS + "up",
         "ffn_down_exps.weight": "block_sparse_moe.output_linear.weight",
         "ssm_in.weight": "mamba.in_proj.weight", "ssm_in.bias": "mamba.in_proj.bias",
         "ssm_conv1d.weight": "mamba.conv1d.weight", "ssm_conv1d.bias": "mamba.conv1d.bias",
         "ssm_dt.bias": "mamba.dt_bias", "ssm_d": "mamba.D", "ssm_norm.weight": "mamba.norm.weight",
         "ssm_out.weight": "mamba.out_proj.weight", "ssm_out.bias": "mamba.out_proj.bias"}


def _positive(a, key: str, path, arch: str = ARCH) -> int:
    v = a(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ModelLoadError(path, f"{arch}.{key}={v!r}: expected a positive integer")
    return v


def _scale(a, key: str, default, path):
    v = a(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v == 0:
        raise ModelLoadError(path, f"{ARCH}.{key}={v!r}: expected a finite non-zero number")
    return float(v)


def per_layer(a, arch: str, key: str, n: int, path) -> list[int]:
    """A count written one a layer (0 where the layer has none of it)."""
    v = a(key)
    if not isinstance(v, list) or len(v) != n or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ModelLoadError(path, f"{arch}.{key}={v!r}: expected {n} counts, 0 where a layer has none")
    return v


def mamba2_fields(a, arch: str, linear: list[int], names: set[str], reader, path) -> dict:
    """The Mamba2 layers' shape from ssm.*, their biases as their tensors show (the file carries no
    dt clamp: none), A's sign checked."""
    if not linear:
        raise ModelLoadError(path, f"{arch}: no Mamba2 layer (every layer has KV heads or an MLP)")
    heads, inner, groups = (_positive(a, k, path, arch) for k in ("ssm.time_step_rank", "ssm.inner_size",
                                                                   "ssm.group_count"))
    state, taps = _positive(a, "ssm.state_size", path, arch), _positive(a, "ssm.conv_kernel", path, arch)
    if inner % heads or heads % groups:
        raise ModelLoadError(path, f"{arch}.ssm.inner_size={inner}, ssm.time_step_rank={heads}, ssm.group_count="
                                   f"{groups}: the heads must divide the width and the groups the heads")
    if taps < 2:
        raise ModelLoadError(path, f"{arch}.ssm.conv_kernel={taps}: ridge's convolution needs at least 2 taps")
    check_negative_a(reader, path)
    m = linear[0]
    return dict(linear_layers=linear, linear_attention=dict(
        kind="mamba2", num_heads=heads, head_dim=inner // heads, n_groups=groups, state_size=state,
        conv_kernel=taps, conv_bias=f"blk.{m}.ssm_conv1d.bias" in names, proj_bias=f"blk.{m}.ssm_in.bias" in names,
        dt_limit=[0.0, math.inf]))


def check_negative_a(reader, path) -> None:
    """ssm_a holds -exp(A_log): a value >= 0 has no A_log."""
    from ridge.quant.gguf_loader import _dequantize
    for t in reader.tensors:
        if t.name.endswith(".ssm_a") and not bool((_dequantize(t) < 0).all()):
            raise ModelLoadError(path, f"tensor {t.name}: values >= 0, where the converter writes -exp(A_log)")


def a_log(mixer: str):
    """GGUFFamily.tensor: ssm_a, -exp(A_log) [H, 1] -> the model's A_log [H] under
    model.layers.N.<mixer> (check_negative_a has checked its sign)."""
    def tensor(idx: str, rest: str, w: torch.Tensor):
        return {f"model.layers.{idx}.{mixer}A_log": torch.log(-w).reshape(-1)} if rest == "ssm_a" else None
    return tensor


def read_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    n = kw["num_layers"]
    linear = [i for i, h in enumerate(per_layer(a, ARCH, "attention.head_count_kv", n, path)) if not h]
    if len(linear) == n:
        raise ModelLoadError(path, f"{ARCH}.attention.head_count_kv: no attention layer, which ridge needs")
    out = mamba2_fields(a, ARCH, linear, names, reader, path)
    first = min(set(range(n)) - set(linear))
    rope = a("rope.scaling.finetuned", True)  # llama.cpp's default: rotate
    experts = a("expert_count", 0)
    shared = a("expert_shared_feed_forward_length")
    if experts:
        k = _positive(a, "expert_used_count", path)
        if not isinstance(experts, int) or k > experts or not isinstance(shared, int) or shared < 1:
            raise ModelLoadError(path, f"{ARCH}.expert_count={experts!r}, expert_used_count={k}, "
                                       f"expert_shared_feed_forward_length={shared!r}: expected k <= E experts "
                                       "beside a shared MLP")
        out.update(moe_fields(experts, k, kw["intermediate_size"], list(range(n)), n, False),
                   moe_router="topk_softmax", shared_expert_intermediate_size=shared, intermediate_size=shared)
    elif shared is not None:  # the shared MLP alone, written as the dense ffn_*
        out["intermediate_size"] = _positive(a, "expert_shared_feed_forward_length", path)
    bias = f"blk.{first}.attn_q.bias" in names
    return dict(out, attention_bias=bias, o_bias=bias, mlp_bias=False, nope_layers=None if rope else list(range(n)),
                embedding_multiplier=_scale(a, "embedding_scale", 1.0, path),
                residual_multiplier=_scale(a, "residual_scale", 1.0, path),
                softmax_scale=_scale(a, "attention.scale", None, path),
                logits_scaling=_scale(a, "logit_scale", 1.0, path))


FAMILY = GGUFFamily(ARCH, read=read_gguf, keys=KEYS, names=NAMES, tensor=a_log("mamba."), permuted_qk=True)


def experts(fuse):
    """WeightLayout.experts: a GGUF layer's split gate and up experts stacked again as
    input_linear [E, 2I, H] (rows [gate | up] per expert), then fused by `fuse`."""
    def layer_experts(sd, cfg: ModelConfig, layer: str, path):
        g = layer + EXPERTS
        if g + "gate" in sd:
            if g + "up" not in sd:
                raise ModelLoadError(path, f"missing tensor {g}up (the file's ffn_up_exps)")
            sd = {**sd, layer + "block_sparse_moe.input_linear.weight": torch.cat([sd[g + "gate"], sd[g + "up"]], 1)}
        return fuse(sd, cfg, layer, path)
    return layer_experts
