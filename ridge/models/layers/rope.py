"""Rotary frequencies, with the context-extension rules configs name.

Each rule is transformers' (modeling_rope_utils: _compute_*_parameters), computed in
float64; the HF reader (quant/hf_config.py) hands every parameter filled as
transformers fills it. A rule may also scale cos and sin (yarn's and longrope's
attention factor), which scales q.k by its square, as in transformers."""
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv_freq: torch.Tensor, s: dict, dim: int, base: float) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate the low frequencies, extrapolate the high ones, ramp between
    # the dims that turn beta_slow and beta_fast times over the original context.
    factor = s["factor"]
    old_ctx = s.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = s.get("beta_fast") or 32.0, s.get("beta_slow") or 1.0

    def corr_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    mscale = s.get("attention_factor")
    if mscale is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        mscale = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    return inv, mscale


def _longrope(inv_freq: torch.Tensor, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    # LongRoPE (Phi-3): per-frequency divisors, short_factor within the original context and
    # long_factor beyond it. transformers switches by the running sequence's length; a table
    # serves every length here, so the model's context picks: long_factor where it exceeds
    # original_max_position_embeddings (as llama.cpp picks by its context).
    old_ctx = s["original_max_position_embeddings"]
    ext = torch.tensor(s["long_factor"] if max_pos > old_ctx else s["short_factor"], dtype=torch.float64)
    factor = s["factor"]
    mscale = s.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    return inv_freq / ext, mscale


def _proportional(inv_freq: torch.Tensor, s: dict, dim: int) -> torch.Tensor:
    # Gemma 4's full layers: only the first partial_rotary_factor * dim / 2 frequencies turn, at
    # the exponents they have over the whole head; the rest are zero (cos 1, sin 0), so the table
    # spans the whole head and rotate-half still pairs dim j with j + dim / 2, unlike a partial
    # rotary_dim, which rotates a head's leading dims among themselves.
    turning = int(s.get("partial_rotary_factor", 1.0) * dim // 2)
    inv_freq = inv_freq.clone()
    inv_freq[turning:] = 0.0
    return inv_freq / s.get("factor", 1.0)


def rope_cos_sin(head_dim: int, max_pos: int, theta: float, scaling: dict | None = None,
                 freq_factors: torch.Tensor | None = None, rotary_dim: int | None = None) -> torch.Tensor:
    """-> [max_pos, R] fp32 = [cos | sin], each over R / 2 frequencies, R = rotary_dim or head_dim
    (partial rotary: the kernels rotate each head's first R dims). freq_factors: llama.cpp's
    `rope_freqs` tensor, which divides the frequencies."""
    dim = rotary_dim or head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    mscale = 1.0
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.double()
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, mscale = _yarn(inv_freq, scaling, dim, theta)
    elif kind == "longrope":
        inv_freq, mscale = _longrope(inv_freq, scaling, max_pos)
    elif kind == "proportional":
        inv_freq = _proportional(inv_freq, scaling, dim)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r} (ridge knows linear, llama3, yarn, longrope, "
                         "proportional)")
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos() * mscale, angles.sin() * mscale), dim=-1).float()


def query_log_scale(positions: torch.Tensor, beta: float, period: int, offset: int = 0) -> torch.Tensor:
    """[T] positions -> [T] fp32 multipliers of q, 1 + beta * log(1 + floor((p + offset) / period)):
    attention sharpened with the log of how many periods lie behind a token (Ministral 3's
    llama_4_scaling_beta; Llama 4's temperature tuning, offset 1), in fp32 as transformers computes it."""
    return 1 + beta * torch.log1p(torch.floor((positions + offset) / period))
