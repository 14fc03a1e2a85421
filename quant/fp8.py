"""Offline conversion: a model's float state dict -> FP8 (e4m3) weights with
one scale per output channel. The runtime side is quant/linear.py.

Scaling rule, chosen by measured error (`ridge bench accuracy`, docs/benchmarks.md):
"mse" searches, per row, the clipping of its range that minimises the row's
squared error, and beat "absmax" (each row's largest magnitude on e4m3's 448)
on SmolLM2 against fp32, in top-1 agreement and in KL. It costs only
conversion time, which the on-disk cache pays once.

The output head stays in the model's compute dtype, as in vLLM's FP8 path:
quantizing it cost the most accuracy per byte of all layers, and with tied
embeddings the head *is* the embedding table, which must be kept anyway.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ridge.kernels.fp8_scales import expand_scale

QUANT_VERSION = 3  # 3: scales per group or block (kernels/fp8_scales.py), recipes (quant/recipe.py)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Internal (fused) names of the decoder layers' linear weights.
LINEAR_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def is_linear_weight(name: str) -> bool:
    return name.endswith(LINEAR_SUFFIXES)


GROUPINGS = ("channel", "g128", "g64", "g32", "b128")  # the scale layouts (kernels/fp8_scales.py)


def grouping_block(grouping: str, shape: tuple[int, int]) -> tuple[int, int]:
    """"channel" | "g<G>" (1 x G along K) | "b<B>" (B x B) -> one scale's (rows, cols) for `shape`."""
    if grouping == "channel":
        return 1, shape[1]
    if grouping[:1] in ("g", "b") and grouping[1:].isdigit() and (g := int(grouping[1:])) & (g - 1) == 0 and g >= 2:
        return (1, g) if grouping[0] == "g" else (g, g)
    raise ValueError(f"unknown FP8 grouping {grouping!r} (channel, g<G> or b<B>, G and B powers of two)")


def _tiles(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[N, K] -> [ceil(N/bn), ceil(K/bk), bn*bk], zero-padded: zeros change neither a tile's
    largest magnitude nor its rounding error."""
    n, k = w.shape
    sn, sk = -(-n // bn), -(-k // bk)
    w = F.pad(w, (0, sk * bk - k, 0, sn * bn - n))
    return w.view(sn, bn, sk, bk).permute(0, 2, 1, 3).reshape(sn, sk, bn * bk)


def _cast(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def search_scale(t: torch.Tensor, rule: str) -> torch.Tensor:
    """t: [..., G] tiles -> the scale [...] of each: its largest magnitude on e4m3's 448
    ("absmax"), or the clipping of that range with the least squared error ("mse")."""
    scale = t.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    if rule == "absmax":
        return scale
    if rule != "mse":
        raise ValueError(f"unknown FP8 scaling rule {rule!r}")
    best_err = torch.full_like(scale, float("inf"))
    best = scale.clone()
    for clip in (1.0, 0.95, 0.9, 0.85, 0.8, 0.7):
        s = scale * clip
        err = ((_cast(t, s).float() * s[..., None] - t) ** 2).sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, s, best)
    return best


def quantize_fp8(w: torch.Tensor, rule: str = "mse", grouping: str = "channel") -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (fp8 [N, K], scale fp32: [N] per channel, [N, ceil(K/G)] for 1 x G
    groups, [ceil(N/B), ceil(K/B)] for blocks); w ~= fp8 * the scale of each weight's group.
    Stacked experts [E, N, K] (per channel only) -> (fp8 [E, N, K], scale [E, N])."""
    if w.dim() == 3:
        if grouping != "channel":
            raise ValueError("stacked experts take per-channel scales only")
        q, s = quantize_fp8(w.reshape(-1, w.shape[-1]), rule)
        return q.reshape(w.shape), s.reshape(w.shape[:2])
    w = w.float()
    bn, bk = grouping_block(grouping, tuple(w.shape))
    scale = search_scale(_tiles(w, bn, bk), rule)
    if grouping == "channel":
        scale = scale[:, 0]
    return (w / expand_scale(scale, tuple(w.shape))).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_state_dict(sd: dict[str, torch.Tensor], rule: str = "mse", grouping: str = "channel",
                        keep: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every linear weight becomes `name` (fp8) plus `name + '_scale'` (fp32, grouping's layout),
    except those in keep, which stay in bf16. Weights that are already FP8 (an FP8 checkpoint)
    pass through unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith("weight_scale"):
            out[name] = t
        elif name in keep and is_linear_weight(name) and t.dtype != FP8:
            out[name] = t.to(torch.bfloat16)
        elif is_linear_weight(name) and t.dtype != FP8:
            out[name], out[name + "_scale"] = quantize_fp8(t, rule, grouping if t.dim() == 2 else "channel")
        else:
            out[name] = t
    return out
