"""Request-level figures for monitoring: histograms of TTFT, inter-token
latency, end-to-end latency, queue time and request lengths, and finished
requests by reason. Each finished request (each sample, when n > 1) is
observed once, on the engine thread, where its token times are; the stats
carry the counts (docs/protocol.md §7.2) and an exporter turns them into
Prometheus histograms (the gateway's /metrics). The buckets are vLLM's, so
that the same dashboards read them."""
from __future__ import annotations

from bisect import bisect_left

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    """Counts per bucket: counts[i] holds the observations x with bounds[i-1] < x <= bounds[i];
    the last one those above every bound (Prometheus' +Inf)."""
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, x: float) -> None:
        self.counts[bisect_left(self.bounds, x)] += 1
        self.sum += x

    def as_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum,
                "count": sum(self.counts)}


class RequestMetrics:
    def __init__(self):
        self.histograms = {"ttft_s": Histogram(TTFT_BUCKETS), "itl_s": Histogram(ITL_BUCKETS),
                           "e2e_s": Histogram(LATENCY_BUCKETS), "queue_s": Histogram(LATENCY_BUCKETS),
                           "prompt_tokens": Histogram(TOKEN_BUCKETS), "generation_tokens": Histogram(TOKEN_BUCKETS)}
        self.finished = dict.fromkeys(FINISH_REASONS, 0)

    def observe(self, req) -> None:
        """A finished request (one sample)."""
        t, h = req.timings, self.histograms
        self.finished[str(req.finish_reason)] += 1
        if t.ttft is not None:
            h["ttft_s"].observe(t.ttft)
        if t.queue is not None:
            h["queue_s"].observe(t.queue)
        if t.finished is not None:
            h["e2e_s"].observe(t.finished - t.arrival)
        times = t.token_times
        for a, b in zip(times, times[1:]):  # tokens of one step share a time: a speculative step's come at 0
            h["itl_s"].observe(b - a)
        h["prompt_tokens"].observe(req.num_prompt_tokens)
        h["generation_tokens"].observe(len(req.output_token_ids))

    def as_dict(self) -> dict:
        return {"finished": dict(self.finished), "histograms": {k: v.as_dict() for k, v in self.histograms.items()}}
