"""`ridge bench host`: the host's share of a pure-decode step, per context length.

A GPU decode step of a small model takes milliseconds, so the Python around it
(schedule, plan the batch, update the requests, detokenize and emit) decides
throughput as much as the kernels do, and it must not grow with context. The
fixture holds `batch` requests that share one long prompt but for their last
tokens (a prefix-cache hit each, so even 64 x 16K tokens prefill once) and
times steps through the engine's own section hooks (bench/profile.py)."""
from __future__ import annotations

import statistics

from ridge.kernels.timing import set_timer

from .profile import Breakdown, step_breakdown
from .runs import greedy_params
from .workloads import QUESTIONS, long_prompt

# The engine's sections that are host work in a decode step ("outputs" is detokenize + emit).
HOST_PARTS = ("schedule", "batch_build", "sched_update", "outputs")


def add_host_parser(sub, common) -> None:
    h = sub.add_parser("host", help="host time of a pure-decode step per context (schedule, plan, update, emit)")
    common(h, workload=False)
    h.add_argument("--batch", type=int, default=64, help="requests in the step")
    h.add_argument("--contexts", default="512,4096", help="comma list of context lengths (tokens)")
    h.add_argument("--steps", type=int, default=16, help="timed steps per context")
    h.add_argument("--interleave", action="store_true",
                   help="each context on its own engine over the one model, their steps taken in turn: every "
                        "context's host work then follows a step of each, so what the previous step left in "
                        "the CPU caches is the same for all (a GPU's attention leaves nothing there)")


class SharedPrefixDecode:
    """`batch` requests at about `context` tokens, admitted after the first has computed the
    shared prefix, then stepping in pure decode."""

    def __init__(self, engine, batch: int, context: int, steps: int, tag: str):
        self.engine, self.batch = engine, batch
        room = engine.max_model_len - context - 2
        if room < steps + 2:
            raise ValueError(f"context {context} leaves no room to decode in {engine.max_model_len} tokens")
        params = greedy_params(room)
        self.ids = [engine.add_request(f"{tag}-0", long_prompt(engine.tokenizer, QUESTIONS[0], context), params)]
        self._until(1)
        for i in range(1, batch):
            q = QUESTIONS[i % len(QUESTIONS)] + f" ({i})"
            self.ids.append(engine.add_request(f"{tag}-{i}", long_prompt(engine.tokenizer, q, context), params))
        self._until(batch)
        self.context = statistics.mean(r.num_tokens for r in engine.scheduler.running)

    def _until(self, n: int) -> None:
        seen: set[str] = set()
        while len(seen) < n:
            for o in self.engine.step():
                if o.finished:
                    raise RuntimeError(f"fixture request {o.request_id} finished early ({o.finish_reason})")
                if o.new_token_ids:
                    seen.add(o.request_id)

    def step(self) -> None:
        outs = self.engine.step()
        if len(outs) != self.batch:
            raise RuntimeError("the fixture left pure decode (a request finished or was preempted)")

    def close(self) -> None:
        for rid in self.ids:
            self.engine.abort_request(rid)
        while self.engine.has_unfinished():
            self.engine.step()


def run_host(engine, batch: int, contexts: list[int], steps: int, interleave: bool = False) -> list[dict]:
    if batch > engine.config.max_num_seqs:
        raise ValueError(f"--batch {batch} > --max-num-seqs {engine.config.max_num_seqs}")
    rows = _interleaved(engine, batch, contexts, steps) if interleave else []
    for ctx in contexts if not interleave else ():
        fx = SharedPrefixDecode(engine, batch, ctx, steps, f"host{ctx}")
        try:
            fx.step()  # warm
            with step_breakdown(engine) as bd:
                for _ in range(steps):
                    bd.step(fx.step)
        finally:
            fx.close()
        rows.append(_row(ctx, fx, batch, bd.per_step_ms()))
    base = rows[0]["host_ms"]
    for r in rows:
        r["host_vs_first"] = r["host_ms"] / base if base else None
    return rows


def _row(ctx: int, fx: SharedPrefixDecode, batch: int, ms: dict) -> dict:
    parts = {k: ms.get(k, 0.0) for k in HOST_PARTS}
    return {"context": ctx, "mean_context": fx.context, "batch": batch, "host_ms": sum(parts.values()),
            "parts_ms": parts, "step_ms": ms["total"]}


def _interleaved(engine, batch: int, contexts: list[int], steps: int) -> list[dict]:
    """The contexts' fixtures on sibling engines (one loaded model, a KV pool each), one step of
    each in turn, each timed by its own Breakdown."""
    from dataclasses import replace

    from ridge.engine.engine import LLMEngine

    engines = {ctx: engine if i == 0 else LLMEngine(replace(engine.config), loaded=engine.loaded)
               for i, ctx in enumerate(contexts)}
    fixtures, rows = {}, []
    try:
        for ctx, e in engines.items():
            fixtures[ctx] = SharedPrefixDecode(e, batch, ctx, steps, f"hosti{ctx}")
        for fx in fixtures.values():
            fx.step()  # warm
        bds = {ctx: Breakdown(engine.device) for ctx in fixtures}
        for _ in range(steps):
            for ctx, fx in fixtures.items():
                previous = set_timer(bds[ctx])
                try:
                    bds[ctx].step(fx.step)
                finally:
                    set_timer(previous)
        rows = [_row(ctx, fx, batch, bds[ctx].per_step_ms()) for ctx, fx in fixtures.items()]
    finally:
        for fx in fixtures.values():
            fx.close()
        for e in engines.values():
            if e is not engine:
                e.close()
    return rows


def host_table(rep, rows: list[dict]) -> None:
    rep.table(f"host time of a pure-decode step, batch {rows[0]['batch']} (ms a step)",
              ["context", *HOST_PARTS, "host", "x first", "step"],
              [[r["context"], *(f"{r['parts_ms'][k]:.2f}" for k in HOST_PARTS), f"{r['host_ms']:.2f}",
                f"{r['host_vs_first']:.2f}", f"{r['step_ms']:.1f}"] for r in rows],
              note="host = schedule + batch_build (plan) + sched_update + outputs (detokenize, emit)")
