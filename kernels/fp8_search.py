"""The FP8 converter's scale search (quant/fp8.py quantize_fp8 calls it per tile of a weight):
ridge's C search (kernels/csrc/fp8_quant.c) where the C kernels are built, torch's otherwise;
the torch form is the C search's oracle (tests/test_fp8_search.py)."""
from __future__ import annotations

import torch

from . import native

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7)  # the "mse" search's clippings of each tile's range
REFINE = (2, 2)  # the clippings refined per tile (its best ones), and the refinements of each


def search_scale(t: torch.Tensor, rule: str, weight: torch.Tensor | None = None,
                 scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """t: [..., G] tiles -> the scale [...] of each: its largest magnitude on e4m3's 448
    ("absmax"), or the scale of least squared error ("mse"), the error weighted per value by
    weight (broadcast to t) where given.

    "mse" tries each clipping in CLIPS, then refines the best two of each tile twice: with each
    value's e4m3 code q fixed, the scale of least error is sum(w t q) / sum(w q^2) (least
    squares), at which the codes are rounded again. The refinement, not a finer grid of clippings,
    finds the scales at which a tile's values fall near e4m3 values: on SmolLM2's weights it
    leaves 19 % (1 x 16) and 19 % (1 x 32) less squared error than the clippings alone, less than
    257 clippings do, and 3 % less per channel (docs/benchmarks.md). Each scale is rounded to
    scale_dtype before it is tried, so the error measured is the stored scale's.

    The "mse" search runs in C where ridge's kernels are built (kernels/csrc/fp8_quant.c: a tile
    stays in registers through all of its tries, where torch makes a dozen passes over the whole
    weight through its slow e4m3 cast); search_scale_torch is its oracle."""
    if rule == "mse":
        got = native.fp8_search_scale(t, weight, scale_dtype == torch.bfloat16, CLIPS, *REFINE)
        if got is not None:
            return got
    return search_scale_torch(t, rule, weight, scale_dtype)


def search_scale_torch(t: torch.Tensor, rule: str, weight: torch.Tensor | None = None,
                       scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """search_scale in torch: the C search's oracle, and what runs where ridge's C kernels do not."""
    amax = t.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    if rule == "absmax":
        return amax.to(scale_dtype).float()
    if rule != "mse":
        raise ValueError(f"unknown FP8 scaling rule {rule!r}")

    def tried(s):  # -> (the scale as stored, its error, the codes)
        s = s.to(scale_dtype).float().clamp(min=1e-12)
        q = (t / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
        e = (q * s[..., None] - t) ** 2
        return s, (e if weight is None else e * weight).sum(dim=-1), q

    starts = [tried(amax * clip)[:2] for clip in CLIPS]  # not the codes: 6 copies of the weight's size
    errs = torch.stack([e for _, e in starts])
    best, best_err = torch.stack([s for s, _ in starts]).gather(0, errs.argmin(0)[None])[0], errs.amin(0)
    for rank in range(REFINE[0]):
        pick = errs.argsort(0)[rank]
        s, _, q = tried(amax * torch.tensor(CLIPS)[pick])
        for _ in range(REFINE[1]):
            qw = q if weight is None else q * weight
            den = (qw * q).sum(dim=-1)
            s, err, q = tried(torch.where(den > 0, (qw * t).sum(dim=-1) / den.clamp(min=1e-30), s))
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, s, best)
    return best
