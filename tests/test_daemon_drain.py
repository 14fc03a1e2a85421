"""A daemon that serves one sequence at a time (so requests queue and take
seconds), with a short client timeout and drain grace: silent clients are
timed out, and SIGTERM drains with a final frame for every request."""
from __future__ import annotations

import signal
import time

import pytest

from test_daemon_harness import Daemon, Raw, pump_all, stats, wait_idle
from tiny_models import make_tiny

CLIENT_TIMEOUT, GRACE = 2.0, 1.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path, _, _ = make_tiny(tmp_path_factory.mktemp("model"), "llama", max_position=4096)
    d = Daemon(tmp_path_factory.mktemp("drain"), str(path), "--num-kv-blocks", 300, "--max-num-seqs", 1,
               "--client-timeout", CLIENT_TIMEOUT, "--drain-grace", GRACE)
    yield d
    d.stop()


def test_a_silent_client_is_aborted_within_client_timeout(daemon):
    silent = Raw(daemon.endpoint)
    # One at a time, 240 tokens each: 24,000 steps, far more than CLIENT_TIMEOUT even at a fast
    # machine's ~0.1 ms a step (20 requests once all finished in time on a quiet machine).
    for i in range(100):
        silent.send({"type": "generate", "id": f"q{i}", "prompt": f"quiet {i}",
                     "params": {"max_tokens": 240, "ignore_eos": True}})
    t0 = time.monotonic()  # from here on it neither reads nor sends
    # docs/protocol.md §4.4 bounds the abort and the freeing of KV blocks: client_timeout + 0.25 s +
    # one step (the 100 requests alone take far longer). The finals may then wait on a client that
    # reads nothing: its queue fills, and it is dropped once it closes or a client_timeout later.
    # How many finished before the timeout depends on the machine's speed; the rest were aborted.
    while True:
        s = stats(daemon.endpoint)
        st, elapsed = s["stats"], time.monotonic() - t0
        if s["daemon"]["aborts"]["timeout"] >= 1 and st["running"] == st["waiting"] == 0 \
                and st["kv_blocks_free"] == st["kv_blocks_total"]:
            break
        assert elapsed < CLIENT_TIMEOUT + 1.5, (elapsed, s)
        time.sleep(0.05)
    silent.close()
    wait_idle(daemon.endpoint, timeout=15)  # the closed client's held finals are released


def test_sigterm_drains_every_request_to_a_final_frame(daemon):
    clients = [Raw(daemon.endpoint) for _ in range(6)]
    late = Raw(daemon.endpoint)
    assert late.call({"type": "health", "id": "h"})["status"] == "ok"
    # The first request runs and finishes within the grace (or before the signal); the 20,000 steps
    # queued behind it take longer than that even at a fast machine's ~0.1 ms a step (240 each once
    # all finished in time; a first one of 240 missed the grace beside four other test runs).
    lengths = [48] + [4000] * (len(clients) - 1)
    for i, c in enumerate(clients):
        c.generate(f"d{i}", prompt=f"drain {i}", params={"max_tokens": lengths[i], "ignore_eos": True})
    pump_all(clients, lambda: any(s["deltas"] for c in clients for s in c.streams.values()), timeout=30)
    # Every request admitted before the signal: on a busy machine the last one was still being read
    # or validated when a first delta came. (One validated while the drain begins is now queued and
    # owed its final too: Server._admit.)
    finished = lambda: sum(s["final"] is not None for c in clients for s in c.streams.values())  # noqa: E731
    pump_all(clients, _every_call(0.05, lambda: stats(daemon.endpoint)["daemon"]["in_flight"] + finished()
                                  == len(clients)), timeout=30)
    daemon.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10  # the signal is handled between two of the engine's steps
    while late.call({"type": "health", "id": "h2"})["status"] != "draining":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    refused = late.call({"type": "generate", "id": "late", "prompt": "too late"})
    assert refused["type"] == "error" and refused["code"] == "shutting_down"
    pump_all(clients, lambda: all(not c.open for c in clients), timeout=30)
    reasons = []
    for c, n in zip(clients, lengths):
        (s,) = c.streams.values()
        assert s["error"] is None and s["final"] is not None
        f = s["final"]
        reasons.append(f["finish_reason"])
        assert len(s["tokens"]) == f["usage"]["completion_tokens"]
        if f["finish_reason"] == "abort":
            assert f["detail"] == "shutdown"
        else:
            assert f["finish_reason"] == "length" and len(s["tokens"]) == n
        assert any(m["type"] == "shutdown" and m["grace"] == GRACE for m in c.other)
        c.close()
    assert "length" in reasons and "abort" in reasons, reasons
    assert daemon.proc.wait(20) == 0, daemon.output()
    assert "draining" in daemon.output()
    late.close()


def _every_call(period: float, check):
    """`check` at most once a period (each is a new connection), False in between."""
    last = [0.0]

    def until() -> bool:
        now = time.monotonic()
        if now - last[0] < period:
            return False
        last[0] = now
        return check()
    return until
