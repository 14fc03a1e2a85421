"""The AVX-512 e4m3 streaming product by each of its conversions (issue 45): shifts (with the
weight's map) against VBMI's table lookups, alternating in rounds in one run, over SmolLM2's
30 layers of e4m3 products (119 MB, in a large last-level cache; --layers 1 keeps them in L2).

    python -P docs/experiments/e4m3_conversions.py --rows 1 --layers 30

Weights are random, quantized as the CPU recipe does (1 x 16 groups), so a few k pairs hold a
subnormal and take the tables. Prints each conversion's median ms a pass, its GB/s and the ratio;
the two are checked bit for bit first."""
from __future__ import annotations

import argparse
import ctypes
import time

import torch

from ridge.kernels import native
from ridge.kernels.cpu_linear import CpuLinear
from ridge.quant.fp8 import quantize_fp8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down
NAMES = {1: "tables", 2: "shifts"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lib = native.library()
    lib.fp8_linear_force_conversion.argtypes, lib.fp8_linear_force_conversion.restype = [ctypes.c_int], ctypes.c_int
    if lib.fp8_linear_force_conversion(-1) < 2:
        raise SystemExit("this CPU has no AVX-512 VBMI: only one conversion runs here")
    g = torch.Generator().manual_seed(0)
    mats = [CpuLinear.from_fp8(*quantize_fp8(torch.randn(n, k, generator=g) * 0.05, "absmax", "g16"))
            for _ in range(a.layers) for n, k in SHAPES]
    xs = {k: torch.randn(a.rows, k, generator=g) for _, k in SHAPES}
    isa = native.fp8_linear_isa()
    calls = [native.fp8_linear_call(m.packed, m.scale, isa, False, m.special) for m in mats]

    def run():
        return [c(xs[m.shape[1]]) for m, c in zip(mats, calls)]

    outs = {}
    for c in NAMES:
        lib.fp8_linear_force_conversion(c)
        outs[c] = run()
    assert all(torch.equal(p, q) for p, q in zip(outs[1], outs[2])), "the conversions differ"
    nbytes = sum(m.packed.numel() + m.scale.numel() * m.scale.element_size() for m in mats)
    times = {c: [] for c in NAMES}
    for r in range(a.rounds):
        for c in (1, 2) if r % 2 == 0 else (2, 1):
            lib.fp8_linear_force_conversion(c)
            for _ in range(5):
                run()
            ts = []
            for _ in range(25):
                t0 = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t0)
            times[c].append(sorted(ts)[len(ts) // 2])
    lib.fp8_linear_force_conversion(-1)
    med = {c: sorted(t)[len(t) // 2] for c, t in times.items()}
    for c, m in med.items():
        print(f"rows={a.rows} layers={a.layers} {NAMES[c]}: {m * 1e3:.3f} ms, {nbytes / m / 1e9:.1f} GB/s")
    print(f"shifts / tables: {med[1] / med[2]:.2f}x")


if __name__ == "__main__":
    main()
