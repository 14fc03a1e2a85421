"""The layouts of an FP8 weight's scales, shared by the converter and every product.

A weight [N, K] of e4m3 values w8 stands for w8 * scale, with scale one of:
- [N]: one scale per output channel (a group of the whole row);
- [N, ceil(K/G)]: 1 x G groups along K (G a power of two), the last group of a row the
  remainder K - G*(ceil(K/G)-1) where G does not divide K;
- [ceil(N/B), ceil(K/B)] with ceil(N/B) < N: B x B blocks (DeepSeek-V3's 128 x 128), the
  edge blocks cut short likewise.
The layout is read off the scale's shape, so a converted model carries no other record of it
per tensor: a G or B is the power of two whose groups give that count (ceil(K/n) lies in
(G/2, G] for n = ceil(K/G) >= 2, so the next power of two recovers it; a dimension with
one group reads as a group of its whole extent)."""
from __future__ import annotations

import torch


def _pow2_for(extent: int, count: int) -> int:
    """The power-of-two group size whose ceil(extent / size) is count (count >= 1)."""
    if count == 1:
        return extent
    g = -(-extent // count)
    return 1 << (g - 1).bit_length()


def scale_block(scale: torch.Tensor, shape: tuple[int, int]) -> tuple[int, int]:
    """-> (rows, cols) of one scale's block for a weight of `shape`: (1, K) per channel, (1, G) for
    groups along K, (B, B) for blocks."""
    n, k = shape
    if scale.dim() == 1:
        if scale.shape[0] != n:
            raise ValueError(f"scale {tuple(scale.shape)} for a weight {n} x {k}")
        return 1, k
    sn, sk = scale.shape
    if sn > n or sk > k:
        raise ValueError(f"scale {tuple(scale.shape)} for a weight {n} x {k}")
    bn = 1 if sn == n else _pow2_for(n, sn)
    bk = _pow2_for(k, sk)
    if -(-n // bn) != sn or -(-k // bk) != sk:
        raise ValueError(f"scale {tuple(scale.shape)} is no group layout of a weight {n} x {k}")
    return bn, bk


def expand_scale(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The scale of each weight, [N, K] fp32."""
    n, k = shape
    bn, bk = scale_block(scale, shape)
    s = scale.float().reshape(scale.shape[0], -1).repeat_interleave(bn, 0)[:n]
    return s.repeat_interleave(bk, 1)[:, :k]


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 [N, K] times its scales, exact in fp32."""
    return (w8.float() * expand_scale(scale, tuple(w8.shape))).to(dtype)


def column_groups(scale: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """The scales as 1 x G groups along K, for products that walk K once per output column:
    -> ([ceil(K/G), N] fp32 contiguous, G). Per channel is one group of K; B x B blocks become
    1 x B groups (each block's scale repeated down its rows)."""
    n, k = shape
    bn, bk = scale_block(scale, shape)
    s = scale.float().reshape(scale.shape[0], -1)
    if bn > 1:
        s = s.repeat_interleave(bn, 0)[:n]
    return s.t().contiguous(), bk
