"""The daemon as a real process (`ridge serve` on a tiny GGUF model, engine
threads 1) on a temporary ipc endpoint, driven through real ZeroMQ sockets.

One daemon serves the whole module; tests run in file order and the last one
checks that every KV block came back."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from test_daemon_harness import HEARTBEAT, ROOT, Daemon, Raw, pack, pump_all, stats, wait_idle
from tiny_models import make_tiny

MAX_PER_CLIENT, MAX_QUEUE = 128, 200
CLIENT_TIMEOUT = 3.0
PROTOCOL_MD = (ROOT / "docs" / "protocol.md").read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path, _, _ = make_tiny(tmp_path_factory.mktemp("model"), "llama")
    return str(path)


@pytest.fixture(scope="module")
def notify(tmp_path_factory):
    path = tmp_path_factory.mktemp("notify") / "n.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    yield s, str(path)
    s.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model, notify):
    tmp = tmp_path_factory.mktemp("daemon")
    d = Daemon(tmp, model, "--num-kv-blocks", 1024, "--max-num-seqs", 64, "--max-requests-per-client", MAX_PER_CLIENT,
               "--max-queue", MAX_QUEUE, "--tcp", f"tcp://127.0.0.1:{free_port()}", "--client-timeout", CLIENT_TIMEOUT,
               env_extra={"NOTIFY_SOCKET": notify[1], "WATCHDOG_USEC": 400_000})
    d.tcp = next(a for a in d.proc.args if str(a).startswith("tcp://"))
    yield d
    rc = d.stop()
    assert rc == 0, d.output()


@pytest.fixture()
def raw(daemon):
    c = Raw(daemon.endpoint)
    yield c
    c.close()


# -- hello, security, systemd ------------------------------------------------------------
def test_hello_model_info_and_socket_modes(daemon, raw):
    h = raw.call({"type": "hello", "id": "h", "versions": [1, 7], "client": "test"})
    assert h["type"] == "hello" and h["version"] == 1 and h["supported"] == [1, 2, 3, 4, 5] and h["state"] == "ok"
    assert h["v"] == 1  # answered in the version it was asked in
    m = h["model"]
    assert m["name"] == "tiny-llama" and m["arch"] == "llama" and m["block_size"] == 16
    from ridge.kernels import native

    kv = "bf16" if native.library() else "fp32"  # the CPU default, by measurement
    assert m["num_kv_blocks"] == 1024 and m["kv_dtype"] == kv and m["fp8_weights"] is False
    assert m["ridge_point"] > 0 and m["max_model_len"] == 256
    assert h["limits"]["max_requests_per_client"] == MAX_PER_CLIENT and h["limits"]["max_tokens"] == 256
    assert h["heartbeat"]["interval"] == HEARTBEAT
    sock_path = daemon.endpoint[len("ipc://"):]
    assert stat.S_IMODE(os.stat(os.path.dirname(sock_path)).st_mode) == 0o700  # the user socket directory
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    assert raw.call({"type": "hello", "id": "h2", "versions": [6, 7]})["code"] == "unsupported_version"


def test_sd_notify_ready_status_watchdog(daemon, notify):
    s, _ = notify
    s.settimeout(0.2)
    seen = set()
    deadline = time.monotonic() + 10
    while not {"READY=1", "STATUS", "WATCHDOG=1"} <= seen and time.monotonic() < deadline:
        try:
            data = s.recv(4096).decode()
        except TimeoutError:
            continue
        for line in data.splitlines():
            seen.add(line.split("=")[0] if line.startswith("STATUS=") else line)
    assert {"READY=1", "STATUS", "WATCHDOG=1"} <= seen


def test_tcp_loopback_serves(daemon):
    c = Raw(daemon.tcp)
    try:
        assert c.call({"type": "health", "id": "t"})["status"] == "ok"
    finally:
        c.close()


def test_tcp_non_loopback_refused_without_curve(daemon, model, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ridge.cli", "serve", "--model", model, "--endpoint",
                        f"ipc://{tmp_path}/x.sock", "--tcp", f"tcp://0.0.0.0:{free_port()}"],
                       env=daemon.env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and "CURVE" in r.stderr, r.stderr


def test_second_daemon_on_the_endpoint_refuses(daemon, model):
    second = Daemon(daemon.tmp, model, wait=False)
    rc = second.proc.wait(60)
    out = second.output()
    second.log.close()
    assert rc == 1 and "already serving" in out, out
    c = Raw(daemon.endpoint)  # the first one is untouched
    assert c.call({"type": "health", "id": "x"})["status"] == "ok"
    c.close()


# -- streaming under load --------------------------------------------------------------------
def test_64_concurrent_streams_exact_counts_and_health_stays_fast(daemon):
    clients = [Raw(daemon.endpoint) for _ in range(64)]
    want = {}
    for i, c in enumerate(clients):
        want[i] = 20 + (i * 7) % 100
        c.generate(f"s{i}", prompt=f"hello world {i}", params={"max_tokens": want[i], "ignore_eos": True})
    pinger = Raw(daemon.endpoint)
    rtts, sent = [], {}

    def ping():
        if not sent:
            sent[len(rtts)] = time.perf_counter()
            pinger.send({"type": "health", "id": f"p{len(rtts)}"})
        while pinger.sock.poll(0):
            msg = msgpack.unpackb(pinger.sock.recv())
            if msg.get("type") == "health":
                rtts.append(time.perf_counter() - sent.pop(int(msg["id"][1:])))
        return all(not c.open for c in clients)

    pump_all(clients, ping, timeout=120)
    for i, c in enumerate(clients):
        s = c.streams[f"s{i}"]
        f = s["final"]
        assert f is not None, s["error"]
        assert len(s["tokens"]) == want[i] == f["usage"]["completion_tokens"]
        assert f["finish_reason"] == "length" and f["choices"][0]["finish_reason"] == "length"
        assert set(f["timings"]) == {"queue", "ttft", "decode_tps", "e2e"}
        c.close()
    pinger.close()
    assert rtts and max(rtts) < 1.0, rtts  # the socket thread answers while the engine is busy


def test_10_of_100_aborted_mid_stream_others_unaffected(daemon):
    clients = [Raw(daemon.endpoint) for _ in range(10)]
    n_tokens = 150
    for k, c in enumerate(clients):
        for j in range(10):
            c.generate(f"c{k}-{j}", prompt=f"story {k} {j}", params={"max_tokens": n_tokens, "ignore_eos": True})
    victims = {f"c{k}-{k}" for k in range(10)}
    aborted = set()

    def on_frame(c, msg):
        if msg["type"] == "delta" and msg["id"] in victims and msg["id"] not in aborted:
            aborted.add(msg["id"])
            c.send({"type": "abort", "id": msg["id"]})

    pump_all(clients, lambda: all(not c.open for c in clients), timeout=120, on_frame=on_frame)
    for c in clients:
        for rid, s in c.streams.items():
            f = s["final"]
            assert f is not None, s["error"]
            assert len(s["tokens"]) == f["usage"]["completion_tokens"]
            if rid in victims:
                assert f["finish_reason"] == "abort" and len(s["tokens"]) < n_tokens, (rid, len(s["tokens"]))
            else:
                assert f["finish_reason"] == "length" and len(s["tokens"]) == n_tokens, rid
        c.close()
    assert aborted == victims
    wait_idle(daemon.endpoint)


KILLED_CLIENT = """
import sys, msgpack, zmq
s = zmq.Context().socket(zmq.DEALER)
s.connect(sys.argv[1])
for i in range(32):
    s.send(msgpack.packb({"v": 1, "type": "generate", "id": f"k{i}", "prompt": f"kill {i}",
                          "params": {"max_tokens": 240, "ignore_eos": True}}))
