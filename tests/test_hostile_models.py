"""Model files no client can use against the daemon (issue 38): a listing never reads a file on
the socket thread, so a FIFO named x.gguf or a GGUF header that declares more than it holds
stalls no one; a GGUF header is walked within bounds before anything believes it; the models
directory serves only what its own users put there (no links out, nothing others can write);
the converted-weights cache is pruned; an entry's pooling is its own, not its file's; and only
the daemon's owner sees where its models' files are."""
from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from ridge.daemon.client import Client, RidgeError
from ridge.daemon.frontend.registry import scan
from ridge.quant import store
from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_header import MAX_ARRAY, MAX_KV, HeaderError, read_header
from ridge.quant.gguf_loader import open_gguf
from test_daemon_harness import Daemon, Raw
from test_gateway import free_port, wait_http
from tiny_models import make_tiny

FLAGS = ("--num-kv-blocks", 64, "--kv-host-gib", 0, "--no-kv-disk", "--weights", "fp32", "--kv-dtype", "fp32",
         "--ridge-point", 4.0, "--cpu-weight-format", "fp32", "--max-loaded-models", 1)


# -- crafted GGUF headers ----------------------------------------------------------------------------
def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def gguf(kvs: list[bytes], tensors: int = 0, kv_count: int | None = None) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, len(kvs) if kv_count is None else kv_count) + b"".join(kvs)


def kv_string(key: str, value: str) -> bytes:
    return _s(key.encode()) + struct.pack("<I", 8) + _s(value.encode())


def kv_array(key: str, elem: int, count: int, body: bytes = b"") -> bytes:
    return _s(key.encode()) + struct.pack("<IIQ", 9, elem, count) + body


def vocabulary_like(n: int = 1 << 17) -> bytes:
    """1 MiB of header: a vocabulary of n empty strings, what the `gguf` reader spends seconds on."""
    return gguf([kv_string("general.architecture", "llama"), kv_array("tokenizer.ggml.tokens", 8, n, bytes(8 * n))])


def huge_array() -> bytes:
    """A 1 MiB file whose vocabulary is followed by an array declaring 2^40 elements."""
    n = 1 << 17
    return gguf([kv_string("general.architecture", "llama"), kv_array("tokenizer.ggml.tokens", 8, n, bytes(8 * n)),
                 kv_array("x", 0, 1 << 40, bytes(64))])


def test_a_gguf_header_is_walked_within_bounds(tmp_path):
    p = tmp_path / "m.gguf"
    for body, words in [(huge_array(), f"the bound is {MAX_ARRAY}"),
                        (gguf([], kv_count=MAX_KV + 1), f"the bound is {MAX_KV}"),
                        (gguf([], tensors=1 << 40), "tensors"),
                        (gguf([_s(b"k") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 50)]), "a string of"),
                        (gguf([kv_array("k", 9, 2, bytes(64))]), "an array of type 9"),
                        (gguf([kv_string("general.architecture", "llama")], kv_count=3), "truncated"),
                        (b"GGUF" + bytes(4), "no GGUF magic")]:
        p.write_bytes(body)
        t = time.monotonic()
        with pytest.raises(HeaderError, match=words):
            read_header(p)
        assert time.monotonic() - t < 1.0
        with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
            open_gguf(p)  # the loader refuses it before the `gguf` reader allocates what it declares
    p.write_bytes(vocabulary_like())
    assert read_header(p).values == {"general.architecture": "llama"}  # within the bounds: read, and fast
    model = make_tiny(tmp_path, seed=1)[0]
    h = read_header(model)
    assert h.values["general.architecture"] == "llama" and h.tensor_count > 0


def test_a_fifo_is_never_opened_for_reading(tmp_path):
    fifo = tmp_path / "x.gguf"
    os.mkfifo(fifo)
    box: dict = {}

    def load():
        try:
            open_gguf(fifo)
        except Exception as e:
            box["error"] = e

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(2.0)
    if t.is_alive():  # blocked in open(): a writer lets it go, so that the test ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5.0)
        pytest.fail("opening the model blocked on a FIFO")
    assert isinstance(box.get("error"), ModelLoadError) and "not a regular file" in str(box["error"])


