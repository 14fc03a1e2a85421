"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next from GGUF, as llama.cpp's converter writes them
(convert_hf_to_gguf.py Qwen3_5TextModel, Qwen3_5MoeTextModel, Qwen3NextModel; architectures
qwen35, qwen35moe, qwen3next).

Metadata: ssm.conv_kernel the taps, ssm.group_count the key heads, ssm.time_step_rank the value
heads, ssm.state_size the key head's width, ssm.inner_size all value heads' width (the value
head's width is inner_size / time_step_rank: llama.cpp itself assumes it equals state_size);
attention.recurrent_layers the linear layers, or without it every full_attention_interval-th
layer attends (4); rope.dimension_count the rotary dims; rope.dimension_sections mrope's sections,
read and left (a text token has one position in all of them, where mrope is the plain rotation);
nextn_predict_layers the multi-token-prediction blocks appended after the trunk, not run (as the
HF path leaves mtp.). The MoE files add llama.cpp's routing (expert_fields) and the shared expert
of expert_shared_feed_forward_length.

Tensors, undone on reading: every norm but the linear layers' gated one already holds 1 + w (the
multiplier the model takes); ssm_a holds -exp(A_log); ssm_conv1d is squeezed to [channels, taps].
Qwen3.5's linear layers (qwen35, qwen35moe) have their value heads reordered from grouped by key
head to tiled (value head j of key head g at j * Hk + g): the v rows of attn_qkv, the rows of
attn_gate, ssm_beta, ssm_alpha, ssm_dt and ssm_a, the v channels of ssm_conv1d and the columns of
ssm_out. Qwen3-Next's (qwen3next) keep them grouped: attn_qkv and attn_gate are in_proj_qkvz
split, and ssm_ba is in_proj_ba as it is, [b | a] per key head."""
from __future__ import annotations

import torch

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_config import EXPERT_KEYS, GGUFFamily, expert_fields
from ridge.quant.gguf_loader import split_experts

HYBRID_KEYS = frozenset({"ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank",
                         "ssm.inner_size", "attention.recurrent_layers", "full_attention_interval",
                         "rope.dimension_sections", "nextn_predict_layers"})
MOE_KEYS = EXPERT_KEYS | {"expert_feed_forward_length", "expert_shared_feed_forward_length"}

GGUF = "linear_attn.gguf."  # a linear layer's tensors as the file holds them, until fuse_mixer reads them
_LINEAR = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_ba.weight",
           "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_out.weight")
NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight", "attn_output.bias": "self_attn.o_proj.bias",
         "ssm_norm.weight": "linear_attn.norm.weight", **{n: GGUF + n for n in _LINEAR}}
MOE_NAMES = {"ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
             "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
             "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}


def _count(a, arch: str, key: str, path, default=None) -> int:
    v = a(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ModelLoadError(path, f"{arch}.{key}={v!r}: expected a positive integer")
    return v


def read_hybrid(arch: str, a, kw: dict, names: set[str], path) -> dict:
    """The trunk's layers (block_count less the MTP blocks), which of them are linear, their shape,
    the rotary dims, and the attention's biases as the first attention layer holds them."""
    def key(k):
        return f"{arch}.{k}"
    mtp = a("nextn_predict_layers", 0)
    if isinstance(mtp, bool) or not isinstance(mtp, int) or not 0 <= mtp < kw["num_layers"]:
        raise ModelLoadError(path, f"{key('nextn_predict_layers')}={mtp!r}: expected fewer than block_count")
    n = kw["num_layers"] - mtp
    shape = {k: _count(a, arch, s, path) for k, s in (
        ("conv_kernel", "ssm.conv_kernel"), ("key_head_dim", "ssm.state_size"), ("num_key_heads", "ssm.group_count"),
        ("num_value_heads", "ssm.time_step_rank"))}
    inner = a("ssm.inner_size")
    hk, hv = shape["num_key_heads"], shape["num_value_heads"]
    if hv % hk:
        raise ModelLoadError(path, f"{key('ssm.time_step_rank')}={hv}: the value heads must be a multiple of "
                                   f"the key heads ({key('ssm.group_count')}={hk})")
    if isinstance(inner, bool) or not isinstance(inner, int) or inner < 1 or inner % hv:
        raise ModelLoadError(path, f"{key('ssm.inner_size')}={inner!r}: expected a multiple of the {hv} value heads")
    if shape["conv_kernel"] < 2:
        raise ModelLoadError(path, f"{key('ssm.conv_kernel')}={shape['conv_kernel']}: ridge's convolution needs "
                                   "at least 2 taps")
    recurrent = a("attention.recurrent_layers")
    if recurrent is None:
        every = _count(a, arch, "full_attention_interval", path, 4)
        linear = [i for i in range(n) if (i + 1) % every]
    elif not isinstance(recurrent, list) or len(recurrent) != kw["num_layers"] or any(recurrent[n:]):
        raise ModelLoadError(path, f"{key('attention.recurrent_layers')}={recurrent!r}: expected one flag a block, "
                                   "the MTP blocks not recurrent")
    else:
        linear = [i for i in range(n) if recurrent[i]]
    if len(linear) == n:
        raise ModelLoadError(path, f"{key('attention.recurrent_layers')}: no attention layer, which ridge needs")
    first = min(set(range(n)) - set(linear))
    rotary = a("rope.dimension_count")
    if rotary is not None and (isinstance(rotary, bool) or not isinstance(rotary, int) or rotary % 2
                               or not 0 < rotary <= kw["head_dim"]):
        raise ModelLoadError(path, f"{key('rope.dimension_count')}={rotary!r}: expected an even number of rotary "
                                   f"dims, at most the head's {kw['head_dim']}")
    return dict(num_layers=n, qk_norm=True, attention_bias=f"blk.{first}.attn_q.bias" in names,
                o_bias=f"blk.{first}.attn_output.bias" in names, mlp_bias=False,
                rotary_dim=None if rotary is None or rotary == kw["head_dim"] else int(rotary),
                linear_layers=linear or None, linear_attention=dict(shape, value_head_dim=inner // hv),
                extra={"attention_output_gate": True})


def read_moe(arch: str, a, kw: dict, names: set[str], path) -> dict:
    """read_hybrid, and the sparse layers: llama.cpp's routing, a shared expert gated per token."""
    out = read_hybrid(arch, a, kw, names, path)
    moe = expert_fields(a, dict(kw, num_layers=out["num_layers"]), names, path)
    shared = _count(a, arch, "expert_shared_feed_forward_length", path)
    # intermediate_size: the dense layers' (feed_forward_length); qwen35moe has none and writes none
    return dict(out, **moe, shared_expert_intermediate_size=shared, extra={**out["extra"], "shared_expert_gate": True},
                intermediate_size=int(a("feed_forward_length") or moe["moe_intermediate_size"]))


def _drop_mtp(tensor):
    """A tensor hook that drops the MTP blocks' own tensors (nextn.*); the rest of those blocks
    map as any layer's and are never read (the trunk is num_layers long)."""
    def hook(idx: str, rest: str, w: torch.Tensor):
        if rest.startswith("nextn."):
            return {}
        return tensor(idx, rest, w) if tensor is not None else None
    return hook


_experts = split_experts(("mlp.", "gate", "gate_proj", "up_proj", "down_proj"))


def _moe_tensor(idx: str, rest: str, w: torch.Tensor):
    if rest == "ffn_gate_inp_shexp.weight":  # the shared expert's gate: one row
        return {f"model.layers.{idx}.mlp.shared_expert_gate.weight": w.reshape(1, -1)}
    return _experts(idx, rest, w)


def family(arch: str, moe: bool) -> GGUFFamily:
    if moe:
        return GGUFFamily(arch, read=lambda a, kw, names, reader, path: read_moe(arch, a, kw, names, path),
                          keys=HYBRID_KEYS | MOE_KEYS, names={**NAMES, **MOE_NAMES}, tensor=_drop_mtp(_moe_tensor),
                          partial_rotary=True)
    return GGUFFamily(arch, read=lambda a, kw, names, reader, path: read_hybrid(arch, a, kw, names, path),
                      keys=HYBRID_KEYS, names=NAMES, tensor=_drop_mtp(None), partial_rotary=True)


# -- a linear layer's tensors, the file's -> Qwen3.5's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, ...)
def _grouped(t: torch.Tensor, dim: int, hk: int, r: int, d: int, what: str, path) -> torch.Tensor:
    """Tiled value heads (j * Hk + g) along dim -> grouped by key head (g * r + j), each d wide."""
    if t.shape[dim] != hk * r * d:
        raise ModelLoadError(path, f"tensor {what}: {tuple(t.shape)}, the metadata makes dim {dim} {hk * r * d}")
    shape = t.shape
    return t.reshape(*shape[:dim], r, hk, d, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def _take(sd, name: str, path) -> torch.Tensor:
    if name not in sd:
        raise ModelLoadError(path, f"missing tensor {name}")
    return sd.pop(name)


def linear_tensors(sd, cfg: ModelConfig, i: int, path) -> dict[str, torch.Tensor]:
    """Layer i's linear-attention tensors as GGUF holds them -> Hugging Face's."""
    la, p = cfg.linear_attention, f"model.layers.{i}.{GGUF}"
    hk, hv, dk, dv = la["num_key_heads"], la["num_value_heads"], la["key_head_dim"], la["value_head_dim"]
    r, qk = hv // hk, 2 * hk * dk
    sd = {n: sd[n] for n in sd if n.startswith(p)}
    a = _take(sd, p + "ssm_a", path)
    if not bool((a < 0).all()):
        raise ModelLoadError(path, f"tensor {p}ssm_a: values >= 0, where the converter writes -exp(A_log)")
    qkv, z = _take(sd, p + "attn_qkv.weight", path), _take(sd, p + "attn_gate.weight", path)
    conv, dt, out = _take(sd, p + "ssm_conv1d.weight", path), _take(sd, p + "ssm_dt.bias", path), \
        _take(sd, p + "ssm_out.weight", path)
    if conv.dim() != 2 or conv.shape[0] != qk + hv * dv:
        raise ModelLoadError(path, f"tensor {p}ssm_conv1d.weight: {tuple(conv.shape)}, expected "
                                   f"({qk + hv * dv}, taps)")
    if p + "ssm_ba.weight" in sd:  # Qwen3-Next: grouped, [b | a] per key head
        ba = _take(sd, p + "ssm_ba.weight", path)
        if ba.shape[0] != 2 * hv:
            raise ModelLoadError(path, f"tensor {p}ssm_ba.weight: {tuple(ba.shape)}, expected {2 * hv} rows")
        b, a_proj = ba.reshape(hk, 2, r, -1).unbind(1)
        b, a_proj = b.reshape(hv, -1), a_proj.reshape(hv, -1)
    else:  # Qwen3.5: tiled
        b, a_proj = _take(sd, p + "ssm_beta.weight", path), _take(sd, p + "ssm_alpha.weight", path)

        def group(t, dim, d, name):
            return _grouped(t, dim, hk, r, d, p + name, path)
        qkv = torch.cat([qkv[:qk], group(qkv[qk:], 0, dv, "attn_qkv.weight")])
        z, out = group(z, 0, dv, "attn_gate.weight"), group(out, 1, dv, "ssm_out.weight")
        b, a_proj = group(b, 0, 1, "ssm_beta.weight"), group(a_proj, 0, 1, "ssm_alpha.weight")
        dt, a = group(dt, 0, 1, "ssm_dt.bias"), group(a, 0, 1, "ssm_a")
        conv = torch.cat([conv[:qk], group(conv[qk:], 0, dv, "ssm_conv1d.weight")])
    if sd:
        raise ModelLoadError(path, f"tensor {next(iter(sd))}: not part of a Qwen3.5 linear layer")
    h = f"model.layers.{i}.linear_attn."
    return {h + "in_proj_qkv.weight": qkv, h + "in_proj_z.weight": z, h + "in_proj_b.weight": b,
            h + "in_proj_a.weight": a_proj, h + "conv1d.weight": conv, h + "dt_bias": dt,
            h + "A_log": torch.log(-a), h + "out_proj.weight": out}


def mixer(fuse, hf_fuse=None):
    """WeightLayout.attention: a linear layer read from GGUF turned into Qwen3.5's tensors and
    fused by `fuse` (qwen3_5.fuse_mixer); any other layer fused by hf_fuse (default: fuse)."""
    def attention(sd, cfg: ModelConfig, i: int, out: dict, path) -> None:
        if cfg.is_linear_layer(i) and f"model.layers.{i}.{GGUF}ssm_a" in sd:
            fuse({**sd, **linear_tensors(sd, cfg, i, path)}, cfg, i, out, path)
        else:
            (hf_fuse or fuse)(sd, cfg, i, out, path)
    return attention
