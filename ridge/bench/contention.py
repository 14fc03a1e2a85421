"""`ridge bench contention`: throughput beside a fixed competing load.

A daemon shares its machine. The competitor is another process running torch
products on `--compete-threads` threads for the whole measured run (as a second
model would); the figure is the engine's W1 continuous throughput beside it as a
share of its throughput alone, against the share of the cores the competitor left
(1 - its cores / all cores). Measured with the thread team adapting to the load
(the default, ridge/engine/threads.py) and with it fixed (--fixed-threads), in one
process, alternating."""
from __future__ import annotations

import os
import subprocess
import time

import psutil
import torch

from ridge.spawn import python

from .runs import run_continuous

# The competitor: products of a size a small model runs, until killed.
_COMPETITOR = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
while True:
    a = torch.tanh(a @ b * 1e-3)
"""


def add_contention_parser(sub, common) -> None:
    c = sub.add_parser("contention", help="throughput beside another CPU-heavy process, adaptive vs fixed threads")
    common(c)
    c.add_argument("--compete-threads", type=int, default=2, help="threads of the competing process")


class Competitor:
    """The competing process, and the cores it used while it ran."""

    def __init__(self, threads: int):
        self.threads = threads

    def __enter__(self):
        self.proc = subprocess.Popen(python("-c", _COMPETITOR, str(self.threads)),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ps = psutil.Process(self.proc.pid)
        time.sleep(1.0)  # past its import of torch: the load is steady from here on
        self.t0, c = time.monotonic(), self.ps.cpu_times()
        self.cpu0 = c.user + c.system
        return self

    def __exit__(self, *exc):
        c = self.ps.cpu_times()
        self.cores = (c.user + c.system - self.cpu0) / (time.monotonic() - self.t0)
        self.proc.kill()
        self.proc.wait()


def _run(engine, wl, in_flight: int, adaptive: bool, limit: int, governor, tag: str) -> dict:
    engine.thread_governor = governor if adaptive else None
    torch.set_num_threads(limit)
    if governor is not None:
        governor.threads = limit
    return run_continuous(engine, wl, in_flight, tag)


def run_contention(engine, wl, in_flight: int, compete_threads: int) -> dict:
    governor = engine.thread_governor
    limit = governor.limit if governor is not None else torch.get_num_threads()
    if governor is None and engine.device.type == "cpu":
        from ridge.engine.threads import ThreadGovernor
        governor = ThreadGovernor(limit)
    cores = os.cpu_count() or 1
    res: dict = {"in_flight": in_flight, "threads": limit, "cores": cores, "compete_threads": compete_threads}
    try:
        for mode, adaptive in (("adaptive", True), ("fixed", False)):
            alone = _run(engine, wl, in_flight, adaptive, limit, governor, f"ca-{mode}")
            with Competitor(compete_threads) as comp:
                beside = _run(engine, wl, in_flight, adaptive, limit, governor, f"cb-{mode}")
            left = max(0.0, 1.0 - comp.cores / cores)
            kept = beside["useful_tok_s"] / alone["useful_tok_s"] if alone["useful_tok_s"] else None
            res[mode] = {"alone_tok_s": alone["useful_tok_s"], "beside_tok_s": beside["useful_tok_s"],
                         "competitor_cores": comp.cores, "share_left": left, "kept": kept,
                         # fewer cores beside than the competitor left: ridge waited rather than ran slowly
                         "own_cores_alone": alone["cpu_util"], "own_cores_beside": beside["cpu_util"],
                         "kept_of_share": kept / left if kept is not None and left else None}
    finally:
        engine.thread_governor = governor if engine.config.adaptive_threads else None
        torch.set_num_threads(limit)
    return res


def contention_table(rep, res: dict) -> None:
    rows = [[mode, f"{r['alone_tok_s']:.1f}", f"{r['beside_tok_s']:.1f}", f"{r['competitor_cores']:.2f}",
             f"{r['own_cores_alone']:.2f} / {r['own_cores_beside']:.2f}", f"{r['share_left']:.2f}",
             f"{r['kept']:.2f}", f"{r['kept_of_share']:.2f}"]
            for mode in ("adaptive", "fixed") if (r := res.get(mode))]
    rep.table(f"W1 at {res['in_flight']} in flight beside a {res['compete_threads']}-thread torch job "
              f"({res['threads']} threads, {res['cores']} cores)",
              ["threads", "alone tok/s", "beside tok/s", "competitor cores", "ridge cores alone / beside",
               "share left", "kept", "kept / share"],
              rows)
