"""The CPU attention kernel alone on decode steps (issue 45): its generic form (the AVX2 and
baseline clones) against its AVX-512 form, alternating in one run, over L distinct caches (L
layers: 30 puts the KV out of the last-level cache, 1 keeps it in).

    python -P docs/experiments/attention_decode.py --batch 64 --context 160 --layers 30 --kv bf16

SmolLM2's heads (9 query heads on 3 KV heads of 64). Prints ms a layer, the KV's GB/s and the
ratio of the two forms; the kernel is checked against the torch reference first."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from kernel_utils import make_paged_batch  # noqa: E402

from ridge.kernels import native  # noqa: E402
from ridge.kernels.attention import paged_attention_ref  # noqa: E402
from ridge.kernels.attention_native import paged_attention_native  # noqa: E402

KV = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv", choices=list(KV), default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = native.library()
    batches = [make_paged_batch([1] * args.batch, [args.context] * args.batch, num_heads=9, num_kv_heads=3,
                                head_dim=64, kv_dtype=KV[args.kv], q_dtype=torch.float32, seed=i)
               for i in range(args.layers)]

    def run() -> None:
        for b in batches:
            paged_attention_native(b.q, b.k_cache, b.v_cache, b.k_scale, b.v_scale, b.meta, 0.125)

    forms = [1] + ([2] if lib.paged_attention_wide() else [])
    times = {f: [] for f in forms}
    b = batches[0]
    for form in forms:
        lib.paged_attention_isa(form)
        got = paged_attention_native(b.q, b.k_cache, b.v_cache, b.k_scale, b.v_scale, b.meta, 0.125)
        want = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.k_scale, b.v_scale, b.meta, 0.125)
        assert (got - want).abs().max().item() < 1e-4
        for _ in range(3):
            run()
    for _ in range(args.rounds):
        for form in forms:
            lib.paged_attention_isa(form)
            t0 = time.perf_counter()
            run()
            times[form].append((time.perf_counter() - t0) / args.layers)
    lib.paged_attention_isa(2)
    kv_bytes = args.batch * (args.context + 1) * 3 * 64 * 2 * b.k_cache.element_size()
    med = {f: sorted(t)[len(t) // 2] for f, t in times.items()}
    for f, t in med.items():
        print(f"{'generic' if f == 1 else 'avx512'}: {t * 1e3:.3f} ms a layer, {kv_bytes / t / 1e9:.1f} GB/s of KV")
    if len(med) == 2:
        print(f"avx512 / generic: {med[1] / med[2]:.2f}x")


if __name__ == "__main__":
    main()
