"""Where an engine step's time goes, through the engine's own timing hook
(ridge/kernels/timing.py): the code marks its sections (norm, rope, act,
linear, kv_write, attention, embed, lm_head, batch_build, constraints,
sample, schedule, sched_update, outputs) and this installs the timer for a
`with` block.

Sections nest (lm_head holds a linear), and each name gets exclusive time: a
parent's clock stops while a child runs, so the categories add up to the step.
"other" is what no section covers: the model's Python glue between ops
(reshape, split, the layer loop), the engine's bookkeeping, and the timer's
own cost (about 1 us per section).

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

from ridge.kernels.timing import set_timer


def _cuda_sync() -> None:
    # A section may open inside a CUDA graph capture, where a synchronize is an error;
    # nothing runs there anyway.
    if not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()


class Breakdown:
    """A timer for kernels.timing: name -> context manager, with exclusive times.
    On CUDA it synchronizes at every section boundary, so that each section is
    charged with its own kernels, not the ones queued before it."""

    def __init__(self, device: torch.device, clock=time.perf_counter):
        self.clock = clock
        self.acc: dict[str, float] = defaultdict(float)
        self.total = 0.0
        self.steps = 0
        self.sync = _cuda_sync if device.type == "cuda" else (lambda: None)
        self._stack: list[str] = []  # open sections, innermost last
        self._since = 0.0  # when the innermost open section last resumed

    def _switch(self) -> float:
        """Charge the time since the last boundary to the innermost open section; -> now."""
        self.sync()
        now = self.clock()
        if self._stack:
            self.acc[self._stack[-1]] += now - self._since
        self._since = now
        return now

    @contextmanager
    def __call__(self, name: str):
        self._switch()
        self._stack.append(name)
        try:
            yield
        finally:
            self._switch()
            self._stack.pop()

    def step(self, fn):
        self.sync()
        t = self.clock()
        r = fn()
        self.sync()
        self.total += self.clock() - t
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
    bd = Breakdown(engine.device)
    previous = set_timer(bd)
    try:
        yield bd
    finally:
        set_timer(previous)
