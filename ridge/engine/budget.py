"""The default token budget of a step: a small multiple of the knee T*
(ridge.plan.token_budget_knee), below which extra tokens ride along almost free."""
from __future__ import annotations

import time

import torch

from ridge.plan import local_device_spec, token_budget_knee

BUDGET_MULTIPLE = 2  # the prefill chunk, in units of T*
MIN_BUDGET, MAX_BUDGET = 64, 8192


def measure_cpu_ridge_point() -> float:
    """FLOP/s of a mid-size fp32 GEMM over bytes/s of a large GEMV, on this CPU."""
    a = torch.randn(384, 1024)
    b = torch.randn(1024, 1024)
    w = torch.randn(4096, 2048)
    x = torch.randn(2048)
    torch.mm(a, b), torch.mv(w, x)  # warm-up
    t0 = time.perf_counter()
    for _ in range(4):
        torch.mm(a, b)
    flops = 4 * 2 * 384 * 1024 * 1024 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(4):
        torch.mv(w, x)
    bw = 4 * w.numel() * 4 / (time.perf_counter() - t0)
    return flops / bw


def ridge_point(device: torch.device, fp8: bool) -> tuple[float, str]:
    """-> (FLOPs per byte, where the figure came from)."""
    if device.type == "cuda":
        spec = local_device_spec()
        if spec is not None:
            kind = "fp8" if fp8 and spec.fp8_tflops else "bf16"
            return spec.ridge_point(kind), f"{spec.name} ({kind}, plan table)"
        return 300.0, "unknown GPU (assumed 300)"
    return measure_cpu_ridge_point(), "measured on this CPU"


def default_token_budget(device: torch.device, bytes_per_weight: float, fp8: bool,
                         given_ridge: float | None = None, experts: tuple[int, int] | None = None) -> tuple[int, dict]:
    """-> (the prefill chunk, how it was reached). experts: (E, k) of a mixture of experts, whose
    chunk is the dense one times E / k (moe_prefill_chunk)."""
    ridge, source = (given_ridge, "configured") if given_ridge else ridge_point(device, fp8)
    knee = token_budget_knee(ridge, bytes_per_weight)
    budget = int(min(max(BUDGET_MULTIPLE * knee, MIN_BUDGET), MAX_BUDGET))
    budget = -(-budget // 16) * 16
    info = {"ridge_point": ridge, "ridge_source": source, "knee_tokens": knee, "budget": budget}
    if experts:
        budget = info["budget"] = moe_prefill_chunk(budget, *experts)
    return budget, info


def moe_prefill_chunk(chunk: int, num_experts: int, top_k: int) -> int:
    """A mixture of experts' prefill chunk: the dense chunk times E / k, up to MAX_BUDGET. A
    chunk of T tokens gives each expert about T k / E rows, so a dense-sized chunk leaves every
    expert's product a few rows and reads every expert's bytes again each step; E / k times the
    tokens gives each expert the rows a dense layer's product sees at the dense chunk (the step
    stays as far from the ridge point as a dense step). Measured on CPU (docs/benchmarks.md)."""
    return int(min(max(chunk, -(-chunk * num_experts // top_k // 16) * 16), MAX_BUDGET))


def pooled_token_budget(chunk: int, max_num_seqs: int) -> int:
    """An embedding engine's step (and its prefill chunk): whole prefills of every sequence it
    holds, up to MAX_BUDGET. Its requests keep no KV and no decode waits behind a long step, so
    the chunk that bounds a generating engine's step for latency would only split a batch into
    many small steps, each paying the per-step and per-layer costs again (issue 28: 64 inputs
    of 16-64 tokens took 20 steps of 128 tokens, 3.4x the time of one step of all 2527)."""
    return int(min(max(max_num_seqs * chunk, chunk), MAX_BUDGET))
