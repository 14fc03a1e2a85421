"""Mamba2's mixer (Granite 4 hybrid, Nemotron-H), as transformers' GraniteMoeHybridMambaLayer and
NemotronHMamba2Mixer compute it, with its per-request state in the slot pool beside the paged
KV (cache/state_cache.py: the convolution's last K - 1 inputs and a [P, N] state per head).

Per token, in_proj's rows are [gate (H P) | x B C (H P + 2 G N) | dt (H)]:
- x, B and C pass a causal depthwise convolution of conv_kernel taps, then SiLU;
- the selective scan (kernels/ssd_scan.py) over heads of P channels, B and C shared by the
  H / G heads of a group: dt' = clamp(softplus(dt + dt_bias), dt_limit), S <- exp(dt' A) S +
  dt' x B^T, y = S C + D x, with A = -exp(A_log);
- y times silu(gate), RMS-normed within each of the G groups of H P / G channels, times the norm's
  weight (the gate before the norm: norm_before_gate false), then out_proj.
The clamp by dt_limit holds at every token: transformers applies it in its chunked scan and skips
it in its one-token cached step; the math of a sequence is the chunked scan's."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig, mamba2_conv_channels
from ridge.kernels import ops
from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import FP8, cat_rows
from ridge.quant.hf_config import HFConfig
from ridge.quant.linear import FP8Linear

# Per-layer tensors outside FP8Linear, fp32 as the kernels take them (conv1d_bias where conv_bias).
MAMBA2_TENSORS = ("conv1d_weight", "A_log", "D", "dt_bias", "norm_weight")


class Mamba2Mixer(nn.Module):
    """The token mixer of a Mamba2 layer; state is the layer's LayerState (cache/state_cache.py)."""

    def __init__(self, cfg: ModelConfig, eps: float):
        super().__init__()
        la = cfg.linear_attention
        self.heads, self.head_dim, self.groups, self.state_size = (la["num_heads"], la["head_dim"], la["n_groups"],
                                                                   la["state_size"])
        self.inner = self.heads * self.head_dim
        self.conv_dim = mamba2_conv_channels(la)
        self.dt_limit = tuple(la["dt_limit"])
        self.eps = eps
        self.in_proj = FP8Linear(cfg.hidden_size, self.inner + self.conv_dim + self.heads, bias=la["proj_bias"])
        self.out_proj = FP8Linear(self.inner, cfg.hidden_size, bias=la["proj_bias"])
        self.register_buffer("conv1d_weight", torch.empty(0))  # [conv_dim, K]
        self.conv1d_bias = None  # [conv_dim] where conv_bias
        self.register_buffer("A", torch.empty(0))  # [H]: -exp(A_log)
        self.register_buffer("D", torch.empty(0))  # [H]
        self.register_buffer("dt_bias", torch.empty(0))  # [H]
        self.register_buffer("norm_weight", torch.empty(0))  # [H P]

    def load_extra(self, sd, prefix: str, device: torch.device) -> None:
        take = {name: sd[prefix + name].float().contiguous().to(device) for name in MAMBA2_TENSORS}
        self.conv1d_weight, self.D, self.dt_bias, self.norm_weight = (take["conv1d_weight"], take["D"],
                                                                      take["dt_bias"], take["norm_weight"])
        self.A = -torch.exp(take["A_log"])
        b = sd.get(prefix + "conv1d_bias")
        self.conv1d_bias = None if b is None else b.float().contiguous().to(device)

    def forward(self, h, meta, state):
        T = h.shape[0]
        gate, xbc, dt = self.in_proj.forward(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        # A step of decodes only takes the one-token forms; a step that keeps states (speculation,
        # prefix checkpoints) the token-by-token scan, which writes the state after each token.
        keep = meta.token_state_slots
        decode = keep is None and all(q == 1 and s > 1 for q, s in zip(meta.query_lens_host, meta.seq_lens_host))
        xbc = xbc.float()
        if decode:
            xbc = ops.causal_conv1d_update(xbc, self.conv1d_weight, self.conv1d_bias, state.conv, meta.state_slots,
                                           activation="silu")
        else:
            xbc = ops.causal_conv1d(xbc, self.conv1d_weight, self.conv1d_bias, state.conv, meta.query_start_loc,
                                    meta.state_slots, meta.has_initial_state, activation="silu",
                                    token_state_slots=keep)
        x, B, C = xbc.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        x = x.reshape(T, self.heads, self.head_dim)  # [T, H, P]
        B = B.reshape(T, self.groups, self.state_size)  # [T, G, N]
        C = C.reshape(T, self.groups, self.state_size)
        args = (x, dt.float().contiguous(), self.A, B, C, state.recurrent, meta.query_start_loc, meta.state_slots,
                meta.has_initial_state)
        kw = dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit)
        if decode or keep is not None:
            y = ops.ssd_state_update(*args, **kw, token_state_slots=keep)
        else:
            y = ops.ssd_chunk_scan(*args, **kw)
        y = y.reshape(T, self.groups, self.inner // self.groups) * F.silu(
            gate.float().reshape(T, self.groups, self.inner // self.groups))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.out_proj.forward((y.reshape(T, self.inner) * self.norm_weight).to(h.dtype))


def fuse_mamba2(sd, cfg: ModelConfig, src: str, dst: str, out: dict, path) -> None:
    """A Mamba2 mixer's tensors under src (its checkpoint's names: in_proj, conv1d, A_log, D,
    dt_bias, norm, out_proj) -> the model's under dst, each of the shape the config makes."""
    la = cfg.linear_attention
    cat_rows(sd, [src + "in_proj"], out, dst + "in_proj", path, la["proj_bias"])
    cat_rows(sd, [src + "out_proj"], out, dst + "out_proj", path, la["proj_bias"])
    heads, inner, channels = la["num_heads"], la["num_heads"] * la["head_dim"], mamba2_conv_channels(la)
    want = {"conv1d.weight": (channels, 1, la["conv_kernel"]), "A_log": (heads,), "D": (heads,),
            "dt_bias": (heads,), "norm.weight": (inner,)}
    if la["conv_bias"]:
        want["conv1d.bias"] = (channels,)
    elif src + "conv1d.bias" in sd:
        raise ModelLoadError(path, f"tensor {src}conv1d.bias, which the config's convolution bias flag (false) "
                                   "does not declare")
    for name, shape in want.items():
        t = sd.get(src + name)
        if t is None:
            raise ModelLoadError(path, f"missing tensor {src}{name}")
        if t.dtype == FP8:
            raise ModelLoadError(path, f"tensor {src}{name}: FP8, which ridge reads for projections only")
        if t.numel() != math.prod(shape):
            raise ModelLoadError(path, f"tensor {src}{name}: {tuple(t.shape)}, the config makes it {shape}")
        key = name.replace(".", "_")
        out[dst + key] = t.reshape(shape[0], -1) if name == "conv1d.weight" else t.reshape(shape)


# -- config.json: the shape and flags both families read, under each family's keys.
def number_or_infinity(v) -> float | None:
    """A JSON number, or transformers' tagged float ({"__float__": "Infinity"}) as save_pretrained writes it."""
    if isinstance(v, dict) and set(v) == {"__float__"} and v["__float__"] in ("Infinity", "-Infinity"):
        return math.inf if v["__float__"] == "Infinity" else -math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def dt_limit(c: HFConfig, key: str) -> list[float]:
    v = c.get(key)
    lim = [number_or_infinity(x) for x in v] if isinstance(v, (list, tuple)) and len(v) == 2 else [None]
    if None in lim or lim[0] > lim[1]:
        c.refuse(key, v, "expected [low, high] with low <= high (dt's clamp)")
    return lim


def mamba2_shape(c: HFConfig, heads: str, head_dim: str, groups: str, state: str, kernel: str,
                 inner: int | None) -> dict:
    """The Mamba2 shape from the family's keys, checked as transformers builds it: heads of head_dim
    whose product is inner (where the family ties it to its expand), G groups dividing the heads."""
    shape = {}
    for k, key in (("num_heads", heads), ("n_groups", groups), ("state_size", state), ("conv_kernel", kernel)):
        shape[k] = c.positive_int(key)
        if shape[k] is None:
            c.refuse(key, None, "the Mamba2 layers need it")
    d = c.get(head_dim)
    if d == "auto" and inner is not None:
        d = inner // shape["num_heads"]
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        c.refuse(head_dim, c.get(head_dim), "expected a positive integer")
    if inner is not None and d * shape["num_heads"] != inner:
        c.refuse(head_dim, c.get(head_dim), f"{shape['num_heads']} heads of it must make {inner} channels")
    if shape["num_heads"] % shape["n_groups"]:
        c.refuse(groups, shape["n_groups"], f"must divide the {shape['num_heads']} heads")
    if shape["conv_kernel"] < 2:
        c.refuse(kernel, shape["conv_kernel"], "ridge's convolution needs at least 2 taps")
    return dict(kind="mamba2", head_dim=d, **shape)