s.recv()
print("streaming", flush=True)
while True:
    s.recv()
"""


def test_sigkilled_client_has_its_blocks_freed_within_the_bound(daemon):
    before = stats(daemon.endpoint)["daemon"]["aborts"]["disconnected"]
    p = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, daemon.endpoint], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "streaming"
    deadline = time.monotonic() + 5
    while stats(daemon.endpoint)["stats"]["kv_blocks_used"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    t0 = time.monotonic()
    wait_idle(daemon.endpoint, timeout=10)
    elapsed = time.monotonic() - t0
    # docs/protocol.md §4.4: a closed connection -> aborted within heartbeat.interval + one step
    assert elapsed < HEARTBEAT + 1.0, elapsed
    assert stats(daemon.endpoint)["daemon"]["aborts"]["disconnected"] > before


# -- bad input ---------------------------------------------------------------------------------
def gen(**kw) -> dict:
    return {"v": 1, "type": "generate", "id": "g", "prompt": "hi", **kw}


def with_params(**p) -> bytes:
    return pack(gen(params=p))


BAD_UTF8 = b"\x83\xa1v\x01\xa4type\xa8tokenize\xa4text\xa2\xff\xfe"  # {"v":1,"type":"tokenize","text":<ff fe>}
DEEP = pack({"v": 1, "type": "tokenize", "text": "x", "extra": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]})
BAD = [  # (name, frames, code, id in the reply)
    ("malformed msgpack", [b"\xc1"], "bad_msgpack", None),
    ("empty frame", [b""], "bad_msgpack", None),
    ("truncated", [pack({"v": 1, "type": "health", "id": "x"})[:-2]], "bad_msgpack", None),
    ("trailing bytes", [pack({"v": 1, "type": "health"}) + b"\x00"], "bad_msgpack", None),
    ("not a map", [pack([1, 2, 3])], "bad_msgpack", None),
    ("int key", [pack({1: 2})], "bad_msgpack", None),
    ("bin value", [pack({"v": 1, "type": "tokenize", "id": "b", "text": b"abc"})], "bad_msgpack", "b"),
    ("ext value", [pack({"v": 1, "type": "health", "x": msgpack.ExtType(5, b"x")})], "bad_msgpack", None),
    ("too deep", [DEEP], "bad_msgpack", None),
    ("non-UTF-8 string", [BAD_UTF8], "bad_utf8", None),
    ("two frames", [pack({"v": 1, "type": "health"}), b"x"], "bad_frame", None),
    ("missing v", [pack({"type": "health", "id": "m"})], "missing_field", "m"),
    ("v as str", [pack({"v": "1", "type": "health", "id": "m"})], "invalid_field", "m"),
    ("future v", [pack({"v": 9, "type": "health", "id": "m"})], "unsupported_version", "m"),
    ("missing type", [pack({"v": 1, "id": "m"})], "missing_field", "m"),
    ("type not str", [pack({"v": 1, "type": 7, "id": "m"})], "invalid_field", "m"),
    ("unknown op", [pack({"v": 1, "type": "launch_missiles", "id": "m"})], "unknown_type", "m"),
    ("id too long", [pack({"v": 1, "type": "health", "id": "x" * 200})], "invalid_field", "x" * 200),
    ("id of 129 bytes on generate", [pack(gen(id="y" * 129))], "invalid_field", "y" * 129),
    ("bad UTF-8 beside a valid id", [b"\x84\xa1v\x01\xa4type\xa8generate\xa2id\xa2u8\xa6prompt\xa2\xff\xfe"],
     "bad_utf8", "u8"),
    ("heartbeat with a field", [pack({"v": 1, "type": "heartbeat", "id": "hb", "x": 1})], "invalid_field", "hb"),
    ("id not str", [pack({"v": 1, "type": "health", "id": 5})], "invalid_field", None),
    ("unknown field", [pack({"v": 1, "type": "health", "id": "m", "verbose": True})], "invalid_field", "m"),
    ("generate without id", [pack({"v": 1, "type": "generate", "prompt": "hi"})], "missing_field", None),
    ("generate without prompt", [pack({"v": 1, "type": "generate", "id": "g"})], "missing_field", "g"),
    ("prompt not str", [pack(gen(prompt=5))], "invalid_field", "g"),
    ("two prompts", [pack(gen(messages=[{"role": "user", "content": "x"}]))], "invalid_field", "g"),
    ("bad messages", [pack({"v": 1, "type": "generate", "id": "g", "messages": [{"role": 1}]})], "invalid_field", "g"),
    ("token out of vocab", [pack({"v": 1, "type": "generate", "id": "g", "prompt_token_ids": [1, 99999]})],
     "invalid_field", "g"),
    ("prompt too long", [pack({"v": 1, "type": "generate", "id": "g", "prompt_token_ids": [5] * 300})],
     "invalid_request", "g"),
    ("empty prompt", [pack(gen(prompt=""))], "invalid_request", "g"),
    ("stream not bool", [pack(gen(stream="yes"))], "invalid_field", "g"),
    ("params not map", [pack(gen(params=[1]))], "invalid_field", "g"),
    ("unknown param", [with_params(temprature=1.0)], "invalid_field", "g"),
    ("max_tokens huge", [with_params(max_tokens=10**12)], "invalid_field", "g"),
    ("max_tokens negative", [with_params(max_tokens=-1)], "invalid_field", "g"),
    ("max_tokens bool", [with_params(max_tokens=True)], "invalid_field", "g"),
    ("temperature str", [with_params(temperature="hot")], "invalid_field", "g"),
    ("temperature nan", [with_params(temperature=float("nan"))], "invalid_field", "g"),
    ("temperature inf", [with_params(temperature=float("inf"))], "invalid_field", "g"),
    ("temperature 1e9", [with_params(temperature=1e9)], "invalid_field", "g"),
    ("top_p zero", [with_params(top_p=0.0)], "invalid_field", "g"),
    ("n absurd", [with_params(n=100000)], "invalid_field", "g"),
    ("logprobs absurd", [with_params(logprobs=1000)], "invalid_field", "g"),
    ("seed negative", [with_params(seed=-3)], "invalid_field", "g"),
    ("seed too big", [with_params(seed=2**64 - 1)], "invalid_field", "g"),
    ("stop too many", [with_params(stop=["x"] * 100)], "invalid_field", "g"),
    ("stop ids out of vocab", [with_params(stop_token_ids=[10**6])], "invalid_field", "g"),
    ("65 stop ids", [with_params(stop_token_ids=[1] * 65)], "invalid_field", "g"),
    ("speculative not bool", [with_params(speculative="yes")], "invalid_field", "g"),
    ("tokenize both", [pack({"v": 1, "type": "tokenize", "id": "t", "text": "a", "messages": []})],
     "invalid_field", "t"),
    ("detokenize without ids", [pack({"v": 1, "type": "detokenize", "id": "t"})], "missing_field", "t"),
    ("detokenize bad ids", [pack({"v": 1, "type": "detokenize", "id": "t", "token_ids": [-1]})], "invalid_field", "t"),
]


@pytest.mark.parametrize("name,frames,code,rid", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_error_frame(raw, name, frames, code, rid):
    raw.send_raw(*frames)
    reply = raw.recv(10)
    assert reply["type"] == "error" and reply["v"] == 1, reply
    assert reply["code"] == code, reply
    assert reply["id"] == rid and reply["message"]
    if code == "unsupported_version":
        assert reply["supported"] == [1, 2, 3, 4, 5]


def test_oversize_frame(raw):
    raw.send_raw(pack({"v": 1, "type": "tokenize", "id": "big", "text": "x" * (1 << 20)}))
    reply = raw.recv(10)
    assert reply["code"] == "too_large" and reply["id"] is None
    assert raw.call({"type": "health", "id": "after"})["status"] == "ok"


def test_admission_limits_duplicate_per_client_and_busy(daemon):
    a, b = Raw(daemon.endpoint), Raw(daemon.endpoint)
    long = {"max_tokens": 250, "ignore_eos": True}
    a.generate("dup", prompt="x", params=long)
    a.send({"type": "generate", "id": "dup", "prompt": "x", "params": long})
    for i in range(MAX_PER_CLIENT - 1):
        a.generate(f"a{i}", prompt="x", params=long)
    a.send({"type": "generate", "id": "over", "prompt": "x", "params": long})
    errors = {}

    def on_frame(c, msg):
        if msg["type"] == "error":
            errors[msg["id"]] = msg["code"]
    try:
        pump_all([a], lambda: "over" in errors, timeout=30, on_frame=on_frame)  # a's all admitted before b's
        for i in range(MAX_QUEUE - MAX_PER_CLIENT):
            b.generate(f"b{i}", prompt="y", params=long)
        b.send({"type": "generate", "id": "busy", "prompt": "y", "params": long})
        pump_all([a, b], lambda: "busy" in errors, timeout=30, on_frame=on_frame)
    finally:
        for c in (a, b):
            for rid in c.open:
                c.send({"type": "abort", "id": rid})
    assert errors == {"dup": "duplicate_id", "over": "too_many_requests", "busy": "busy"}
    pump_all([a, b], lambda: not a.open and not b.open, timeout=60)
    a.close(), b.close()
    wait_idle(daemon.endpoint)


# -- hypothesis fuzz ---------------------------------------------------------------------------
def test_fuzz_random_frames_leave_the_daemon_serving(daemon):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    c = Raw(daemon.endpoint)
    ref = c.call({"type": "generate", "id": "ref", "prompt": "fuzz ref", "stream": False,
                  "params": {"max_tokens": 24, "ignore_eos": True}})
    scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=12)
               | st.binary(max_size=6))
    values = st.recursive(scalars, lambda v: st.lists(v, max_size=4) | st.dictionaries(st.text(max_size=6), v,
                                                                                           max_size=4), max_leaves=8)
    params = st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_k", "top_p", "n", "stop", "seed",
                                              "logprobs", "ignore_eos", "speculative", "deterministic", "bogus"]),
                             st.integers(-3, 8) | values, max_size=4)
    structured = st.fixed_dictionaries(
        {"v": st.sampled_from([1, 1, 1, 0, 2, 3, "1", None]),
         "type": st.sampled_from(["hello", "generate", "abort", "tokenize", "detokenize", "stats", "health",
                                  "heartbeat", "nope"])},
        optional={"id": st.text(max_size=10) | st.integers(-2**63, 2**64 - 1), "prompt": st.text(max_size=16) | values,
                  "messages": st.lists(st.fixed_dictionaries({"role": st.text(max_size=6),
                                                              "content": st.text(max_size=10)}), max_size=3) | values,
                  "prompt_token_ids": st.lists(st.integers(-3, 300), max_size=6), "text": st.text(max_size=12),
                  "token_ids": st.lists(st.integers(-3, 300), max_size=6) | values, "params": params,
                  "stream": st.booleans() | values, "versions": st.lists(st.integers(0, 3), max_size=3),
                  "tools": values, "tool_choice": values, "chat_template_kwargs": values})
    valid = pack({"v": 1, "type": "generate", "id": "m", "prompt": "mutate", "params": {"max_tokens": 3}})
    mutated = st.lists(st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)), min_size=1, max_size=4).map(
        lambda edits: bytes(b if all(i != j for j, _ in edits) else next(x for j, x in edits if j == i)
                            for i, b in enumerate(valid)))
    frames = st.binary(max_size=48) | structured.map(pack) | mutated
    seen = {"n": 0, "errors": 0}

    @settings(max_examples=3000, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(frames)
    def fuzz(frame):
        seen["n"] += 1
        c.send_raw(frame)
        c.send({"type": "health", "id": f"live{seen['n']}"})
        while True:
            msg = c.recv(10)
            assert isinstance(msg, dict) and msg["v"] in (1, 2, 3, 4, 5) and isinstance(msg["type"], str)
            seen["errors"] += msg["type"] == "error"
            if msg.get("id") == f"live{seen['n']}":
                assert msg["status"] == "ok"
                return

    fuzz()
    assert seen["n"] == 3000 and seen["errors"] > 1000
    wait_idle(daemon.endpoint, timeout=60)
    after = c.call({"type": "generate", "id": "ref2", "prompt": "fuzz ref", "stream": False,
                    "params": {"max_tokens": 24, "ignore_eos": True}})
    assert after["token_ids"] == ref["token_ids"] and after["text"] == ref["text"]
    assert c.call({"type": "tokenize", "id": "t", "text": "hello"})["count"] > 0
    c.close()


# -- the stats feed and the small operations ---------------------------------------------------
def test_pub_feed_carries_engine_stats_and_model_info(daemon, raw):
    hello = raw.call({"type": "hello", "id": "h"})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"stats")
    sub.connect(hello["pub_endpoint"])
    try:
        assert sub.poll(5000)
        t0 = time.monotonic()
        topic, body = sub.recv_multipart()
        sub.recv_multipart()  # a few per second
        assert time.monotonic() - t0 < 1.0
    finally:
        sub.close()
    snap = msgpack.unpackb(body)
    reply = raw.call({"type": "stats", "id": "s"})
    assert topic == b"stats" and snap["type"] == "stats" and set(snap["stats"]) == set(reply["stats"])
    for k in ("running", "waiting", "preempted", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free",
              "prefix_hit_rate", "prefill_tps", "decode_tps", "requests", "totals", "budget", "memory"):
        assert k in snap["stats"], k
    assert set(snap["stats"]["memory"]) >= {"device_total", "weights", "kv_pool", "activations", "reserve",
                                            "device_free", "host_total", "host_available", "host_rss"}
    assert {"name", "arch", "fp8_weights", "kv_dtype", "block_size", "ridge_point"} <= set(snap["model"])
    health = raw.call({"type": "health", "id": "h"})
    assert health["status"] == "ok" and health["engine_lag"] < 5 and health["model"] == "tiny-llama"


def test_tokenize_detokenize_and_non_streaming(raw):
    ids = raw.call({"type": "tokenize", "id": "t", "text": "hello there"})["token_ids"]
    assert raw.call({"type": "detokenize", "id": "d", "token_ids": ids})["text"] == "hello there"
    chat = raw.call({"type": "tokenize", "id": "c", "messages": [{"role": "user", "content": "hi"}]})
    assert chat["count"] > 3
    f = raw.call({"type": "generate", "id": "n2", "stream": False, "prompt_token_ids": ids,
                  "params": {"max_tokens": 6, "n": 2, "logprobs": 2, "ignore_eos": True, "speculative": False}})
    assert f["type"] == "final" and f["usage"]["completion_tokens"] == 12 and len(f["choices"]) == 2
    assert all(len(ch["token_ids"]) == 6 and len(ch["logprobs"]) == 6 for ch in f["choices"])
    assert f["text"] == f["choices"][0]["text"]


# -- the Python client and the CLI -------------------------------------------------------------
def test_python_client_sync_streams_and_cancels(daemon):
    from ridge.daemon.client import Client, RidgeError

    with Client(daemon.endpoint) as c:
        assert c.hello()["model"]["name"] == "tiny-llama"
        s = c.stream("hello", max_tokens=12, ignore_eos=True)
        deltas = list(s)
        assert s.final.finish_reason == "length" and len(s.token_ids) == 12 == sum(len(d.token_ids) for d in deltas)
        full = c.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=5, ignore_eos=True)
        assert len(full.token_ids) == 5 and full.usage["completion_tokens"] == 5
        before = c.stats()["daemon"]["aborts"]["client"]
        with c.stream("cancel me", max_tokens=240, ignore_eos=True) as s2:
            next(s2)
        assert c.stats()["daemon"]["aborts"]["client"] == before + 1
        with pytest.raises(RidgeError) as e:
            c.generate("x", max_tokens=10**6)
        assert e.value.code == "invalid_field"
        assert c.detokenize(c.tokenize("round trip")) == "round trip"
    wait_idle(daemon.endpoint)


def test_python_client_asyncio_concurrent_and_cancellation(daemon):
    import asyncio

    from ridge.daemon.aio_client import AsyncClient

    async def main():
        async with AsyncClient(daemon.endpoint) as c:
            await c.hello()

            async def one(i):
                s = c.stream(f"async {i}", max_tokens=10 + i, ignore_eos=True)
                n = 0
                async for d in s:
                    n += len(d.token_ids)
                return n, s.final.finish_reason

            assert await asyncio.gather(*(one(i) for i in range(8))) == [(10 + i, "length") for i in range(8)]
            before = (await c.stats())["daemon"]["aborts"]["client"]

            started = asyncio.Event()

            async def long():
                async with c.stream("cancelled", max_tokens=240, ignore_eos=True) as s:
                    async for _ in s:
                        started.set()
                        await asyncio.sleep(10)  # the cancellation lands here, outside the stream

            task = asyncio.create_task(long())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)
            assert (await c.stats())["daemon"]["aborts"]["client"] == before + 1

    asyncio.run(main())
    wait_idle(daemon.endpoint)


def _ridge(env, *argv, stdin=None):
    return subprocess.run([sys.executable, "-m", "ridge.cli", *argv], env=env, input=stdin, capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_cli_generate_status_chat(daemon):
    env = dict(daemon.env, RIDGE_ENDPOINT=daemon.endpoint)
    r = _ridge(env, "generate", "hello", "--max-tokens", "5")
    assert r.returncode == 0 and "serving tiny-llama" in r.stderr, r.stderr
    r = _ridge(env, "status")
    assert r.returncode == 0 and "tiny-llama" in r.stdout and "kv cache" in r.stdout, r.stderr
    r = _ridge(env, "status", "--json")
    assert r.returncode == 0 and '"kv_blocks_total": 1024' in r.stdout
    r = _ridge(env, "chat", "--max-tokens", "4", stdin="hello\n/reset\nagain\n/exit\n")
    assert r.returncode == 0 and "tiny-llama" in r.stdout and "(conversation cleared)" in r.stdout, r.stderr
    r = _ridge(daemon.env, "generate", "hello", "--max-tokens", "3")  # finds the user socket by itself
    assert r.returncode == 0, r.stderr


def test_response_format_through_the_daemon_and_the_cli(daemon, raw, tmp_path):
    rx = r"(yes|no), [0-9]{1,3}"
    f = raw.call({"type": "generate", "id": "rf", "stream": False, "prompt": "answer",
                  "params": {"max_tokens": 40, "n": 2, "temperature": 1.0, "seed": 3,
                             "response_format": {"type": "regex", "regex": rx}}})
    assert f["type"] == "final" and all(re.fullmatch(rx, ch["text"]) for ch in f["choices"]), f
    bad = raw.call({"type": "generate", "id": "rf2", "prompt": "x",
                    "params": {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}}})
    assert bad["type"] == "error" and bad["code"] == "invalid_field"
    assert bad["message"].startswith("params.response_format: the JSON schema does not compile")
    env = dict(daemon.env, RIDGE_ENDPOINT=daemon.endpoint)
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False, "x-guidance": {"whitespace_pattern": " ?"}}))
    r = _ridge(env, "generate", "hello", "--raw", "--max-tokens", "30", "--json-schema", str(schema))
    assert r.returncode == 0 and json.loads(r.stdout) in ({"ok": True}, {"ok": False}), (r.stdout, r.stderr)
    r = _ridge(env, "generate", "hello", "--raw", "--max-tokens", "30", "--regex", rx)
    assert r.returncode == 0 and re.fullmatch(rx, r.stdout.strip()), (r.stdout, r.stderr)
    r = _ridge(env, "generate", "hello", "--regex", "(")
    assert r.returncode == 1 and "the regex does not compile" in r.stderr, r.stderr
    wait_idle(daemon.endpoint)


def test_cli_without_a_daemon_says_so(daemon, tmp_path):
    env = dict(daemon.env, XDG_RUNTIME_DIR=str(tmp_path))
    r = _ridge(env, "generate", "hello")
    assert r.returncode == 1
    assert "no ridge daemon is running" in r.stderr and "ridge serve" in r.stderr and "--local" in r.stderr


# -- what an outside client found (issue 15) -------------------------------------------------------
def test_a_silent_client_gets_finals_when_it_times_out(daemon):
    """Defect 1: a client that keeps reading but sends nothing for client_timeout has its requests
    aborted and is told so (final, detail "timeout"), rather than seeing its streams just stop."""
    c = Raw(daemon.endpoint)
    before = stats(daemon.endpoint)["daemon"]["aborts"]["timeout"]
    # 48 x 64 samples x 240 tokens, 64 samples at a time: 11,520 steps, more than CLIENT_TIMEOUT of
    # work even at ~0.25 ms a step (4 requests once all finished in time on a faster engine).
    for i in range(48):
        c.generate(f"t{i}", prompt=f"silent {i}", params={"max_tokens": 240, "n": 64, "ignore_eos": True})
    sent = time.monotonic()
    finals = {}
    while len(finals) < 48:  # read, never send: no heartbeats
        msg = c.recv(CLIENT_TIMEOUT + 5)
        if msg["type"] in ("final", "error"):
            finals[msg["id"]] = (msg, time.monotonic() - sent)
    assert all(msg["type"] == "final" for msg, _ in finals.values())  # every request got its final
    timed_out = [(msg, elapsed) for msg, elapsed in finals.values() if msg.get("detail") == "timeout"]
    assert len(timed_out) >= 2  # 64 samples run at a time: the last ones cannot have started by then
    for msg, elapsed in timed_out:
        assert "abort" in {ch["finish_reason"] for ch in msg["choices"]}, msg  # the samples still running
        assert CLIENT_TIMEOUT <= elapsed < CLIENT_TIMEOUT + 0.25 + 1.5, elapsed  # §4.4's bound, plus slack
    assert stats(daemon.endpoint)["daemon"]["aborts"]["timeout"] == before + len(timed_out)
    c.close()
    wait_idle(daemon.endpoint)


def test_reply_order_on_one_connection(raw):
    """Defect 6: §1 now states the order. One request's frames keep their order; replies to the
    operations the socket thread answers come in the order asked, without waiting for a generate
    sent before them; tokenize and detokenize, admitted on the workers (issue 24), keep their own
    order among a connection's admissions."""
    raw.generate("o", prompt="order", params={"max_tokens": 40, "ignore_eos": True})
    for k, msg in enumerate([{"type": "health"}, {"type": "tokenize", "text": "a"}, {"type": "stats"},
                             {"type": "detokenize", "token_ids": [5]}, {"type": "hello"}]):
        raw.send({**msg, "id": f"q{k}"})
    seen = []
    while raw.open:
        raw.pump()
        seen += [m for m in raw.other if m.get("id", "").startswith("q")]
        raw.other.clear()
        time.sleep(0.01)
    answered = [m for m in seen if m["type"] in ("health", "stats", "hello")]
    admitted = [m for m in seen if m["type"] in ("tokenize", "detokenize")]
    assert [(m["id"], m["type"]) for m in answered] == [("q0", "health"), ("q2", "stats"), ("q4", "hello")]
    assert [(m["id"], m["type"]) for m in admitted] == [("q1", "tokenize"), ("q3", "detokenize")]
    s = raw.streams["o"]
    assert len(s["tokens"]) == 40 == s["final"]["usage"]["completion_tokens"]
    assert "in the order they were asked" in PROTOCOL_MD


