"""`GET /metrics`: the daemon's stats reply (docs/protocol.md §7.2-7.3) in the
Prometheus text format, under vLLM's metric names with a `ridge:` prefix
where vLLM has one (so that its dashboards read ridge), and `ridge:` names of
ridge's own for the rest. Every scrape asks the daemon for a fresh snapshot;
nothing is kept between scrapes but the gateway's own request counts."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# stats["histograms"] key -> (metric name, help); vLLM's names
HISTOGRAMS = {
    "ttft_s": ("ridge:time_to_first_token_seconds", "Time to first token (arrival to first token)."),
    "itl_s": ("ridge:inter_token_latency_seconds", "Time between a request's consecutive tokens."),
    "e2e_s": ("ridge:e2e_request_latency_seconds", "End-to-end request latency (arrival to finish)."),
    "queue_s": ("ridge:request_queue_time_seconds", "Time a request waited before it was first scheduled."),
    "prompt_tokens": ("ridge:request_prompt_tokens", "Prompt tokens per finished request."),
    "generation_tokens": ("ridge:request_generation_tokens", "Generated tokens per finished request."),
}


def _histogram(name: str, doc: str, h: dict, labels: list[str]) -> HistogramMetricFamily:
    m = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip(h["bounds"] + [float("inf")], h["counts"]):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    m.add_metric(labels, buckets, h["sum"])
    return m


class DaemonCollector:
    """Metric families from one stats reply; `reply` is set before each scrape."""

    def __init__(self, gateway_cpu=time.process_time):
        self.reply: dict = {}
        self.gateway_cpu = gateway_cpu  # this gateway's CPU seconds (its process, or its thread in the daemon)
        self.http: dict[tuple[str, str], int] = {}  # (route, status) -> requests answered

    def count(self, route: str, status: int) -> None:
        key = (route, str(status))
        self.http[key] = self.http.get(key, 0) + 1

    def collect(self):
        yield from self._gateway()
        if not self.reply:
            return
        st, d = self.reply["stats"], self.reply["daemon"]
        lab = [self.reply["model"]["name"]]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(lab, value)
            return g

        def counter(name, doc, value, label: str | None = None):  # with a label, value maps its values
            c = CounterMetricFamily(name, doc, labels=["model_name"] + ([label] if label else []))
            for key, v in (value.items() if label else [(None, value)]):
                c.add_metric(lab + ([key] if label else []), v)
            return c

        yield gauge("ridge:num_requests_running", "Requests in the running batch.", st["running"])
        yield gauge("ridge:num_requests_waiting", "Requests waiting, preempted ones included.",
                    st["waiting"] + st["preempted"])
        yield gauge("ridge:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                    st["kv_blocks_used"] / max(1, st["kv_blocks_total"]))
        yield gauge("ridge:kv_cache_blocks_cached", "Free KV blocks that still hold a reusable prefix.",
                    st["kv_blocks_cached"])
        tot = st["totals"]
        yield counter("ridge:prompt_tokens", "Prefill tokens computed (prefix-cache hits not included).",
                      tot["prefill_tokens"])
        yield counter("ridge:generation_tokens", "Tokens generated.", tot["decode_tokens"])
        yield counter("ridge:request_success", "Finished samples, by finish reason.", st.get("finished", {}),
                      "finished_reason")
        yield counter("ridge:num_preemptions", "Requests preempted.", st["num_preemptions"])
        pc = st.get("prefix_cache", {})
        yield counter("ridge:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      pc.get("queries", 0))
        yield counter("ridge:prefix_cache_hits", "Prompt tokens found in the prefix cache.", pc.get("hits", 0))
        spec = st.get("speculative", {}).get("total", {})
        yield counter("ridge:spec_decode_num_drafts", "Verifications of drafted tokens.",
                      spec.get("verifications", 0))
        yield counter("ridge:spec_decode_num_draft_tokens", "Tokens drafted.", spec.get("drafted", 0))
        yield counter("ridge:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", spec.get("accepted", 0))
        for key, (name, doc) in HISTOGRAMS.items():
            if key in st.get("histograms", {}):
                yield _histogram(name, doc, st["histograms"][key], lab)
        yield counter("ridge:daemon_aborts", "Requests the daemon aborted, by why.", d["aborts"], "reason")
        yield counter("ridge:daemon_socket_thread_cpu_seconds", "CPU time of the daemon's socket thread.",
                      d.get("cpu_s", {}).get("socket_thread", 0.0))

    def _gateway(self):
        c = CounterMetricFamily("ridge:gateway_cpu_seconds", "CPU time of this gateway (its process, or its "
                                "thread when it runs inside the daemon).")
        c.add_metric([], self.gateway_cpu())
        yield c
        r = CounterMetricFamily("ridge:gateway_requests", "HTTP requests answered, by route and status.",
                                labels=["route", "status"])
        for (route, status), n in sorted(self.http.items()):
            r.add_metric([route, status], n)
        yield r


class Metrics:
    def __init__(self, gateway_cpu=time.process_time):
        self.collector = DaemonCollector(gateway_cpu)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total and friends, as every exporter has

    def render(self, stats_reply: dict) -> bytes:
        self.collector.reply = stats_reply
        return generate_latest(self.registry)
