"""Many models, one daemon (issue 28; docs/protocol.md §3.10): two tiny models in a models
directory, each loaded by a request that names it, unloaded after its keep_alive, swapped
under max_loaded_models = 1; an unknown name is model_not_found (404 over HTTP); a request
that comes while its model loads waits and is answered; the memory an unloaded model held
goes back (RSS on CPU)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgpack
import psutil
import pytest
import zmq

from ridge.daemon.client import Client, RidgeError
from ridge.daemon.frontend.registry import Entry, Registry, config_entries, scan
from ridge.durations import FOREVER, parse_duration
from test_daemon_harness import Daemon
from test_gateway import free_port, wait_http
from tiny_models import make_tiny

# No measurement at each load (the ridge point, the CPU format): what a test pays for is the loads.
FLAGS = ("--num-kv-blocks", 64, "--kv-host-gib", 0, "--no-kv-disk", "--weights", "fp32", "--kv-dtype", "fp32",
         "--ridge-point", 4.0, "--cpu-weight-format", "fp32", "--max-loaded-models", 1)


# -- the registry, without a daemon -------------------------------------------------------------
def test_durations_read_as_ollama_writes_them():
    assert parse_duration("5m") == 300 and parse_duration("1h30m") == 5400 and parse_duration("90s") == 90
    assert parse_duration(0) == 0 and parse_duration("2.5") == 2.5 and parse_duration("250ms") == 0.25
    assert parse_duration(-1) == parse_duration("-1") == parse_duration("-5m") == FOREVER
    for bad in ("5 minutes", "", "m", True, [1], float("nan")):
        with pytest.raises(ValueError, match="keep_alive"):
            parse_duration(bad)


def test_the_registry_is_plain_data_without_torch():
    """The registry and the duration parser it shares with the gateway load no torch (issue 40):
    the engine options a [models.NAME] table may set are read from their declarations alone."""
    code = "import sys, ridge.daemon.frontend.registry, ridge.durations; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_models_directory_and_config_entries(tmp_path):
    (tmp_path / "Qwen3-0.6B.Q4_K_M.gguf").write_bytes(b"GGUF")
    (tmp_path / "hf-model").mkdir()
    (tmp_path / "hf-model" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()  # a directory without config.json is no model
    (tmp_path / "readme.txt").write_text("")
    assert sorted(scan(tmp_path)) == ["Qwen3-0.6B", "hf-model"]
    assert scan(tmp_path / "missing") == {}
    table = {"coder": {"path": "Qwen3-0.6B.Q4_K_M.gguf", "max_model_len": 2048, "keep_alive": "10m",
                       "kv_dtype": "bf16", "speculative": "ngram"}}
    (coder,) = config_entries(table, "cfg", tmp_path).values()
    assert coder.path == str(tmp_path / "Qwen3-0.6B.Q4_K_M.gguf") and coder.keep == 600
    assert coder.options == {"max_model_len": 2048, "kv_dtype": "bf16", "speculative": "ngram"}
    with pytest.raises(ValueError, match=r"\[models.x\]: unknown key\(s\) threads"):
        config_entries({"x": {"path": "a", "threads": 2}}, "cfg", tmp_path)
    with pytest.raises(ValueError, match="path .* is required"):
        config_entries({"x": {"max_model_len": 8}}, "cfg", tmp_path)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        config_entries({"x": {"path": "a", "kv_dtype": "int3"}}, "cfg", tmp_path)
    reg = Registry(Entry("base", str(tmp_path / "hf-model"), source="default"), tmp_path, table)
    assert reg.find(None) is reg.default and reg.find("base") is reg.default
    assert reg.find("coder").source == "config" and reg.find("nope") is None
    alone = Registry(Entry("base", None, source="default"), tmp_path / "missing")
    assert alone.find("gpt-4o") is alone.default  # a one-model daemon answers any name, as it always did


# -- live daemons ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    make_tiny(d, seed=1)[0].rename(d / "alpha.gguf")
    # beta is larger, so that what it holds shows in the process's RSS: ~50 MB of fp32 weights
    make_tiny(d, seed=2, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=2,
              head_dim=64)[0].rename(d / "beta.gguf")
    (d / "broken.gguf").write_bytes(b"GGUF" + bytes(60))  # listed by its name; loading it fails
    return d


@pytest.fixture(scope="module")
def served(models_dir, tmp_path_factory):
    """max_loaded_models = 1: each load evicts the other model."""
    port = free_port()
    tmp = tmp_path_factory.mktemp("many")
    (tmp / "xdg-config" / "ridge").mkdir(parents=True)
    (tmp / "xdg-config" / "ridge" / "config.toml").write_text(
        '[models.short]\npath = "beta.gguf"\nmax_model_len = 128\nkeep_alive = "-1"\n')
    d = Daemon(tmp, str(models_dir / "alpha.gguf"), "--models-dir", models_dir, *FLAGS, "--http", f"127.0.0.1:{port}")
    d.url = f"http://127.0.0.1:{port}"
    wait_http(d.url)
    c = Client(d.endpoint, timeout=60)
    yield d, c
    c.close()
    died = d.proc.poll()
    rc = d.stop()  # a daemon that hung past stop's wait left its stacks in the log (faulthandler)
    assert died is None and rc == 0, f"the daemon {'died' if died is not None else 'did not stop'} (rc {rc}):\n" \
        + d.output()[-8000:]


def listing(c: Client) -> dict:
    return {m["name"]: m for m in c.models()["models"]}


def wait_state(c: Client, name: str, state: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (m := listing(c)[name])["state"] != state:
        assert time.monotonic() < deadline, f"{name} stayed {m['state']}, not {state}"
        time.sleep(0.05)
    return m


def dealer(d):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    return sock


def v3(sock, msg: dict) -> None:
    sock.send(msgpack.packb({"v": 3, **msg}, use_bin_type=True))


def test_each_model_loads_on_request_and_unloads_after_its_keep_alive(served):
    d, c = served
    m = listing(c)
    assert m["alpha"]["default"] and m["alpha"]["state"] == "ready" and m["alpha"]["bytes"] > 0
    assert m["beta"]["state"] == "available" and m["beta"]["bytes"] == 0 and m["beta"]["kind"] == "generate"
    assert m["alpha"]["keep_alive"] == 300 and m["short"]["keep_alive"] == -1  # the daemon's 5 minutes; its own
    first = c.generate("hello", model="beta", keep_alive=0.5, max_tokens=4, temperature=0.0, ignore_eos=True)
    loaded = listing(c)["beta"]
    assert loaded["state"] == "ready" and loaded["load_from"] in ("convert", "cache") and loaded["bytes"] > 40 << 20
    assert loaded["keep_alive"] == 0.5 and loaded["expires_at"] - time.time() < 0.6
    gone = wait_state(c, "beta", "available")
    assert gone["bytes"] == 0 and gone["parked"]  # its converted weights wait in host RAM
    again = c.generate("hello", model="beta", keep_alive=0, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert again.token_ids == first.token_ids  # the same weights, copied back, not converted
    assert listing(c)["beta"]["load_from"] == "host"
    wait_state(c, "beta", "available")  # keep_alive 0: unloaded once its request is done
    assert c.generate("hello", max_tokens=2).token_ids  # no model: the default, loaded again
    assert listing(c)["alpha"]["state"] == "ready"
    counts = c.models()["counts"]
    assert counts["loads"] == 3 and counts["unloads"] == 3


def test_an_unknown_model_is_not_found(served):
    d, c = served
    with pytest.raises(RidgeError, match="model_not_found"):
        c.generate("hello", model="nope", max_tokens=2)
    req = urllib.request.Request(d.url + "/v1/chat/completions", json.dumps(
        {"model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode(),
        {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 404
    err = json.loads(e.value.read())["error"]
    assert (err["code"], err["param"], err["type"]) == ("model_not_found", "model", "not_found_error")
    with urllib.request.urlopen(d.url + "/v1/models", timeout=30) as r:
        assert sorted(m["id"] for m in json.load(r)["data"]) == ["alpha", "beta", "broken", "short"]
    sock = dealer(d)
    try:
        sock.send(msgpack.packb({"v": 2, "type": "generate", "id": "old", "prompt": "x", "model": "beta"}))
        assert sock.poll(10000)
        err = msgpack.unpackb(sock.recv())
        assert (err["type"], err["code"]) == ("error", "invalid_field") and "version 3" in err["message"]
    finally:
        sock.close()


def test_requests_during_a_load_wait_then_succeed(served):
    d, c = served
    wait_state(c, "beta", "available")
    sock = dealer(d)
    try:
        for rid in ("a", "b"):
            v3(sock, {"type": "generate", "id": rid, "stream": False, "prompt": "hi", "model": "beta",
                      "keep_alive": 0, "params": {"max_tokens": 3, "ignore_eos": True}})
        frames: dict = {"a": [], "b": []}
        deadline = time.monotonic() + 60
        while not all(f and f[-1]["type"] in ("final", "error") for f in frames.values()):
            assert sock.poll(int(1000 * (deadline - time.monotonic()))), frames
            msg = msgpack.unpackb(sock.recv(), raw=False)
            if msg.get("id") in frames:
                frames[msg["id"]].append(msg)
        for rid, got in frames.items():
            assert got[0]["type"] == "loading" and got[0]["model"] == "beta", got
            assert got[-1]["type"] == "final" and got[-1]["choices"][0]["finish_reason"] == "length", got
    finally:
        sock.close()


def test_memory_returns_to_baseline_after_an_unload(served):
    d, c = served
    wait_state(c, "beta", "available")
    proc = psutil.Process(d.proc.pid)
    c.generate("hi", model="beta", keep_alive=-1, max_tokens=1)  # parked weights are held: measure past them
    c.generate("hi", model="beta", keep_alive=0, max_tokens=1)
    wait_state(c, "beta", "available")
    base = proc.memory_info().rss
    c.generate("hi", model="beta", keep_alive=0, max_tokens=1)  # a copy of the parked weights: a second set
    wait_state(c, "beta", "available")
    assert proc.memory_info().rss - base < 16 << 20


def test_max_loaded_models_one_swaps_them(served):
    """And a [models.NAME] table: another name for beta's file, with options of its own."""
    d, c = served
    c.generate("hi", model="short", max_tokens=2)
    m = listing(c)
    assert m["alpha"]["state"] == "available" and m["short"]["state"] == "ready"
    assert m["short"]["max_model_len"] == 128 and m["short"]["keep_alive"] == -1 and m["short"]["expires_at"] is None
    c.generate("hi", max_tokens=2)  # the default again: short is evicted, pinned or not
    m = listing(c)
    assert m["alpha"]["state"] == "ready" and m["short"]["state"] == "available"
    assert c.models()["counts"]["evictions"] >= 2