# -- the models directory's trust --------------------------------------------------------------------
def test_the_models_directory_serves_only_what_its_users_put_there(tmp_path, caplog):
    models, outside = tmp_path / "models", tmp_path / "outside"
    models.mkdir()
    outside.mkdir()
    (models / "good.gguf").write_bytes(b"GGUF")
    (outside / "secret.gguf").write_bytes(b"GGUF")
    os.chmod(outside / "secret.gguf", 0o600)
    (models / "leak.gguf").symlink_to(outside / "secret.gguf")  # a link out: the daemon would read it for them
    (models / "alias.gguf").symlink_to(models / "good.gguf")  # a link within: what the directory holds anyway
    (models / "open.gguf").write_bytes(b"GGUF")
    os.chmod(models / "open.gguf", 0o666)
    os.mkfifo(models / "x.gguf")
    hf = models / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").symlink_to(outside / "secret.gguf")
    with caplog.at_level("WARNING", logger="ridge.daemon.models"):
        assert sorted(scan(models)) == ["alias", "good"]
    said = caplog.text
    assert "leak.gguf: it leads outside the models directory" in said and "open.gguf: writable by every user" in said
    assert "x.gguf: not a regular file" in said and "model.safetensors leads outside" in said
    if os.geteuid() == 0:  # group write: trusted for the daemon's own group only
        (models / "group.gguf").write_bytes(b"GGUF")
        os.chmod(models / "group.gguf", 0o664)
        os.chown(models / "group.gguf", -1, os.getegid())
        assert "group" in scan(models)
        os.chown(models / "group.gguf", -1, 65534)
        assert "group" not in scan(models)
    os.chmod(models, 0o777)  # anyone can put a file (or a link) in it: none of it is served
    with caplog.at_level("WARNING", logger="ridge.daemon.models"):
        assert scan(models) == {}
    assert "writable by every user" in caplog.text


# -- the converted-weights cache ---------------------------------------------------------------------
def test_the_converted_cache_is_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    weights = {"w": torch.zeros(1 << 18)}  # 1 MiB an entry
    sources = []
    for i in range(3):
        src = tmp_path / f"m{i}.gguf"
        src.write_bytes(b"GGUF")
        sources.append(src)
        store.save(f"key{i}", {"source": str(src)}, weights)
        os.utime(store.cache_root() / f"key{i}", (1000 + i, 1000 + i))  # key0 the least recently used
    assert sorted(p.name for p in store.cache_root().iterdir()) == ["key0", "key1", "key2"]  # under the cap
    assert store.load("key0") is not None  # a hit: now the most recently used
    sources[2].unlink()  # its source is gone: so is its entry, at the next save
    monkeypatch.setenv("RIDGE_MODEL_CACHE_GIB", str(2.5 * (1 << 20) / (1 << 30)))  # room for two entries
    src = tmp_path / "m3.gguf"
    src.write_bytes(b"GGUF")
    store.save("key3", {"source": str(src)}, weights)
    assert sorted(p.name for p in store.cache_root().iterdir()) == ["key0", "key3"]
    monkeypatch.setenv("RIDGE_MODEL_CACHE_GIB", str(0.5 * (1 << 20) / (1 << 30)))  # smaller than one entry
    store.save("key4", {"source": str(src)}, weights)
    assert sorted(p.name for p in store.cache_root().iterdir()) == ["key4"]  # the one just written stays


# -- a live daemon -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """alpha (the default) and chat in the models directory, emb an entry of chat's file that pools;
    beside them a FIFO, a link out to a file only the daemon can read, a world-writable copy, and a
    config entry whose path is a FIFO; the socket, a loopback TCP port, and Ollama's listener."""
    tmp = tmp_path_factory.mktemp("hostile")
    models, outside = tmp / "models", tmp / "outside"
    models.mkdir()
    outside.mkdir()
    alpha = make_tiny(models, seed=1)[0].rename(models / "alpha.gguf")
    shutil.copy(alpha, models / "chat.gguf")
    make_tiny(outside, seed=3)[0].rename(outside / "secret.gguf")
    os.chmod(outside / "secret.gguf", 0o600)
    (models / "leak.gguf").symlink_to(outside / "secret.gguf")
    shutil.copy(alpha, models / "shared.gguf")
    os.chmod(models / "shared.gguf", 0o666)
    os.mkfifo(models / "x.gguf")
    os.mkfifo(tmp / "pipe.gguf")
    (tmp / "xdg-config" / "ridge").mkdir(parents=True)
    (tmp / "xdg-config" / "ridge" / "config.toml").write_text(
        f'[models.emb]\npath = "chat.gguf"\npooling = "mean"\n\n[models.piped]\npath = "{tmp / "pipe.gguf"}"\n')
    tcp, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    d = Daemon(tmp, str(alpha), "--models-dir", models, *FLAGS, "--tcp", tcp, "--ollama", f"127.0.0.1:{port}")
    d.models, d.tcp, d.url = models, tcp, f"http://127.0.0.1:{port}"
    wait_http(d.url)
    c = Client(d.endpoint, timeout=60)
    yield d, c
    c.close()
    died = d.proc.poll()
    rc = d.stop()
    assert died is None and rc == 0, f"the daemon {'died' if died is not None else 'did not stop'} (rc {rc}):\n" \
        + d.output()[-8000:]


def timed(raw: Raw, msg: dict) -> tuple[dict, float]:
    t = time.monotonic()
    reply = raw.call({"v": 3, **msg}, timeout=30)
    return reply, time.monotonic() - t


