"""`ridge bench`: the workload generator, the static/continuous arithmetic, and one
tiny end-to-end throughput run through the real CLI on a tiny random model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ridge.bench.workloads import (QUESTIONS, SWEEP_LEVELS, continuous_steps, make_workload, output_lengths,
                                    parse_lengths, percentiles, static_bound, static_steps)


def test_w1_lengths_are_seeded_and_in_range():
    a = make_workload("W1")
    b = make_workload("W1")
    assert a.lengths == b.lengths and a.num_requests == 64 and a.law == "uniform:16-256"
    assert min(a.lengths) >= 16 and max(a.lengths) <= 256
    assert len(set(a.lengths)) > 30  # really drawn, not constant
    assert output_lengths("uniform:16-256", 64, seed=1) != a.lengths
    assert a.questions == QUESTIONS[:64] and len(set(QUESTIONS)) == len(QUESTIONS)
    # A shorter run is a prefix of the full workload, not a different draw.
    assert make_workload("W1", requests=8).lengths == a.lengths[:8]


def test_sweep_levels_share_the_mean():
    for name, spec in SWEEP_LEVELS:
        lens = output_lengths(spec, 64, seed=0)
        assert abs(np.mean(lens) - 136) < 6, (name, np.mean(lens))
    assert output_lengths("fixed:136", 5) == [136] * 5
    tail = output_lengths("lognormal:136:16-512", 64, seed=0)
    assert min(tail) >= 16 and max(tail) <= 512 and abs(np.mean(tail) - 136) < 1
    assert max(tail) > 400 and np.median(tail) < 110  # a long tail, not a spread-out uniform
    lo = output_lengths("uniform:96-176", 64)
    assert min(lo) >= 96 and max(lo) <= 176


def test_bad_length_specs():
    for bad in ("uniform:9", "gauss:1-2", "uniform:5-3", "lognormal:10:20-30", "fixed:x"):
        with pytest.raises(ValueError):
            parse_lengths(bad)


def test_static_bound_arithmetic():
    lens = [10, 20, 30, 40, 5, 5, 5, 5]
    # batches of 4: max 40 and 5 -> 45 steps; continuous at 4 slots: 120 / 4 = 30 steps
    assert static_steps(lens, 4) == 45
    assert static_bound(lens, 4) == pytest.approx(45 / 30)
    # the form: mean over batches of the longest / mean output
    assert static_bound(lens, 4) == pytest.approx(np.mean([40, 5]) / np.mean(lens))
    assert static_bound([136] * 64, 16) == 1.0
    assert static_bound(lens, 1) == 1.0
    # drain: slots refill in order, the last ones run alone
    assert continuous_steps([10, 1, 1, 1], 2) == 10
    assert continuous_steps([5, 5, 5, 5], 2) == 10
    # uniform 16-256 in batches of 16: about 1.78 in expectation (16 + 240 * 16/17) / 136
    draws = [static_bound(output_lengths("uniform:16-256", 1024, seed=s), 16) for s in range(4)]
    assert 1.70 < np.mean(draws) < 1.82
    assert 1.6 < static_bound(make_workload("W1").lengths, 16) < 1.9


def test_percentiles():
    p = percentiles([0.1, 0.2, 0.3, None])
    assert p["p50"] == pytest.approx(0.2) and p["n"] == 3
    assert percentiles([])["p50"] is None


def test_bench_throughput_end_to_end(tmp_path):
    from tiny_models import make_tiny

    from ridge.cli import main

    path, cfg, sd = make_tiny(tmp_path, "llama")
    out = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--model", str(path), "--device", "cpu", "--threads", "1",
               "--requests", "6", "--in-flight", "3", "--lengths", "uniform:3-9", "--num-kv-blocks", "64", "--retries", "0",
               "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["command"].startswith("ridge bench throughput --model")
    env = data["env"]
    from ridge.kernels import native

    # The CPU default KV dtype: bf16 where ridge's C kernels are built, fp32 without them.
    assert env["device"] == "cpu" and env["kv_dtype"] == ("bf16" if native.library() else "fp32")
    assert env["threads"] == 1
    res = data["results"]["throughput"]
    wl = res["workload"]
    assert wl["requests"] == 6 and wl["clamped"] == 0
    cont, stat = res["continuous"], res["static"]
    assert cont["useful_tokens"] == stat["useful_tokens"] == wl["useful_tokens"]
    assert cont["short_requests"] == stat["short_requests"] == 0
    # static generates padding to each batch's longest; continuous generates none
    assert cont["generated_tokens"] == wl["useful_tokens"] < stat["generated_tokens"] or \
        len(set(make_workload("W1", 6, "uniform:3-9").lengths)) == 1
    for m in (cont, stat):
        for k in ("useful_tok_s", "wall_s", "steps"):
            assert m[k] > 0
        assert m["ttft_s"]["p50"] is not None and m["itl_s"]["p99"] is not None
    assert res["bound"] >= 1.0 and res["ratio"] > 0 and "ratio_of_bound" in res
    w = cont["kv_waste"]
    assert w["samples"] > 0 and 0 <= w["paged_waste_pct"] < 100
    assert w["contiguous_max_len_waste_pct"] > w["paged_waste_pct"]


def test_bench_spec_rounds_and_greedy_match(tmp_path):
    """Every mode runs each round; speedups are per round against plain decoding, and greedy
    output with each proposer equals plain decoding's on a tiny model with fp32 KV."""
    from tiny_models import make_tiny

    from ridge.cli import main

    path, _, _ = make_tiny(tmp_path, "llama")
    out = tmp_path / "spec.json"
    rc = main(["bench", "spec", "--model", str(path), "--device", "cpu", "--threads", "1", "--num-kv-blocks", "64",
               "--proposers", "ngram,self:1", "--batches", "1,2", "--sets", "repetitive", "--max-tokens", "6",
               "--rounds", "2", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]["speculative"]
    assert [(r["batch"], r["proposer"]) for r in rows] == [(b, p) for b in (1, 2) for p in ("off", "ngram", "self:1")]
    for r in rows:
        assert len(r["tok_s_rounds"]) == len(r["speedup_rounds"]) == 2 and r["tok_s"] > 0
        assert r["greedy_match"] == 1.0
        steps = r["decode_steps_by_tokens"]
        assert steps and all(int(t) >= 1 and v["steps"] > 0 and v["ms"] > 0 for t, v in steps.items())
        if r["proposer"] == "off":
            assert all(int(t) <= r["batch"] for t in steps)  # plain decoding: a token per request per step
            assert r["speedup_rounds"] == [1.0, 1.0]
    assert any(r["drafted"] for r in rows if r["proposer"] != "off")


def test_bench_spec_times_a_server_on_the_same_prompts(tmp_path):
    """--server-url: a llama-server-style /completion endpoint gets each batch-1 prompt as
    token ids, for as many tokens as ridge's plain run made, and its row joins the table."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tiny_models import make_tiny

    from ridge.cli import main

    bodies = []

    class Completion(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(body["n_predict"]):
                self.wfile.write(b'data: {"content": "a", "stop": false}\n\n')
            self.wfile.write(b'data: {"content": "", "stop": true, "tokens_predicted": %d}\n\n' % body["n_predict"])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Completion)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        path, _, _ = make_tiny(tmp_path, "llama")
        out = tmp_path / "spec.json"
        rc = main(["bench", "spec", "--model", str(path), "--device", "cpu", "--threads", "1", "--num-kv-blocks", "64",
                   "--proposers", "ngram", "--batches", "1", "--sets", "repetitive", "--max-tokens", "6",
                   "--rounds", "1", "--server-url", f"http://127.0.0.1:{server.server_address[1]}",
                   "--json", str(out)])
    finally:
        server.shutdown()
    assert rc == 0
    rows = json.loads(out.read_text())["results"]["speculative"]
    assert [r["proposer"] for r in rows] == ["off", "ngram", "llama-server"]
    assert rows[2]["tok_s"] > 0
    timed = bodies[1:]  # the first request is the warm-up
    assert len(timed) == 6 and all(isinstance(b["prompt"], list) and b["ignore_eos"] for b in timed)
    assert all(b["n_predict"] == 6 for b in timed)  # ridge's plain outputs: the seeded tiny model runs to max_tokens


def test_bench_overhead_end_to_end(tmp_path):
    """Each row: the step against its products alone, both medians, the products run
    the way the step ran (its layers in one C call on CPU), and the step's breakdown adding up."""
    from tiny_models import make_tiny

    from ridge.cli import main

    path, _, _ = make_tiny(tmp_path, "llama")
    out = tmp_path / "overhead.json"
    # 3 x 40 prompt tokens need several steps at --max-num-seqs 4 (a 68-token budget): the fixture
    # must fill the batch within the step buffers the engine sized at start-up.
    rc = main(["bench", "overhead", "--model", str(path), "--device", "cpu", "--threads", "1", "--num-kv-blocks", "64",
               "--max-num-seqs", "4", "--batches", "1,3", "--context", "40", "--steps", "3", "--retries", "0",
               "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]["overhead"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        # the tiny llama's layers run in one C call (kernels/decoder_native.py), timed against the
        # same step one op at a time
        assert r["mode"] == "one call" and r["step_ms"] > 0 and r["matmul_ms"] > 0 and r["per_op_step_ms"] > 0
        assert r["overhead_pct"] == pytest.approx(100 * (r["step_ms"] / r["matmul_ms"] - 1))
        bd = r["breakdown_ms"]
        assert {"linear", "layers", "schedule", "other", "total"} <= set(bd)
        assert sum(v for k, v in bd.items() if k != "total") == pytest.approx(bd["total"])
    # What a step reads: the weights as held once, plus each sequence's KV; its rate against the
    # machine's read bandwidth (measured with the same thread team).
    from ridge.bench.decode import weights_read
    from ridge.models.loader import load_model

    lm = load_model(path, device="cpu", show_progress=False)
    held = sum(t.numel() * t.element_size() for m in lm.model.modules() if hasattr(m, "cpu") and m.cpu is not None
               and type(m).__name__ == "FP8Linear" for t in (m.cpu.packed, m.cpu.scale))
    assert weights_read(lm.model) == held  # packed bytes and scales, a tied head once
    env = json.loads(out.read_text())["env"]
    assert env["last_level_cache_mib"] is None or env["last_level_cache_mib"] > 0
    for r in rows:
        assert r["read_bytes_per_token"] * r["batch"] > held
        assert r["of_bandwidth"] == pytest.approx(r["read_gbs"] * 1e9 / (env["read_bandwidth_gbs"] * 1e9))


@pytest.mark.parametrize("interleave", [False, True])
def test_bench_host_end_to_end(tmp_path, interleave):
    """A row per context with the host parts adding up to the host time; interleaved, each
    context on its own engine over the one model."""
    from tiny_models import make_tiny

    from ridge.bench.host import HOST_PARTS
    from ridge.cli import main

    path, _, _ = make_tiny(tmp_path, "llama")
    out = tmp_path / "host.json"
    rc = main(["bench", "host", "--model", str(path), "--device", "cpu", "--threads", "1", "--num-kv-blocks", "96",
               "--no-kv-disk", "--max-num-seqs", "4", "--batch", "3", "--contexts", "40,120", "--steps", "2",
               "--json", str(out)] + (["--interleave"] if interleave else []))
    assert rc == 0
    rows = json.loads(out.read_text())["results"]["host"]
    assert [r["context"] for r in rows] == [40, 120]
    for r in rows:
        assert set(r["parts_ms"]) == set(HOST_PARTS) and all(v > 0 for v in r["parts_ms"].values())
        assert r["host_ms"] == pytest.approx(sum(r["parts_ms"].values())) and r["step_ms"] > r["host_ms"]
        assert r["mean_context"] >= r["context"]
    assert rows[0]["host_vs_first"] == 1.0


def test_bench_hashing_end_to_end(tmp_path):
    """The lookup rows time a full hit (the bench asserts it), the decode row both hashes."""
    from ridge.cli import main

    out = tmp_path / "hashing.json"
    rc = main(["bench", "hashing", "--prompts", "64,256", "--batch", "4", "--context", "40", "--steps", "20",
               "--repeat", "2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert [(r["tokens"], r["blocks"]) for r in res["lookup"]] == [(64, 4), (256, 16)]
    assert all(r[k] > 0 for r in res["lookup"] for k in ("chain_ms", "lookup_ms", "again_ms", "former_lookup_ms"))
    assert res["decode"]["keyed_ms"] > 0 and res["decode"]["python_hash_ms"] > 0


def test_bench_recurrent_end_to_end(tmp_path):
    """`ridge bench recurrent`: every op timed by each backend the CPU has (the reference, and the C
    kernels where built), at decode and in a prefill chunk, with tiny shapes."""
    from ridge.cli import main
    from ridge.kernels import native

    out = tmp_path / "recurrent.json"
    rc = main(["bench", "recurrent", "--batches", "1,3", "--prefill", "20", "--steps", "2", "--k-heads", "2",
               "--v-heads", "4", "--k-dim", "16", "--v-dim", "16", "--ssd-heads", "4", "--ssd-head-dim", "8",
               "--ssd-state", "16", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]["recurrent"]["rows"]
    assert [(r["requests"], r["tokens_each"]) for r in rows] == [(1, 1)] * 3 + [(3, 1)] * 3 + [(1, 20)] * 3
    backends = ["torch reference"] + (["C (ops)"] if native.library() is not None else [])
    assert all(r[b] > 0 for r in rows for b in backends)


def test_server_bench_says_how_to_run_a_spinning_peer(tmp_path):
    """ridge's thread governor reads a peer's spinning idle threads as other work (issue 45): with
    the governor on, the server table says to run llama-server with --poll 0 or ridge with
    --fixed-threads; with the team fixed it says nothing."""
    from argparse import Namespace

    from engine_utils import make_engine
    from ridge.bench.command import _peer_note
    from ridge.models.loader import load_model
    from tiny_models import make_tiny

    path, _, _ = make_tiny(tmp_path, "llama")
    loaded = load_model(path, device="cpu", use_cache=False)
    note = _peer_note(make_engine(loaded), Namespace(api="llama"))
    assert "--poll 0" in note and "--fixed-threads" in note
    assert "--poll" not in _peer_note(make_engine(loaded), Namespace(api="openai"))
    assert _peer_note(make_engine(loaded, adaptive_threads=False), Namespace(api="llama")) is None


def test_the_header_says_when_the_large_steps_run_in_bf16_on_amx():
    """A figure taken with --cpu-amx on an AMX machine is labelled so (its activations past the
    streaming sizes are bf16, not fp32): the env records the mode and the header prints it."""
    from ridge.bench.report import Report

    rep = Report("ridge bench overhead")
    rep.data["env"].update(device="cpu", cpu_fp8_max_tokens=8, cpu_amx="decode")
    assert "cpu-amx=decode" in rep.header()
    rep.data["env"]["cpu_amx"] = "off"
    assert "cpu-amx" not in rep.header()
    rep.data["env"]["cpu_amx"] = True  # a file from before the modes: --cpu-amx ran every step on AMX
    assert "cpu-amx=all" in rep.header()


def test_a_steps_read_counts_the_experts_its_rows_reach(tmp_path):
    """Of a mixture of experts a one-row step reads k of E experts; a step of more rows the share
    uniform routing reaches, all of them in the limit (the dense weights always, in full)."""
    from ridge.bench.decode import weights_read
    from ridge.models.loader import load_model
    from ridge.quant.experts import FP8Experts
    from test_families import build_hf
    from test_moe import VARIANTS

    _, path = build_hf(tmp_path, "qwen3_moe", VARIANTS["qwen3_moe"][1])
    lm = load_model(path, device="cpu", use_cache=False, show_progress=False)
    layers = [m for m in lm.model.modules()
              if hasattr(m, "router") and isinstance(getattr(m, "experts", None), FP8Experts)]
    k, E = layers[0].router.k, layers[0].experts.shapes["gate_up_proj"][0]
    every = weights_read(lm.model, 10 ** 6)
    one = weights_read(lm.model, 1)
    experts = sum(t.numel() * t.element_size() for m in layers for t in m.experts._buffers.values()
                  if t is not None)
    assert one == pytest.approx(every - experts * (1 - k / E), rel=1e-6)
    assert one < weights_read(lm.model, 4) < every
