"""Error-compensating FP8 rounding (GPTQ, Frantar et al. 2022), done once at conversion.

Plain rounding treats each weight alone. GPTQ rounds the columns of W [N, K] in order and,
after each, moves the rounding error onto the columns not yet rounded, in proportion to how
the layer's inputs correlate (H = X^T X over a calibration text): the product W X keeps what it
can of the error's cancellation. The scales stay the MSE search's (quant/fp8.py), taken per group
from the weights as compensated when the group's first column comes up, so the result is an
ordinary FP8 weight in the same layout; only which e4m3 value each weight rounds to changes."""
from __future__ import annotations

import torch

from .fp8 import FP8, FP8_MAX, grouping_block, scale_dtype, search_scale

DAMP = 0.01  # of H's mean diagonal, added to it: keeps the inverse finite where inputs are nearly collinear
LAZY = 128  # columns updated together before the rest of W sees their error (the paper's lazy batch)


def _inverse_factor(h: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of H^-1, damped; a dead input (zero variance) gets a unit diagonal."""
    h = h.float().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(DAMP * h.diagonal().mean())
    inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inv, upper=True)


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """v (fp32, within +-448) rounded to the nearest e4m3 value, ties to even, in fp32: what
    v.to(float8_e4m3fn) gives, without torch's fp8 cast, which is slow on CPU and runs here once
    a column. 3 mantissa bits: the step is 2^(e-3) in the binade [2^e, 2^(e+1)), 2^-9 below 2^-6."""
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -9))).clamp(min=-6)
    step = torch.exp2(e - 3)
    return (torch.round(v / step) * step).clamp(-FP8_MAX, FP8_MAX)


def _group_scale(w: torch.Tensor, bn: int, rule: str, dtype: torch.dtype) -> torch.Tensor:
    """w: [N, g] columns of one group -> the per-row scale [N] (bn rows share one for blocks),
    its values those of dtype (the stored scale's)."""
    n, g = w.shape
    if bn == 1:
        return search_scale(w, rule, scale_dtype=dtype)
    rows = -(-n // bn)
    tiles = torch.nn.functional.pad(w, (0, 0, 0, rows * bn - n)).reshape(rows, bn * g)
    return search_scale(tiles, rule, scale_dtype=dtype).repeat_interleave(bn)[:n]


def gptq_fp8(w: torch.Tensor, h: torch.Tensor, grouping: str = "channel",
             rule: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K], h: [K, K] the inputs' X^T X -> (fp8 [N, K], scale) in quantize_fp8's layout."""
    w = w.float().clone()
    n, k = w.shape
    bn, bk = grouping_block(grouping, (n, k))
    sdt = scale_dtype(grouping)
    u = _inverse_factor(h)
    q = torch.empty(n, k)  # e4m3 values in fp32 until the end
    col_scale = torch.empty(n, k)  # each weight's scale, while the groups are found
    scales = []
    for i1 in range(0, k, LAZY):
        i2 = min(i1 + LAZY, k)
        w1, err = w[:, i1:i2].clone(), torch.zeros(n, i2 - i1)
        for i in range(i2 - i1):
            c = i1 + i
            if c % bk == 0:  # a new group: its scale from the columns as compensated so far
                end = min(c + bk, k)
                cols = w1[:, i:i + (end - c)] if end <= i2 else torch.cat((w1[:, i:], w[:, i2:end]), 1)
                s = _group_scale(cols, bn, rule, sdt)
                scales.append(s)
                col_scale[:, c:end] = s[:, None]
            s = col_scale[:, c]
            qc = round_e4m3((w1[:, i] / s).clamp(-FP8_MAX, FP8_MAX))
            q[:, c] = qc
            e = (w1[:, i] - qc * s) / u[c, c]
            w1[:, i:] -= e[:, None] * u[c, i1 + i:i2][None, :]
            err[:, i] = e
        w[:, i2:] -= err @ u[i1:i2, i2:]
    q = q.to(FP8)  # exact: every value is an e4m3 one
    scale = torch.stack(scales, 1).to(sdt)  # [N, groups], exact: each was rounded to sdt
    if grouping == "channel":
        return q, scale[:, 0]
    if bn > 1:
        scale = scale[::bn]
    return q, scale.contiguous()