def test_a_listing_never_waits_for_a_file(served):
    """New files whose headers the `gguf` reader takes seconds over: the listing answers at once,
    and so does a client asking for health meanwhile."""
    d, c = served
    (d.models / "late.gguf").write_bytes(vocabulary_like())
    (d.models / "huge.gguf").write_bytes(huge_array())
    a, b = Raw(d.endpoint), Raw(d.endpoint)
    try:
        a.send({"type": "models", "id": "m"}, v=3)
        health, waited = timed(b, {"type": "health", "id": "h"})
        assert health["type"] == "health" and waited < 1.0
        listing, waited = timed(a, {"type": "models", "id": "m2"})
        assert waited < 1.0
        names = {m["name"] for m in listing["models"]}
        assert {"alpha", "chat", "emb", "piped", "late", "huge"} <= names
        assert not names & {"x", "leak", "shared"}, names  # a FIFO, a link out, a file anyone can write
        got = c.generate("hello", model="alpha", max_tokens=2, temperature=0.0, ignore_eos=True)
        assert len(got.token_ids) == 2
    finally:
        a.close()
        b.close()
    deadline = time.monotonic() + 10
    while {m["name"]: m for m in c.models()["models"]}["late"]["kind"] == "unknown":  # read on the worker
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(RidgeError, match="model_load_failed"):
        c.generate("hello", model="huge", max_tokens=2)
    log = d.output()
    assert "not serving" in log and "x.gguf: not a regular file" in log and "leak.gguf: it leads outside" in log


def test_a_fifo_model_fails_to_load_and_blocks_no_other(served):
    d, c = served
    box: dict = {}

    def piped():
        try:
            c2 = Client(d.endpoint, timeout=60)
            try:
                c2.generate("hello", model="piped", max_tokens=2)
            finally:
                c2.close()
        except RidgeError as e:
            box["error"] = str(e)

    t = threading.Thread(target=piped, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # the load blocked in open(): a writer lets it go
        os.close(os.open(d.tmp / "pipe.gguf", os.O_WRONLY | os.O_NONBLOCK))
        t.join(20)
        pytest.fail("loading a FIFO blocked")
    assert "model_load_failed" in box.get("error", "") and "not a regular file" in box["error"]
    assert c.generate("hello", model="alpha", max_tokens=2).token_ids


def test_two_entries_of_one_file_keep_their_own_pooling(served):
    """emb pools chat.gguf: after it embeds, chat, the same file, still generates."""
    d, c = served
    vectors = c.embed(["hello"], model="emb")["data"]
    assert len(vectors) == 1 and len(vectors[0]["embedding"] if isinstance(vectors[0], dict) else vectors[0]) > 0
    got = c.generate("hello", model="chat", max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(got.token_ids) == 3
    kinds = {m["name"]: m["kind"] for m in c.models()["models"]}
    assert kinds["chat"] == "generate" and kinds["emb"] == "embed"


def test_only_the_owner_sees_where_the_files_are(served):
    d, c = served
    mine = {m["name"]: m for m in c.models()["models"]}  # over the socket, as the daemon's own user
    assert mine["chat"]["path"] == str(d.models / "chat.gguf") and mine["chat"]["size"] > 0
    assert mine["chat"]["modified_at"] > 0
    secret = str(d.tmp)
    other = Raw(d.tcp)  # loopback TCP without CURVE: nobody in particular
    try:
        reply = other.call({"v": 3, "type": "models", "id": "m"}, timeout=30)
        hello = other.call({"type": "hello", "id": "h"}, timeout=30)
        figures = other.call({"type": "stats", "id": "s"}, timeout=30)
    finally:
        other.close()
    # the stats feed's endpoint is the daemon's to give; where the models are is not
    assert hello["type"] == "hello" and "path" not in hello["model"] and str(d.models) not in json.dumps(hello)
    assert figures["type"] == "stats" and str(d.models) not in json.dumps(figures)
    assert reply["type"] == "models"
    for m in reply["models"]:
        assert m["path"] is None and m["size"] is None and m["modified_at"] is None, m
    assert secret not in json.dumps(reply)
    for route in ("/api/tags", "/v1/models"):
        with urllib.request.urlopen(d.url + route, timeout=30) as r:
            text = r.read().decode()
        assert secret not in text and "chat" in text
    tags = {m["name"]: m for m in json.loads(urllib.request.urlopen(d.url + "/api/tags", timeout=30).read())["models"]}
    assert tags["chat"]["size"] == 0 and tags["chat"]["digest"] != tags["alpha"]["digest"]
    req = urllib.request.Request(d.url + "/api/show", json.dumps({"model": "chat"}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        shown = r.read().decode()
    assert json.loads(shown)["modelfile"] == "FROM chat\n" and secret not in shown
