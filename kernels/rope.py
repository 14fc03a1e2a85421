"""Rotary position embedding in the rotate-half (Hugging Face) layout."""
from __future__ import annotations

import torch


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D], positions: [T], cos_sin: [max_pos, D] = [cos | sin]
    each over D/2 frequencies. Returns rotated (q, k) in their own dtype."""
    cs = cos_sin[positions].float()
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
