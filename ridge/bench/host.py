"""`ridge bench host`: the host's share of a pure-decode step, per context length.

A GPU decode step of a small model takes milliseconds, so the Python around it
(schedule, plan the batch, update the requests, detokenize and emit) decides
throughput as much as the kernels do, and it must not grow with context. The
fixture holds `batch` requests that share one long prompt but for their last
tokens (a prefix-cache hit each, so even 64 x 16K tokens prefill once) and
times steps through the engine's own section hooks (bench/profile.py)."""
from __future__ import annotations

import statistics

from .profile import step_breakdown
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


def run_host(engine, batch: int, contexts: list[int], steps: int) -> list[dict]:
    if batch > engine.config.max_num_seqs:
        raise ValueError(f"--batch {batch} > --max-num-seqs {engine.config.max_num_seqs}")
    rows = []
    for ctx in contexts:
        fx = SharedPrefixDecode(engine, batch, ctx, steps, f"host{ctx}")
        try:
            fx.step()  # warm
            with step_breakdown(engine) as bd:
                for _ in range(steps):
                    bd.step(fx.step)
            ms = bd.per_step_ms()
        finally:
            fx.close()
        parts = {k: ms.get(k, 0.0) for k in HOST_PARTS}
        rows.append({"context": ctx, "mean_context": fx.context, "batch": batch, "host_ms": sum(parts.values()),
                     "parts_ms": parts, "step_ms": ms["total"]})
    base = rows[0]["host_ms"]
    for r in rows:
        r["host_vs_first"] = r["host_ms"] / base if base else None
    return rows


def host_table(rep, rows: list[dict]) -> None:
    rep.table(f"host time of a pure-decode step, batch {rows[0]['batch']} (ms a step)",
              ["context", *HOST_PARTS, "host", "x first", "step"],
              [[r["context"], *(f"{r['parts_ms'][k]:.2f}" for k in HOST_PARTS), f"{r['host_ms']:.2f}",
                f"{r['host_vs_first']:.2f}", f"{r['step_ms']:.1f}"] for r in rows],
              note="host = schedule + batch_build (plan) + sched_update + outputs (detokenize, emit)")
