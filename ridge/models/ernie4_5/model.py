"""ERNIE 4.5's interleaved RoPE on llama's layer. Rotating the pairs (2i, 2i + 1) of a head by
frequency i is rotating the pairs (i, i + D/2) of the same head with its dims reordered
[0, 2, 4, .., 1, 3, 5, ..]; q and k reordered alike keep every q.k, so attention, and the
output (v and o untouched), are exactly the checkpoint's. The rows are reordered once, at load,
with their biases and FP8 scales, before the layer takes them."""
from __future__ import annotations

import torch

from ridge.config import ModelConfig

from ..layers.decoder import CausalLM


def halves_from_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows (head, i, pair) -> (head, pair, i) of a [n_heads * D, ...] tensor, any dtype (FP8 as bytes)."""
    raw = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
    rows = raw.shape[0]
    out = raw.reshape(n_heads, rows // n_heads // 2, 2, *raw.shape[1:]).transpose(1, 2).reshape(raw.shape)
    return out.view(w.dtype) if raw is not w else out


def reorder_qk(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The fused qkv rows [q | k | v] (a weight, its per-row scales or its bias) with q's and k's heads reordered."""
    if t.dim() == 0 or t.shape[0] != cfg.q_size + 2 * cfg.kv_size:  # a scale per tensor: nothing to reorder
        return t
    q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
    return torch.cat([halves_from_pairs(q, cfg.num_heads), halves_from_pairs(k, cfg.num_kv_heads), v])


def with_halves(sd: dict, i: int, cfg: ModelConfig) -> dict:
    """sd (not changed) with layer i's fused qkv weight, scales and bias reordered (reorder_qk)."""
    p = f"layers.{i}.qkv_proj."
    return {**sd, **{p + s: reorder_qk(sd[p + s], cfg) for s in ("weight", "weight_scale", "bias") if p + s in sd}}


class Ernie4_5CausalLM(CausalLM):
    def load_layer(self, i: int, sd, device, dtype) -> None:
        super().load_layer(i, with_halves(sd, i, self.cfg), device, dtype)
