"""The CPU weight format per step size, chosen by measurement at start-up.

bf16 halves the bytes a bandwidth-bound small step reads, but AVX2 CPUs run
bf16 GEMMs far slower than fp32 at larger batch (machine-facts: 795 ms vs 124 ms
at 256 x 4096 x 4096). So both are timed on the model's own largest matrix and
bf16 is used up to the largest step size where it wins by a clear margin."""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from ridge.quant.linear import FP8Linear, bf16_linear, pack_bf16

log = logging.getLogger("ridge.engine")
SIZES = (1, 2, 4, 8, 16, 32, 64)
MIN_WEIGHT_BYTES = 64 << 20  # below this the weights sit in cache and bf16 buys nothing
MARGIN = 0.85  # bf16 must take at most this fraction of fp32's time


def keep_freed_memory() -> bool:
    """Make glibc keep freed buffers up to 32 MiB mapped instead of returning them to the
    kernel. A decode step allocates and frees the same few-MiB activations and gathered K/V
    every layer; by default each comes back as fresh pages, so every step pays a page fault
    per 4 KiB touched (SmolLM2 at batch 64: gathering K/V took 5.1 ms a layer against 1.2 ms
    with this). Process-wide and idempotent; False where libc is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 256 << 20))


def _time(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_crossover(model) -> tuple[int, dict]:
    """-> (largest step size that runs bf16, {size: (fp32 s, bf16 s)})."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear) and m.weight.numel()]
    w = max(layers, key=lambda m: m.weight.numel()).weight
    wb = pack_bf16(w.to(torch.bfloat16))
    times, best = {}, 0
    for n in SIZES:
        x = torch.randn(n, w.shape[1])
        xb = x.to(torch.bfloat16)
        t32 = _time(lambda: F.linear(x, w))
        t16 = _time(lambda: bf16_linear(xb, wb))
        times[n] = (t32, t16)
        if t16 > MARGIN * t32:
            break
        best = n
    return best, times


def choose_cpu_format(model, weight_bytes: int, mode: str = "auto") -> int:
    """Enable the bf16 small-step copy on every linear layer; -> its token limit (0 = off)."""
    if mode == "fp32" or model.cos_sin.device.type != "cpu" or (mode == "auto" and weight_bytes < MIN_WEIGHT_BYTES):
        return 0
    limit, times = measure_crossover(model) if mode == "auto" else (int(mode.split(":")[1]), {})
    for m in model.modules():
        if isinstance(m, FP8Linear):
            m.enable_lowp(limit)
    log.info("CPU weights: bf16 for steps of <= %d tokens, fp32 above (%s)", limit,
             ", ".join(f"{n}: {a * 1e3:.1f}/{b * 1e3:.1f} ms" for n, (a, b) in times.items()))
    return limit
