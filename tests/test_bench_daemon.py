"""`ridge bench-daemon` end to end on a tiny model: a real daemon process against the
engine in this process, on the same trace and the same KV pool."""
from __future__ import annotations

import json

from ridge.cli import main
from tiny_models import make_tiny


def test_daemon_and_in_process_share_the_pool_size(tmp_path):
    path, _, _ = make_tiny(tmp_path, "llama")
    out = tmp_path / "bench-daemon.json"
    # The daemon sizes its pool from --kv-memory-gib; the in-process engine must take
    # the daemon's block count, not size its own from whatever memory is left.
    rc = main(["bench-daemon", "--model", str(path), "--device", "cpu", "--threads", "1", "--kv-memory-gib", "0.002",
               "--requests", "4", "--in-flight", "2", "--lengths", "fixed:5", "--rounds", "1", "--health", "20",
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["kv_blocks"]["daemon"] == res["kv_blocks"]["in_process"] > 0
    (rnd,) = res["rounds"]
    assert rnd["daemon"]["generated_tokens"] == rnd["local"]["generated_tokens"] == 4 * 5
    assert rnd["daemon"]["finish_reasons"] == {"length": 4}
    assert rnd["ratio"] > 0 and res["health"]["n"] == 20


def test_startup_times_each_start_to_its_first_health_reply(tmp_path):
    path, _, _ = make_tiny(tmp_path, "llama")
    out = tmp_path / "startup.json"
    rc = main(["bench-daemon", "--model", str(path), "--device", "cpu", "--threads", "1", "--kv-memory-gib", "0.002",
               "--startup", "2", "--json", str(out)])
    assert rc == 0
    times = json.loads(out.read_text())["startup_s"]
    assert len(times) == 2 and all(0 < t < 120 for t in times)


def test_health_under_admission_load(tmp_path):
    path, _, _ = make_tiny(tmp_path, "llama")
    out = tmp_path / "health-load.json"
    rc = main(["bench-daemon", "--model", str(path), "--device", "cpu", "--threads", "1", "--kv-memory-gib", "0.002",
               "--health-under-load", "2", "--load-seconds", "1.5", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["clients"] == 2 and res["loaded_s"]["n"] == res["round_trips"] > 20
    assert 0 < res["loaded_s"]["p50"] <= res["loaded_s"]["p99"] <= res["max_s"]
    # 512 KiB is far past the tiny model's 256 positions: each long prompt is refused (the short ones run)
    assert res["loader_replies"]["invalid_request"] > 0 and res["loader_replies"]["ok"] > 0
