"""Engine-side runs of `ridge bench`: continuous against static batching on one
engine, with KV waste sampled at steady state (pure-decode fixtures are in
decode.py).

Clients are closed-loop: `in_flight` clients each submit a request, wait for
it to finish, then submit the next, so a request's TTFT starts at its own
submission (no hidden queue). Continuous batching refills a slot the step
after it frees; static batching submits `in_flight` requests at once, every
one generating the batch's longest output (padding), and submits the next
batch only when the whole batch is done. Only a request's own target length
counts as useful output."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from ridge.engine.sampling_params import SamplingParams
from .workloads import QUESTIONS, Workload, continuous_steps, percentiles, static_bound, static_steps


def make_engine(args, max_seqs: int):
    """The engine a benchmark's options describe, with room for max_seqs requests at once."""
    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine

    cfg = engine_config(args)
    cfg.max_num_seqs = max(cfg.max_num_seqs, max_seqs)
    return LLMEngine(cfg)


@dataclass
class Rec:
    index: int
    target: int
    submit: float
    times: list[float] = field(default_factory=list)  # arrival time of each output token
    finish_reason: str | None = None
    error: str | None = None


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


class WasteSampler:
    """KV slots reserved against filled, sampled after every step while at least
    half the in-flight requests run (steady state, not the ramp or the drain)."""

    def __init__(self, engine, in_flight: int):
        self.engine, self.min_live = engine, max(1, in_flight / 2)
        self.samples = self.reserved = self.filled = self.live = self.own_max = 0

    def sample(self) -> None:
        running = self.engine.scheduler.running
        if len(running) < self.min_live:
            return
        reserved, filled = self.engine.kv_waste()
        self.samples += 1
        self.reserved += reserved
        self.filled += filled
        self.live += len(running)
        self.own_max += sum(r.num_prompt_tokens + r.params.max_tokens for r in running)

    def result(self) -> dict:
        e = self.engine
        bs, max_len = e.config.block_size, e.max_model_len
        if not self.samples:
            return {"samples": 0}
        return {
            "samples": self.samples, "block_size": bs, "max_model_len": max_len,
            "mean_live": self.live / self.samples,
            "mean_reserved_slots": self.reserved / self.samples, "mean_filled_slots": self.filled / self.samples,
            # paged: the unfilled tail of each live sequence's last block
            "paged_waste_pct": 100 * (self.reserved - self.filled) / self.reserved,
            # theory: half a block per live sequence
            "half_block_pct": 100 * self.live * bs / 2 / self.reserved,
            # contiguous, each request reserving the model's whole context
            "contiguous_max_len_waste_pct": 100 * (1 - self.filled / (self.live * max_len)),
            # contiguous, each request reserving its own prompt + max_tokens (the best a
            # contiguous allocator can do when it knows max_tokens)
            "contiguous_own_max_waste_pct": 100 * (1 - self.filled / self.own_max),
        }


def _summary(mode: str, recs: list[Rec], t0: float, t1: float, steps: int, in_flight: int,
             cpu0: float | None = None) -> dict:
    useful = sum(min(len(r.times), r.target) for r in recs)
    generated = sum(len(r.times) for r in recs)
    wall = t1 - t0
    ttft = [r.times[0] - r.submit for r in recs if r.times]
    itl = [b - a for r in recs for a, b in zip(r.times[: r.target], r.times[1: r.target])]
    e2e = [r.times[r.target - 1] - r.submit for r in recs if len(r.times) >= r.target]
    return {
        "mode": mode, "in_flight": in_flight, "requests": len(recs), "steps": steps, "wall_s": wall,
        "useful_tokens": useful, "generated_tokens": generated,
        "useful_tok_s": useful / wall if wall > 0 else None,
        "generated_tok_s": generated / wall if wall > 0 else None,
        "short_requests": sum(1 for r in recs if len(r.times) < r.target),
        "errors": [r.error for r in recs if r.error][:5],
        "ttft_s": percentiles(ttft), "itl_s": percentiles(itl), "e2e_s": percentiles(e2e),
        # CPU seconds this process used per wall second: ~threads when the machine is ours,
        # lower when other processes take the cores (then the figures are not clean).
        "cpu_util": (time.process_time() - cpu0) / wall if cpu0 is not None and wall > 0 else None,
        "loadavg_end": list(os.getloadavg()),
    }


def _step(engine, live: dict[str, Rec]) -> float:
    """One engine step: stamp each live request's new tokens, drop the finished; -> the time."""
    outs = engine.step()
    now = time.perf_counter()
    for o in outs:
        r = live.get(o.request_id)
        if r is None:
            continue
        r.times.extend([now] * len(o.new_token_ids))
        if o.finished:
            r.finish_reason, r.error = o.finish_reason, o.error
            del live[o.request_id]
    return now


