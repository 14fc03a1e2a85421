"""Rotary frequencies, with the context-extension rules configs name."""
from __future__ import annotations

import math

import torch


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are interpolated by `factor`, short ones kept,
    # and the band between is blended smoothly.
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0, 1)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen < old_ctx / high, inv_freq,
                       torch.where(wavelen > old_ctx / low, inv_freq / factor, blended))


def _yarn(inv_freq: torch.Tensor, s: dict, dim: int, base: float) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate the low frequencies, extrapolate the high ones, ramp between
    # the dims that turn beta_slow and beta_fast times over the original context.
    factor = s["factor"]
    old_ctx = s.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = s.get("beta_fast", 32.0), s.get("beta_slow", 1.0)

    def corr_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(corr_dim(beta_fast)), 0)
    hi = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    mscale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, mscale


def rope_cos_sin(head_dim: int, max_pos: int, theta: float, scaling: dict | None = None,
                 freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """-> [max_pos, head_dim] fp32 = [cos | sin], each over head_dim / 2 frequencies.
    freq_factors: llama.cpp's `rope_freqs` tensor, which divides the frequencies."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    mscale = 1.0
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.double()
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, mscale = _yarn(inv_freq, scaling, head_dim, theta)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r} (ridge knows linear, llama3, yarn)")
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos() * mscale, angles.sin() * mscale), dim=-1).float()