def test_chat_roles_any_name_the_template_takes(raw):
    """Defect 6: §3.2 now says which roles are allowed: any non-empty string, and the model's chat
    template decides (this tiny model's ChatML template takes any role)."""
    roles = ["system", "user", "assistant", "tool", "narrator"]
    ok = raw.call({"type": "tokenize", "id": "r", "messages": [{"role": r, "content": "x"} for r in roles]})
    assert ok["type"] == "tokenize" and ok["count"] > 10
    bad = raw.call({"type": "tokenize", "id": "r2", "messages": [{"role": "", "content": "x"}]})
    assert bad["code"] == "invalid_field" and bad["id"] == "r2"
    assert "the model's chat template decides" in PROTOCOL_MD


def test_heartbeat_has_no_reply_unless_it_breaks_a_rule(raw):
    """Defect 6: a heartbeat is never answered, except by an error when it breaks §2 (as every message)."""
    raw.send({"type": "heartbeat"})
    raw.send({"type": "heartbeat", "id": "h-ok"})
    raw.send({"type": "heartbeat", "id": "h-bad", "extra": 1})
    raw.send({"type": "health", "id": "after"})
    replies = [raw.recv(5), raw.recv(5)]
    assert [(m["type"], m["id"]) for m in replies] == [("error", "h-bad"), ("health", "after")]
    assert replies[0]["code"] == "invalid_field"