def run_continuous(engine, wl: Workload, in_flight: int, tag: str = "c") -> dict:
    """Closed loop: a slot is refilled as soon as its request finishes."""
    engine.scheduler.config.max_num_seqs = in_flight
    n = wl.num_requests
    recs: list[Rec | None] = [None] * n
    live: dict[str, Rec] = {}
    waste = WasteSampler(engine, in_flight)
    nxt = steps = 0

    def submit(now: float) -> None:
        nonlocal nxt
        rid = f"{tag}-{nxt}"
        engine.add_request(rid, wl.prompt_ids[nxt], greedy_params(wl.lengths[nxt]))
        live[rid] = recs[nxt] = Rec(nxt, wl.lengths[nxt], now)
        nxt += 1

    t0, cpu0 = time.perf_counter(), time.process_time()
    while nxt < min(in_flight, n):
        submit(t0)
    while live:
        now = _step(engine, live)
        steps += 1
        while len(live) < in_flight and nxt < n:
            submit(now)
        waste.sample()
    out = _summary("continuous", recs, t0, time.perf_counter(), steps, in_flight, cpu0)
    out["kv_waste"] = waste.result()
    return out


def run_static(engine, wl: Workload, in_flight: int, tag: str = "s") -> dict:
    """Fixed batches, each request padded to the batch's longest output."""
    engine.scheduler.config.max_num_seqs = in_flight
    n = wl.num_requests
    recs: list[Rec] = []
    steps = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for b in range(0, n, in_flight):
        idx = range(b, min(b + in_flight, n))
        longest = max(wl.lengths[i] for i in idx)
        now = time.perf_counter()
        live = {}
        for i in idx:
            rid = f"{tag}-{i}"
            engine.add_request(rid, wl.prompt_ids[i], greedy_params(longest))
            live[rid] = Rec(i, wl.lengths[i], now)
            recs.append(live[rid])
        while live:
            _step(engine, live)
            steps += 1
    return _summary("static", recs, t0, time.perf_counter(), steps, in_flight, cpu0)


def clean_run(fn, retries: int = 2) -> dict:
    """Run fn() -> summary; while another process took the cores (CPU use below 90%
    of the thread count), run it again, up to `retries` more times. Returns the
    first clean run, else the fastest, marked contended."""
    want = 0.9 * torch.get_num_threads()
    runs = []
    for attempt in range(1 + retries):
        r = fn(attempt)
        r["attempt"], r["clean"] = attempt, r["cpu_util"] is None or r["cpu_util"] >= want
        if r["clean"]:
            break
        runs.append(r)
    else:
        r = max(runs, key=lambda x: x["useful_tok_s"] or 0.0)
    r["contended_runs"] = [{"useful_tok_s": x["useful_tok_s"], "cpu_util": x["cpu_util"]} for x in runs if x is not r]
    return r


def compare(engine, wl: Workload, in_flight: int, static: bool = True, tag: str = "", repeat: int = 1,
            retries: int = 2) -> dict:
    """Continuous and static on the same engine and trace, beside the bound. With
    repeat > 1 the modes alternate (C, S, C, S, ...) and the best of each is kept."""
    res = {"in_flight": in_flight, "workload": wl.describe(),
           "bound": static_bound(wl.lengths, in_flight),
           "bound_with_drain": static_steps(wl.lengths, in_flight) / continuous_steps(wl.lengths, in_flight)}
    runs: dict[str, list[dict]] = {"continuous": [], "static": []}
    for i in range(repeat):
        runs["continuous"].append(clean_run(lambda a: run_continuous(engine, wl, in_flight, f"{tag}c{i}.{a}"), retries))
        if static:
            runs["static"].append(clean_run(lambda a: run_static(engine, wl, in_flight, f"{tag}s{i}.{a}"), retries))
    for mode, rs in runs.items():
        if rs:
            best = max(rs, key=lambda x: x["useful_tok_s"] or 0.0)
            best["repeats_tok_s"] = [x["useful_tok_s"] for x in rs]
            res[mode] = best
    if static:
        c, s = res["continuous"]["useful_tok_s"], res["static"]["useful_tok_s"]
        res["ratio"] = c / s if c and s else None
        res["ratio_of_bound"] = res["ratio"] / res["bound"] if res["ratio"] else None
        res["ratio_of_bound_with_drain"] = res["ratio"] / res["bound_with_drain"] if res["ratio"] else None
    return res


def warm_up(engine, n: int = 2, tokens: int = 8) -> None:
    ids = [engine.add_request(None, engine.tokenizer.encode_chat([{"role": "user", "content": q}]), greedy_params(tokens))
           for q in QUESTIONS[:n]]
    while engine.has_unfinished():
        engine.step()
    del ids
