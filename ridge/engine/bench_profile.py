"""Where an engine step's time goes: timers wrapped around the engine's own calls
for the duration of a `with` block (bench process only; everything is restored
on exit). The categories add up to the step; "other" is what no timer covers:
the model's Python glue between ops (reshape, split, the layer loop), the
engine's bookkeeping, and the timers' own cost (about 1 us per call).

    with step_breakdown(engine) as bd:
        for _ in range(4):
            bd.step(engine.step)
    bd.per_step_ms()  # {"linear": .., "attention": .., ..., "other": .., "total": ..}
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

_MISSING = object()


class Breakdown:
    def __init__(self, device: torch.device):
        self.acc: dict[str, float] = defaultdict(float)
        self.total = 0.0
        self.steps = 0
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._patches: list[tuple[object, str, object]] = []

    def timed(self, key, fn):
        acc, sync = self.acc, self.sync

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                acc[key(a) if callable(key) else key] += time.perf_counter() - t
        return wrapper

    def patch(self, obj, name: str, key) -> None:
        before = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        setattr(obj, name, self.timed(key, getattr(obj, name)))
        self._patches.append((obj, name, before))

    def restore(self) -> None:
        for obj, name, before in reversed(self._patches):
            if before is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
        self._patches.clear()

    def step(self, fn):
        t = time.perf_counter()
        r = fn()
        self.sync()
        self.total += time.perf_counter() - t
        self.steps += 1
        return r

    def per_step_ms(self) -> dict:
        if not self.steps:
            return {}
        out = {k: 1e3 * v / self.steps for k, v in sorted(self.acc.items(), key=lambda kv: -kv[1])}
        out["other"] = 1e3 * self.total / self.steps - sum(out.values())
        out["total"] = 1e3 * self.total / self.steps
        return out


@contextmanager
def step_breakdown(engine):
    from ridge.engine import runner as runner_mod
    from ridge.kernels import ops
    from ridge.quant.linear import FP8Linear

    bd = Breakdown(engine.device)
    model = engine.model
    lm_head = model.lm_head
    try:
        for name, key in (("rms_norm", "norm"), ("rope", "rope"), ("silu_and_mul", "act"),
                          ("write_kv", "kv_write"), ("paged_attention", "attention")):
            bd.patch(ops, name, key)
        bd.patch(FP8Linear, "forward", lambda a: "lm_head" if a[0] is lm_head else "linear")
        bd.patch(model.embed_tokens, "forward", "embed")
        bd.patch(runner_mod, "StepBatch", "batch_build")
        bd.patch(engine.runner.sampler, "sample", "sample")
        bd.patch(engine.scheduler, "schedule", "schedule")
        bd.patch(engine.scheduler, "update", "sched_update")
        bd.patch(engine, "_postprocess", "outputs")
        yield bd
    finally:
        bd.restore()