def test_token_ids_out_of_the_vocabulary_are_invalid_field_as_documented(raw):
    """Defect 3: every token id field (prompt, stop ids, detokenize) answers invalid_field, and §5 says so."""
    vocab = raw.call({"type": "hello", "id": "h"})["model"]["vocab_size"]
    for msg in ({"type": "generate", "prompt_token_ids": [1, vocab]},
                {"type": "generate", "prompt": "x", "params": {"stop_token_ids": [vocab]}},
                {"type": "detokenize", "token_ids": [vocab]}):
        reply = raw.call({**msg, "id": "oov"})
        assert (reply["type"], reply["code"]) == ("error", "invalid_field"), reply
    rows = {line.split("|")[1].strip(" `"): line for line in PROTOCOL_MD.splitlines() if line.startswith("| `")}
    assert "vocabulary" in rows["invalid_field"] and "vocabulary" not in rows["invalid_request"]


def test_stop_token_ids_take_at_most_64_as_documented(raw):
    """Defect 2: the cap is in §3.2."""
    f = raw.call({"type": "generate", "id": "s64", "prompt": "x", "stream": False,
                  "params": {"max_tokens": 2, "stop_token_ids": list(range(64))}})
    assert f["type"] == "final"
    assert raw.call({"type": "generate", "id": "s65", "prompt": "x",
                     "params": {"stop_token_ids": list(range(65))}})["code"] == "invalid_field"
    assert "≤ 64 ids" in PROTOCOL_MD


# -- last: nothing leaked ----------------------------------------------------------------------
def test_all_kv_blocks_back_after_everything(daemon):
    s = wait_idle(daemon.endpoint)
    assert s["stats"]["kv_blocks_free"] == s["stats"]["kv_blocks_total"] == 1024
    assert s["daemon"]["in_flight"] == 0
