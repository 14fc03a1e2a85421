"""CPU threads that follow what the rest of the machine leaves free.

torch's CPU products and ridge's C kernels run OpenMP teams with a static split
and a barrier at the end of every parallel region (hundreds per step). When
another process holds a core, the team's thread on that core waits a scheduler
slice (milliseconds) while the other spins at the barrier: measured, ridge's W1
throughput on 2 cores fell 366 -> 29-33 tok/s beside a job using 0.8 of a core:
a tenth left where the share taken was two fifths. A team no
larger than the cores left free never waits on a descheduled member, so the
loss stays proportional to the cores taken.

The rule: every SAMPLE_S of stepping, read how busy the machine was (all CPUs,
steal included: a hypervisor's neighbour is a competitor too) less this
process's own CPU time; the team is the cores left, rounded down unless
within SLACK of the next, between 1 and the configured count. It shrinks only
after two samples agree (a burst is not a tenant) and grows after one.

Only this process is ridge's: the HTTP gateways are threads in it, and a child
process is somebody's work on the same cores (a benchmark's competitor is the
bench's child). Counting children as ours once made the governor grow the team
back beside such a competitor, and a 2-thread team beside one ran at a tenth of
a 1-thread team's speed (docs/benchmarks.md, "Under contention")."""
from __future__ import annotations

import logging
import os
import time

import psutil
import torch

log = logging.getLogger("ridge.engine")
SAMPLE_S = 0.5
SLACK = 0.3  # a team may share this much of a core with others before it shrinks


def _busy_seconds() -> float:
    """CPU seconds every core has spent not idle since boot."""
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own_seconds(proc: psutil.Process) -> float:
    c = proc.cpu_times()
    return c.user + c.system


def team_size(cores: int, others: float, limit: int) -> int:
    """The team that fits beside `others` cores of foreign work."""
    free = cores - max(others, 0.0)
    return max(1, min(limit, int(free + SLACK)))


class ThreadGovernor:
    def __init__(self, limit: int, cores: int | None = None):
        self.limit = limit
        self.cores = cores or os.cpu_count() or 1
        self.threads = limit
        self._proc = psutil.Process()
        self._samples = 0
        self._t = time.monotonic()
        self._busy, self._own = _busy_seconds(), _own_seconds(self._proc)
        self._lower_votes = 0
        self.others = 0.0  # foreign cores in the last sample (ridge status / metrics)

    def tick(self) -> None:
        """Called once per step: cheap unless a sample is due."""
        now = time.monotonic()
        if now - self._t < SAMPLE_S:
            return
        try:
            busy, own = _busy_seconds(), _own_seconds(self._proc)
        except OSError:  # /proc unreadable for now (EMFILE): the sample waits, the step does not fail
            return
        self._samples += 1
        wall = now - self._t
        self.others = max(0.0, (busy - self._busy) - (own - self._own)) / wall
        self._t, self._busy, self._own = now, busy, own
        want = team_size(self.cores, self.others, self.limit)
        if want < self.threads:
            self._lower_votes += 1
            if self._lower_votes < 2:
                return
        self._lower_votes = 0
        if want != self.threads:
            log.info("CPU threads %d -> %d (other work on %.1f of %d cores)", self.threads, want,
                     self.others, self.cores)
            self.threads = want
            torch.set_num_threads(want)
