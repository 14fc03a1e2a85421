"""One SmolLM2-135M layer's four e4m3 products (g16 bf16 scales) at 2-64 rows through each CPU
product: the AVX-512 streaming kernel, the blocked product on fp32 tiles (MKL's sgemm) and on
AMX's tile unit where the CPU has it. ms a layer, median of 5 passes over 10 cold copies.

    python -P docs/experiments/cpu_products.py [--threads 2] [--shape 1b]
"""
import argparse
import time

import torch

from ridge.kernels import native
from ridge.kernels.cpu_linear import CpuLinear

SHAPES = {"smol": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
          "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]}


def weight(n: int, k: int) -> CpuLinear:
    w = (torch.randn(n, k) * 0.05).to(torch.float8_e4m3fn)
    s = torch.rand(n, k // 16).to(torch.bfloat16) * 0.01 + 0.001
    return CpuLinear.from_fp8(w, s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", choices=list(SHAPES), default="smol")
    ap.add_argument("--copies", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mats = {sh: [weight(*sh) for _ in range(args.copies)] for sh in SHAPES[args.shape]}
    runs = {"fp32 tiles": lambda c, x: native.fp8_linear_tiles(x, c.packed, c.scale, bf16=False)}
    if native.fp8_linear_isa() >= 1:
        runs["streaming"] = lambda c, x: native.fp8_linear(x, c.packed, c.scale, native.fp8_linear_isa())
    if native.tiles_bf16():
        runs["AMX tiles"] = lambda c, x: native.fp8_linear_tiles(x, c.packed, c.scale, bf16=True)
    print("rows | " + " | ".join(runs))
    for m in (2, 4, 8, 16, 32, 64):
        total = dict.fromkeys(runs, 0.0)
        for sh, copies in mats.items():
            x = torch.randn(m, sh[1])
            for name, run in runs.items():
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for c in copies:
                        run(c, x)
                    times.append(time.perf_counter() - t0)
                total[name] += sorted(times)[2] / len(copies) * 1e3
        print(f"{m} | " + " | ".join(f"{v:.3f}" for v in total.values()), flush=True)


if __name__ == "__main__":
    main()
