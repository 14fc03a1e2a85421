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
from ridge.kernels.fp8_search import search_scale

QUANT_VERSION = 5  # 3: scales per group or block (kernels/fp8_scales.py), recipes (quant/recipe.py);
# 4: the "mse" search refines each scale by least squares, group and block scales in bf16;
# 5: the search in C (kernels/csrc/fp8_quant.c), whose sums may break a near tie the other way
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SEARCH_CHUNK = 1 << 22  # the values quantize_fp8 searches scales for at once
# Internal (fused) names of the decoder layers' linear weights.
LINEAR_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight",
                   "in_proj.weight", "out_proj.weight",  # these two: a recurrent layer's (Gated DeltaNet, LFM2's short convolution)
                   "up_proj.weight")  # an MLP without a gate


def is_linear_weight(name: str) -> bool:
    return name.endswith(LINEAR_SUFFIXES)


GROUPINGS = ("channel", "g128", "g64", "g32", "g16", "b128")  # the scale layouts (kernels/fp8_scales.py)


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


def scale_dtype(grouping: str) -> torch.dtype:
    """The stored scales' dtype: fp32 per channel (a few bytes a row), bf16 for groups and blocks,
    where fp32 scales would cost 4 bytes per G weights (1 x 32: 12 % on top of the weight, bf16 6 %).
    bf16 has fp32's exponent range and 8 significant bits; the search rounds each scale to it before
    measuring its error, so what is stored is what was chosen. Every product reads the scales as
    fp32 (exact)."""
    return torch.float32 if grouping == "channel" else torch.bfloat16


def quantize_fp8(w: torch.Tensor, rule: str = "mse", grouping: str = "channel",
                 importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (fp8 [N, K], scale: [N] fp32 per channel, [N, ceil(K/G)] bf16 for 1 x G
    groups, [ceil(N/B), ceil(K/B)] bf16 for blocks); w ~= fp8 * the scale of each weight's group.
    importance: [K], what an error in each input column costs (the inputs' mean square on the
    calibration text): the search's squared error is weighted by it. Stacked experts [E, N, K]
    (per channel only) -> (fp8 [E, N, K], scale [E, N])."""
    if w.dim() == 3:
        if grouping != "channel":
            raise ValueError("stacked experts take per-channel scales only")
        q, s = quantize_fp8(w.reshape(-1, w.shape[-1]), rule)
        return q.reshape(w.shape), s.reshape(w.shape[:2])
    bn, bk = grouping_block(grouping, tuple(w.shape))
    # A row of tiles at a time, as many as SEARCH_CHUNK values hold: each tile's scale depends on
    # its own values alone, and the search makes a dozen temporaries of its input's size, which
    # for a whole large weight (an 8B model's gate_up: 117M values) came to several GB.
    step = bn * max(1, SEARCH_CHUNK // (bn * w.shape[1]))
    scales, codes = [], []
    for r in range(0, w.shape[0], step):
        part = w[r:r + step].float()
        weight = None if importance is None else _tiles(importance.float().expand_as(part), bn, bk)
        scale = search_scale(_tiles(part, bn, bk), rule, weight, scale_dtype(grouping))
        if grouping == "channel":
            scale = scale[:, 0]
        codes.append((part / expand_scale(scale, tuple(part.shape))).clamp(-FP8_MAX, FP8_MAX).to(FP8))
        scales.append(scale)
    return torch.cat(codes), torch.cat(scales).to(scale_dtype(grouping))


def quantize_state_dict(sd: dict[str, torch.Tensor], rule: str = "mse", grouping: str = "channel",
                        keep: frozenset[str] = frozenset(),
                        importance: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every linear weight becomes `name` (fp8) plus `name + '_scale'` (grouping's layout),
    except those in keep, which stay in bf16. importance: weight name -> [K], quantize_fp8's.
    Weights that are already FP8 (an FP8 checkpoint) pass through unchanged."""
    importance = importance or {}
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith("weight_scale"):
            out[name] = t
        elif name in keep and is_linear_weight(name) and t.dtype != FP8:
            out[name] = t.to(torch.bfloat16)
        elif is_linear_weight(name) and t.dtype != FP8:
            out[name], out[name + "_scale"] = quantize_fp8(t, rule, grouping if t.dim() == 2 else "channel",
                                                           importance.get(name) if t.dim() == 2 else None)
        else:
            out[name] = t
    return out
