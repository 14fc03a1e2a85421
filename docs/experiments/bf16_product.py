"""The CPU's bf16 weight format on AVX-512 BF16: oneDNN's packed bf16 product (result rounded to
bf16), ATen's one-row GEMV (the same), and ridge's own bf16 product (native.bf16_linear: the e4m3
kernel's tiles over bf16 words, fp32 sums and an fp32 result), on the embedded model's shapes,
each over enough weights of the shape to overflow the cache (cold, as the start-up measurement
times them); best of 3 passes of 10 rounds, called in turn (docs/benchmarks.md).

    python docs/experiments/bf16_product.py [threads]"""
import sys
import time

import torch

from ridge.kernels import native
from ridge.kernels.cpu_linear import gemv_bf16

assert native.fp8_linear_isa() == 2, "ridge's bf16 product needs AVX-512 BF16"
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)


def best(f, rounds: int = 10) -> float:
    f()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(rounds):
            f()
        times.append((time.perf_counter() - t0) / rounds)
    return min(times)


print("| weight (N x K) | rows | oneDNN ms | ridge ms | ridge / oneDNN | GEMV ms |")
print("|---|---|---|---|---|---|")
for n, k, count in ((49152, 576, 2), (960, 576, 60), (1536, 576, 30), (576, 1536, 30), (576, 576, 60)):
    ws = [torch.randn(n, k).bfloat16() for _ in range(count)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
    ours = [w.view(torch.int16).view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous() for w in ws]
    for m in (1, 4, 16, 64, 128):
        x = torch.randn(m, k)
        xb = x.bfloat16()
        a = best(lambda: [torch.ops.mkldnn._linear_pointwise(xb, w, None, "none", [None], "") for w in onednn])
        b = best(lambda: [native.bf16_linear(x, w) for w in ours])
        g = f"{best(lambda: [gemv_bf16(xb, w) for w in ws]) / count * 1e3:.3f}" if m == 1 else "-"
        print(f"| {n} x {k} | {m} | {a / count * 1e3:.3f} | {b / count * 1e3:.3f} | {b / a:.2f} | {g} |")
