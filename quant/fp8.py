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

QUANT_VERSION = 2
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Internal (fused) names of the decoder layers' linear weights.
LINEAR_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def is_linear_weight(name: str) -> bool:
    return name.endswith(LINEAR_SUFFIXES)


def _cast(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_fp8(w: torch.Tensor, rule: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (fp8 [N, K], scale fp32 [N]); w ~= fp8 * scale[:, None]. Stacked experts
    [E, N, K] -> (fp8 [E, N, K], scale [E, N]): each expert's rows scaled on their own."""
    if w.dim() == 3:
        q, s = quantize_fp8(w.reshape(-1, w.shape[-1]), rule)
        return q.reshape(w.shape), s.reshape(w.shape[:2])
    w = w.float()
    amax = w.abs().amax(dim=1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    if rule == "absmax":
        return _cast(w, scale), scale
    if rule != "mse":
        raise ValueError(f"unknown FP8 scaling rule {rule!r}")
    best_err = torch.full_like(scale, float("inf"))
    best = scale.clone()
    for clip in (1.0, 0.95, 0.9, 0.85, 0.8, 0.7):
        s = scale * clip
        err = ((_cast(w, s).float() * s[:, None] - w) ** 2).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, s, best)
    return _cast(w, best), best


def quantize_state_dict(sd: dict[str, torch.Tensor], rule: str = "mse") -> dict[str, torch.Tensor]:
    """Every linear weight becomes `name` (fp8) plus `name + '_scale'` (fp32 [N]).
    Weights that are already FP8 (an FP8 checkpoint) pass through unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith("weight_scale"):
            out[name] = t
        elif is_linear_weight(name) and t.dtype != FP8:
            out[name], out[name + "_scale"] = quantize_fp8(t, rule)
        else:
            out[name] = t
    return out
