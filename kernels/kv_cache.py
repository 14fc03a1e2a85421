"""KV-cache write: scatter new K/V through the slot mapping into the paged cache.

Cache layout, shared by every attention implementation:
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  k_scale, v_scale: [num_blocks, block_size, num_kv_heads] float16, FP8 caches only

FP8 rule: one scale per (token, KV head) = max(|x|) / 448, stored in float16 and
floored at 2**-14 so that it never underflows; values are divided by the stored
(rounded) scale and cast with round-to-nearest-even, saturating at +-448.
Per-token-head scales were chosen by measured accuracy (docs/benchmarks.md);
the fp16 scale costs 2 bytes per 64-value head, which keeps FP8 at 1.94x BF16's
tokens per byte.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0 ** -14


def fp8_kv_scale(x: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] -> per (token, head) scale [T, H] in SCALE_DTYPE."""
    amax = x.abs().amax(dim=-1).float()
    return (amax / FP8_MAX).clamp(min=MIN_SCALE).to(SCALE_DTYPE)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = fp8_kv_scale(x)
    q = (x.float() / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    """key/value: [T, Hkv, D]; slot_mapping: [T] int64 (-1 skips the token)."""
    num_blocks, block_size, num_heads, head_dim = k_cache.shape
    assert key.shape == value.shape and key.shape[1:] == (num_heads, head_dim), (key.shape, k_cache.shape)
    assert slot_mapping.shape == (key.shape[0],)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k = k_cache.view(num_blocks * block_size, num_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_heads, head_dim)
    if k_cache.dtype == FP8:
        assert k_scale is not None and v_scale is not None, "an FP8 cache needs its scales"
        key, ks = quantize_kv(key)
        value, vs = quantize_kv(value)
        k_scale.view(-1, num_heads).index_copy_(0, slot_mapping, ks)
        v_scale.view(-1, num_heads).index_copy_(0, slot_mapping, vs)
    flat_k.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks: [..., nb] block ids -> [..., nb * block_size, Hkv, D] in `dtype`, dequantized."""
    x = cache[blocks]  # [..., nb, bs, Hkv, D]
    if scale is not None and cache.dtype == FP8:
        x = x.to(dtype) * scale[blocks].to(dtype).unsqueeze(-1)
    else:
        x = x.to(dtype)
    return x.flatten(-4, -3)
