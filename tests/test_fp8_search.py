"""The converter's FP8 scale search in C (kernels/csrc/fp8_quant.c) against its torch oracle
(kernels/fp8_search.py search_scale_torch), and quantize_fp8's search a block of rows at a time.

The C search sums each try's error in its own order, so a near tie between two scales may go
the other way and an fp32 (per-channel) scale may differ in its last bits: what is held is the
error of its choices, tile by tile and in total, against the reference's, measured in fp64
through torch's own e4m3 cast."""
from __future__ import annotations

import pytest
import torch

from ridge.kernels import native
from ridge.kernels import fp8_search as fp8
from ridge.quant import fp8 as quant_fp8

FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.skipif(native.library() is None, reason="ridge's C kernels are not built here")


def tiles(n: int, g: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(n, g, generator=gen) * 0.02
    t[::7] *= 50  # tiles of other magnitudes
    t[3] = 0.0  # an all-zero tile: the scale floor
    t[5, : g // 2] = 0.0
    return t


def error(t: torch.Tensor, s: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    q = (t / s[..., None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(FP8).double()
    e = (q * s[..., None].double() - t.double()) ** 2
    return (e if w is None else e * w.double()).sum(-1)


@pytest.mark.parametrize("n,g,dtype", [(4001, 16, torch.bfloat16), (999, 32, torch.bfloat16),
                                       (257, 128, torch.bfloat16), (301, 700, torch.float32),
                                       (7, 16384, torch.bfloat16)])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_c_search_chooses_as_well_as_torchs(n, g, dtype, weighted):
    t = tiles(n, g, seed=g)
    w = torch.rand(g, generator=torch.Generator().manual_seed(1)).expand(n, g) if weighted else None
    ref = fp8.search_scale_torch(t, "mse", w, dtype)
    got = native.fp8_search_scale(t, w, dtype == torch.bfloat16, fp8.CLIPS, *fp8.REFINE)
    assert got is not None and got.shape == ref.shape and got.dtype == torch.float32
    floor = got == torch.tensor(1e-12)  # the floor, as the reference clamps after rounding
    assert ((got.to(dtype).float() == got) | floor).all() and (got >= 1e-12).all() and floor[3]  # as stored
    er, eg = error(t, ref, w), error(t, got, w)
    assert eg.sum() <= er.sum() * (1 + 1e-4)
    assert (eg <= er * 1.25 + 1e-30).all()  # a near tie broken the other way costs little
    assert (eg > er * (1 + 1e-5) + 1e-30).float().mean() <= 0.01
    if dtype == torch.bfloat16:  # bf16 snaps the scales: nearly all are the reference's own
        assert (got == ref).float().mean() >= 0.999


def test_search_scale_runs_c_and_falls_back_to_torch():
    t = tiles(64, 16, seed=3)
    with native.off():
        assert torch.equal(fp8.search_scale(t, "mse", None, torch.bfloat16),
                           fp8.search_scale_torch(t, "mse", None, torch.bfloat16))
    assert torch.equal(fp8.search_scale(t, "mse", None, torch.bfloat16),
                       native.fp8_search_scale(t, None, True, fp8.CLIPS, *fp8.REFINE))
    # absmax has no search: torch's, wherever
    assert torch.equal(fp8.search_scale(t, "absmax"), fp8.search_scale_torch(t, "absmax"))


@pytest.mark.parametrize("grouping,shape", [("g16", (300, 96)), ("channel", (77, 200)), ("b128", (300, 260)),
                                            ("g32", (33, 64))])
def test_quantize_fp8_searches_a_block_of_rows_at_a_time_with_the_same_result(grouping, shape, monkeypatch):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(7)) * 0.05
    imp = torch.rand(shape[1], generator=torch.Generator().manual_seed(8))
    for importance in (None, imp):
        whole = quant_fp8.quantize_fp8(w, "mse", grouping, importance)
        monkeypatch.setattr(quant_fp8, "SEARCH_CHUNK", 3 * shape[1])  # three rows (one row of blocks at least)
        rows = quant_fp8.quantize_fp8(w, "mse", grouping, importance)
        monkeypatch.undo()
        assert torch.equal(whole[0].view(torch.uint8), rows[0].view(torch.uint8))
        assert torch.equal(whole[1], rows[1])