def test_ridge_models_lists_them(served, capsys):
    from ridge.cli import main

    d, c = served
    c.generate("hi", max_tokens=1, keep_alive="10m")
    assert main(["models", "--endpoint", d.endpoint]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("1 loaded of at most 1")
    rows = {line.split()[0]: line.split() for line in out[2:]}
    assert rows["alpha"][1:4] == ["*", "generate", "ready"] and rows["alpha"][6] in ("10", "9")  # minutes left
    assert rows["beta"][2].startswith("available")


def test_an_http_stream_says_its_model_is_loading(served):
    """SSE comments while the model loads (clients skip them), then the stream as ever."""
    from ridge.daemon.gateway.generation import LOADING_PEEK_S

    d, c = served
    wait_state(c, "beta", "available")
    req = urllib.request.Request(d.url + "/v1/completions", json.dumps(
        {"model": "beta", "prompt": "hi", "max_tokens": 3, "stream": True, "keep_alive": 0,
         "ignore_eos": True}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    pieces = [json.loads(e.removeprefix("data: ")) for e in events[:-1] if e.startswith("data: ")]
    assert pieces and all(p["model"] == "beta" for p in pieces)
    assert pieces[-1]["choices"][0]["finish_reason"] == "length"
    if listing(c)["beta"]["load_seconds"] > 2 * LOADING_PEEK_S:  # a load too quick to be reported is fine
        assert events[0].startswith(": loading beta: "), body


def test_a_model_that_fails_to_load_fails_its_requests_only(served):
    d, c = served
    with pytest.raises(RidgeError, match="model_load_failed") as e:
        c.generate("hi", model="broken", max_tokens=1)
    assert "broken" in e.value.message
    assert listing(c)["broken"]["state"] == "available" and c.models()["counts"]["failed"] == 1
    assert c.generate("hi", model="beta", keep_alive=0, max_tokens=1).token_ids  # the daemon serves on
