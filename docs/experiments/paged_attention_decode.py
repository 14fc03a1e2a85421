"""ridge's C paged attention at decode: one layer's call over S sequences of L tokens (16 query
heads, 4 KV heads, head size 64, fp32 cache), best of 10 rounds of 20 calls (docs/benchmarks.md).

    python docs/experiments/paged_attention_decode.py 2"""
import sys
import time

import torch

from ridge.kernels.attention_native import paged_attention_native
from ridge.kernels.metadata import AttentionMetadata

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
H, HKV, D, BS = 16, 4, 64, 16
for S, L in ((1, 128), (1, 1024), (16, 128), (64, 128)):
    nbs = L // BS + 1
    kc, vc = torch.randn(S * nbs, BS, HKV, D), torch.randn(S * nbs, BS, HKV, D)
    meta = AttentionMetadata.build([1] * S, [L] * S, [list(range(i * nbs, (i + 1) * nbs)) for i in range(S)],
                                   [0] * S)
    q = torch.randn(S, H, D)
    for _ in range(3):
        paged_attention_native(q, kc, vc, None, None, meta, D ** -0.5)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        for _ in range(20):
            paged_attention_native(q, kc, vc, None, None, meta, D ** -0.5)
        best = min(best, (time.perf_counter() - t) / 20)
    print(f"{S} sequences x {L} tokens: {best * 1e6:.0f} us")
