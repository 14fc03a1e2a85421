"""KV tiers on a tiny model: real engines, real files in a temporary XDG_CACHE_HOME.

Two 64-token system prompts (4 blocks each) take turns, each with its own
question, one request at a time. fp32 KV, so "the same tokens" means exactly
the same as the cold run (no prefix caching at all)."""
from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from engine_utils import assert_no_leak, greedy, load_tiny, make_engine, prompts
from ridge.cache.disk_tier import DiskTier, kv_root
from test_kv_manager import order_blind, reversed_blocks

MAX_TOKENS = 8


def tier_engine(loaded, **kw):
    """make_engine with the disk tier on (the tests' default leaves it off)."""
    return make_engine(loaded, **{"kv_disk": True, **kw})


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_tiny(tmp_path_factory, "tiers")


@pytest.fixture(autouse=True)
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


@pytest.fixture(scope="module")
def systems(loaded):
    return prompts(loaded.config.vocab_size, [64, 64], seed=1)


@pytest.fixture(scope="module")
def workload(loaded, systems):
    qs = prompts(loaded.config.vocab_size, [5, 7, 9, 6, 8, 5], seed=2)
    return [systems[i % 2] + q for i, q in enumerate(qs)]


@pytest.fixture(scope="module")
def cold(loaded, workload):
    eng = tier_engine(loaded, enable_prefix_caching=False)
    return [out for out, _ in one_by_one(eng, workload)]


def one_by_one(eng, ps) -> list[tuple[list[int], int]]:
    """-> (output tokens, cached prompt tokens) per prompt, each run alone."""
    res = []
    for i, p in enumerate(ps):
        eng.add_request(f"q{i}", p, greedy(MAX_TOKENS))
        toks, cached = [], None
        while eng.has_unfinished():
            for o in eng.step():
                toks += o.new_token_ids
                cached = o.num_cached_tokens
        res.append((toks, cached))
    return res


def h(i: int) -> bytes:
    """A block hash for the disk tier's own tests."""
    return i.to_bytes(16, "little")


def tiers(eng) -> dict:
    return eng.stats()["kv_tiers"]


def block_files(eng, system) -> list:
    """The disk tier's file for each block of a system prompt, in chain order."""
    return [eng.tiers.disk.path(h) for h in eng.kv_cache_manager.chain(system)]


def test_host_tier_serves_prefixes_the_pool_evicted(loaded, workload, cold):
    # 8 blocks hold one request (6 blocks), so each system prompt evicts the other's.
    eng = tier_engine(loaded, num_kv_blocks=8, kv_disk=False)
    got = one_by_one(eng, workload)
    assert [t for t, _ in got] == cold
    assert [c for _, c in got] == [0, 0] + [64] * 4
    t = tiers(eng)
    assert t["host"]["hits"] >= 4 and t["host"]["bytes_in"] == t["host"]["hits"] * t["block_bytes"]
    assert t["device"]["hits"] > 0  # the chain's first blocks were still on the device, the rest came from RAM
    assert not t["disk"]["enabled"]
    assert_no_leak(eng)


def test_disk_tier_survives_a_restart(loaded, workload, cold, xdg):
    first = tier_engine(loaded)
    assert [t for t, _ in one_by_one(first, workload[:2])] == cold[:2]
    first.close()
    assert first.tiers.disk.dir.parent == kv_root() and str(first.tiers.disk.dir).startswith(str(xdg))
    # A new engine, with no host tier: every hit comes from the files.
    again = tier_engine(loaded, kv_host_gib=0)
    assert tiers(again)["disk"]["blocks"] >= 8  # the index, rebuilt from the directory
    got = one_by_one(again, workload[2:])
    assert [t for t, _ in got] == cold[2:]
    assert [c for _, c in got] == [64] * 4
    t = tiers(again)
    assert t["disk"]["hits"] == 8 and t["disk"]["bytes_in"] == 8 * t["block_bytes"] and t["disk"]["corrupt"] == 0
    assert not t["host"]["enabled"]
    assert_no_leak(again)


def test_damaged_files_are_misses_never_wrong_reads(loaded, systems, workload, cold):
    first = tier_engine(loaded)
    one_by_one(first, workload[:2])
    first.close()
    again = tier_engine(loaded, kv_host_gib=0)  # its index lists every file
    a, b = block_files(again, systems[0]), block_files(again, systems[1])
    data = bytearray(a[1].read_bytes())
    data[len(data) // 2] ^= 0x10  # a bit flipped in A's block 1's payload
    a[1].write_bytes(bytes(data))
    b[0].write_bytes(b[0].read_bytes()[:1000])  # B's block 0 truncated
    b[2].unlink()  # deleted while the engine runs
    a[3].write_bytes(a[2].read_bytes())  # another block's whole, valid file under A's block 3's name
    got = one_by_one(again, workload[2:])
    assert [t for t, _ in got] == cold[2:]
    # A: block 0 loads, block 1 is refused; its blocks are recomputed and published again.
    # B: block 0 is refused. Then the device pool serves both.
    assert [c for _, c in got] == [16, 0, 64, 64]
    t = tiers(again)
    assert t["disk"]["corrupt"] == 2 and t["disk"]["hits"] == 1
    assert_no_leak(again)
    # The refused blocks were recomputed and written again. a[3] still holds block 2's bytes
    # and is refused; b[2] is still listed (never read) and is a miss.
    again.close()
    third = tier_engine(loaded, kv_host_gib=0)
    got = one_by_one(third, workload[2:4])
    assert [t for t, _ in got] == cold[2:4]
    assert [c for _, c in got] == [48, 32]
    assert tiers(third)["disk"]["corrupt"] == 1


def test_a_write_killed_mid_way_is_never_read(tmp_path):
    root, size = tmp_path / "kv", 4 << 20
    script = textwrap.dedent(f"""
        import numpy as np
        from ridge.cache.disk_tier import DiskTier
        d = DiskTier({str(root)!r}, "k", {{}}, 1 << 40, {size})
        print("ready", flush=True)
        i = 1
        while True:
            d.write(i.to_bytes(16, "little"), (i - 1).to_bytes(16, "little"), (i, i + 1),
                    np.full({size}, i % 251, dtype=np.uint8))
            i += 1
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    # A torn file, as a rename without the data before it could leave after a crash.
    (root / "k" / "00").mkdir(parents=True, exist_ok=True)
    torn_hash = h(1 << 40)
    torn = DiskTier(root, "k", {}, 1 << 40, size).path(torn_hash)
    torn.parent.mkdir(parents=True, exist_ok=True)
    torn.write_bytes(b"RKVB" + bytes(100))
    d = DiskTier(root, "k", {}, 1 << 40, size)
    assert not list((root / "k").rglob(".tmp-*"))  # the killed writer's temporary file is gone
    assert len(d) >= 2
    out = np.empty(size, dtype=np.uint8)
    assert torn_hash in d.index and not d.read(torn_hash, h((1 << 40) - 1), (1, 2), out)
    for key in list(d.index):
        i = int.from_bytes(key, "little")
        assert d.read(key, h(i - 1), (i, i + 1), out) and (out == i % 251).all()
    assert d.corrupt == 1


def test_disk_lru_cap_and_index_order_after_restart(tmp_path):
    row = np.zeros(1000, dtype=np.uint8)
    d = DiskTier(tmp_path, "k", {}, 0, 1000)
    size = len(d._header(h(0), h(0), (1,))) + 1000 + 4
    d.cap_bytes = 2 * size
    for i in (10, 11):
        assert d.write(h(i), h(0), (i,), row)
        time.sleep(0.01)
    assert d.read(h(10), h(0), (10,), row)  # 10 is now the most recently used
    assert d.write(h(12), h(0), (12,), row)
    assert list(d.index) == [h(10), h(12)] and not d.path(h(11)).exists()
    d2 = DiskTier(tmp_path, "k", {}, 2 * size, 1000)
    assert list(d2.index) == [h(10), h(12)]
    assert not d2.read(h(12), h(0), (99,), row)  # another block's tokens: refused and deleted
    assert list(d2.index) == [h(10)]
    assert not d2.read(h(10), h(1), (10,), row)  # the same tokens after another parent: refused too
    assert list(d2.index) == []


def test_an_io_error_turns_the_disk_tier_off_and_serving_goes_on(loaded, workload, cold, tmp_path):
    eng = tier_engine(loaded, num_kv_blocks=8)
    one_by_one(eng, workload[:1])
    disk = eng.tiers.disk
    eng.tiers.flush()
    for shard in (disk.dir / f"{i:02x}" for i in range(256)):  # every shard folder a file: the next write fails
        if shard.is_dir():
            for f in shard.iterdir():
                f.unlink()
            shard.rmdir()
        shard.write_text("")
    disk.index.clear()
    got = one_by_one(eng, workload[1:])
    assert [t for t, _ in got] == cold[1:]
    eng.tiers.flush()
    t = tiers(eng)
    assert not t["disk"]["enabled"] and t["disk"]["off_reason"]
    assert t["host"]["hits"] >= 4
    # A tier that cannot start is off from the start.
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    eng2 = tier_engine(loaded, kv_disk_dir=str(blocked))
    assert one_by_one(eng2, workload[:1])[0][0] == cold[0]
    assert not tiers(eng2)["disk"]["enabled"]


def test_abort_while_loading_frees_everything(loaded, workload):
    eng = tier_engine(loaded, num_kv_blocks=8, kv_disk=False)
    one_by_one(eng, workload[:2])  # A's prefix is in host RAM now, B's on the device
    eng.add_request("late", workload[2], greedy(MAX_TOKENS))
    eng.add_request("other", workload[3], greedy(MAX_TOKENS))
    eng.step()
    assert eng.scheduler.loading or eng.scheduler.running
    eng.abort_request("late")
    while eng.has_unfinished():
        eng.step()
    assert not eng.kv_cache_manager.offloaded and not eng.tiers.loads
    assert_no_leak(eng)


def test_tiers_off(loaded, workload, cold):
    eng = tier_engine(loaded, num_kv_blocks=8, kv_disk=False, kv_host_gib=0)
    assert eng.tiers is None
    got = one_by_one(eng, workload)
    assert [t for t, _ in got] == cold and [c for _, c in got][2:] != [64] * 4
    t = tiers(eng)
    assert not t["host"]["enabled"] and not t["disk"]["enabled"] and t["host"]["hits"] == 0


def test_status_and_top_show_the_engines_tier_figures(loaded, workload):
    from ridge.daemon.cli.commands import format_status
    from ridge.tui.figures import tier_line_short, tier_lines

    eng = tier_engine(loaded, num_kv_blocks=8)
    one_by_one(eng, workload[:3])
    st = eng.stats()
    t = st["kv_tiers"]
    assert t["host"]["hits"] > 0 and t["disk"]["blocks"] > 0 and t["loading"] == 0
    lines = tier_lines(st)
    assert lines[0] == f"device {t['device']['blocks']} blk cached · hit {t['device']['hits']} " \
                       f"miss {t['device']['misses']}"
    assert lines[2].startswith(f"  hit {t['host']['hits']} miss {t['host']['misses']} · in ")
    assert lines[3].startswith(f"disk   {t['disk']['blocks']} blk")
    assert tier_line_short(st).startswith(f"device {t['device']['hits']} hits · host {t['host']['blocks']} blk")
    daemon = {"state": "serving", "pid": 1, "in_flight": 0, "clients": 0, "aborts": {}}
    text = format_status("ipc://test", {"model": eng.model_info(), "stats": st, "daemon": daemon})
    assert f"kv host   {t['host']['blocks']} blocks" in text and f"{t['host']['hits']} hits" in text
    assert f"in {t['disk']['path']}" in text


def test_a_daemon_killed_with_sigkill_serves_the_prefix_from_disk_after_a_restart(tmp_path, loaded, systems):
    """kill -9 a real `ridge serve`, start another on the same cache: the index is rebuilt
    from the files and the repeated prompt's prefix comes from disk, with the same tokens."""
    from test_daemon_harness import Daemon, Raw, pump_all, stats

    prompt = systems[0] + [5, 6, 7]
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}

    def ask(d) -> dict:
        c = Raw(d.endpoint)
        c.generate("a", prompt_token_ids=prompt, params={"max_tokens": MAX_TOKENS, "ignore_eos": True})
        pump_all([c], lambda: not c.open)
        c.close()
        return c.streams["a"]

    def tiers_when(d, cond) -> dict:  # stats replies are snapshots: wait for one that shows it
        deadline = time.monotonic() + 20
        while not cond(t := stats(d.endpoint)["stats"]["kv_tiers"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return t

    first = Daemon(tmp_path, str(loaded.path), "--num-kv-blocks", 64, env_extra=cache)
    try:
        cold = ask(first)
        tiers_when(first, lambda t: t["disk"]["blocks"] >= 4)  # written through by the writer thread
    finally:
        first.stop(signal.SIGKILL)
    again = Daemon(tmp_path, str(loaded.path), "--num-kv-blocks", 64, env_extra=cache)
    try:
        assert tiers_when(again, lambda t: True)["disk"]["blocks"] >= 4  # the index, from the files
        warm = ask(again)
        assert warm["tokens"] == cold["tokens"] and len(cold["tokens"]) == MAX_TOKENS
        assert cold["final"]["usage"]["cached_tokens"] == 0 and warm["final"]["usage"]["cached_tokens"] == 64
        t = tiers_when(again, lambda t: t["disk"]["hits"] > 0)
        assert t["disk"]["hits"] == 4 and t["disk"]["corrupt"] == 0
    finally:
        assert again.stop() == 0, again.output()


@pytest.mark.parametrize("drop", [False, True], ids=["kept", "dropped"])
def test_tier_threads_stop_before_the_interpreter_exits(loaded, workload, tmp_path, drop):
    """An engine nobody closed (a script that just returns, holding it or having dropped it):
    its tier threads have ended before the interpreter tears down, after what they had
    queued, and the process exits cleanly."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(f"""
        import atexit, sys, threading
        sys.path.insert(0, {tests_dir!r})
        from engine_utils import greedy, make_engine
        from ridge.models.loader import load_model
        # Registered first, so it runs last (atexit is last-in, first-out): after the engine's.
        atexit.register(lambda: print("alive at exit:", sorted(t.name for t in threading.enumerate()
                                                             if t.name.startswith("ridge-kv")), flush=True))
        eng = make_engine(load_model({str(loaded.path)!r}, device="cpu", use_cache=False, show_progress=False),
                          kv_disk=True)
        eng.add_request("a", {workload[0]!r}, greedy(4))
        while eng.has_unfinished():
            eng.step()
        if {drop!r}:
            eng.tiers.flush()
            del eng  # the tiers' __del__ tells the threads to stop; they may still be on their way out
        print("served", flush=True)
    """)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines()[-2:] == ["served", "alive at exit: []"], p.stdout
    assert len(list((tmp_path / "xdg").rglob("*.kvb"))) >= 4  # the prompt's full blocks, written before exit


# --- block identity: every tier compares the block's tokens and parent -------------------------

def weak_engine(loaded, **kw):
    """An engine whose blocks hash with order_blind: a block and its tokens reversed collide."""
    eng = tier_engine(loaded, **kw)
    eng.kv_cache_manager.set_hash(order_blind)
    return eng


@pytest.fixture(scope="module")
def colliding(loaded, workload):
    """(A, B, B's cold output): B is A with each block reversed, so every full block collides."""
    a = workload[0]
    b = reversed_blocks(a, 16)
    assert a != b and len(a) // 16 == 4
    return a, b, one_by_one(tier_engine(loaded, enable_prefix_caching=False), [b])[0][0]


def test_colliding_blocks_are_refused_by_the_device_pool_and_the_host_tier(loaded, colliding, cold):
    a, b, cold_b = colliding
    eng = weak_engine(loaded, kv_disk=False)
    got = one_by_one(eng, [a, b, a])
    assert [t for t, _ in got] == [cold[0], cold_b, cold[0]]
    assert [c for _, c in got] == [0, 0, 64]  # A hits itself under the weak hash; B hits nothing
    t = tiers(eng)
    assert t["host"]["blocks"] >= 4 and t["host"]["hits"] == 0 and t["host"]["misses"] >= 1  # A's, written through
    assert_no_leak(eng)


def test_colliding_blocks_are_refused_by_the_disk_tier(loaded, colliding, cold):
    a, b, cold_b = colliding
    first = weak_engine(loaded)
    assert one_by_one(first, [a])[0][0] == cold[0]
    first.close()
    again = weak_engine(loaded, kv_host_gib=0)  # nothing on the device, no host tier: only A's files
    assert tiers(again)["disk"]["blocks"] >= 4
    [(toks, cached)] = one_by_one(again, [b])
    assert toks == cold_b and cached == 0
    t = tiers(again)
    assert t["disk"]["hits"] == 0 and t["disk"]["corrupt"] == 1  # A's block 0 under B's hash: refused
    assert_no_leak(again)


# --- the disk tier's files: private, keyed, paused by a full disk --------------------------------

def modes(top) -> dict:
    return {str(p.relative_to(top)): stat.S_IMODE(p.stat().st_mode) for p in [top, *top.rglob("*")]}


@pytest.mark.parametrize("umask", [0o022, 0o002], ids=["022", "002"])
def test_the_disk_tier_is_private_whatever_the_umask(tmp_path, umask):
    top, row = tmp_path / "cache", np.zeros(1000, dtype=np.uint8)
    old = os.umask(umask)
    try:
        d = DiskTier(top / "ridge" / "kv", "k", {"model": "x"}, 1 << 30, 1000)
        assert d.write(h(1), h(0), (1, 2), row)
        stale = d.path(h(0xab << 120))  # an older ridge's shard and file, as the umask made them
        stale.parent.mkdir()
        with open(stale, "wb") as f:
            f.write(d._header(h(0xab << 120), h(0), (3,)) + bytes(1004))
        assert modes(top)[str(stale.relative_to(top))] != 0o600
        again = DiskTier(top / "ridge" / "kv", "k", {"model": "x"}, 1 << 30, 1000)
    finally:
        os.umask(old)
    assert len(again) == 2 and again.hash_key == d.hash_key
    got = modes(top)
    files = {p for p in got if (top / p).is_file()}
    assert {p.rsplit("/", 1)[-1] for p in files} >= {"key.json", "hash.key"} and len(files) == 4
    assert all(got[p] == 0o600 for p in files), got
    assert all(got[p] == 0o700 for p in set(got) - files), got


def test_the_disk_tier_says_where_it_is_and_how_to_turn_it_off(tmp_path, caplog):
    with caplog.at_level("INFO", logger="ridge.cache"):
        d = DiskTier(tmp_path, "k", {}, 1 << 30, 1000)
    assert f"disk KV tier at {d.dir}" in caplog.text and "--no-kv-disk" in caplog.text


def test_the_hash_key_is_kept_beside_the_blocks(tmp_path):
    row = np.zeros(1000, dtype=np.uint8)
    d = DiskTier(tmp_path, "k", {}, 1 << 30, 1000)
    assert len(d.hash_key) == 32 and DiskTier(tmp_path, "k", {}, 1 << 30, 1000).hash_key == d.hash_key
    assert d.write(h(1), h(0), (1,), row)
    (d.dir / "hash.key").write_bytes(b"not a key")
    d2 = DiskTier(tmp_path, "k", {}, 1 << 30, 1000)  # a new key: the blocks named under the old one go
    assert len(d2.hash_key) == 32 and d2.hash_key != d.hash_key
    assert len(d2) == 0 and not d.path(h(1)).exists()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_full_disk_pauses_the_writes_until_there_is_room(tmp_path, monkeypatch, code):
    row = np.zeros(1000, dtype=np.uint8)
    d = DiskTier(tmp_path, "k", {}, 1 << 30, 1000, retry_s=0.3)
    tried = []

    def full(fd, data):
        tried.append(fd)
        raise OSError(code, os.strerror(code))

    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        assert not d.write(h(1), h(0), (1,), row)
        assert d.paused and d.enabled and len(tried) == 1
        assert not d.write(h(2), h(0), (2,), row) and len(tried) == 1  # paused: not even tried
    if time.monotonic() < d._retry_at:  # room again, not looked for yet
        assert not d.write(h(2), h(0), (2,), row) and d.paused
    time.sleep(max(0.0, d._retry_at - time.monotonic()) + 0.05)
    assert d.write(h(2), h(0), (2,), row) and not d.paused and d.enabled
    assert d.read(h(2), h(0), (2,), row) and h(1) not in d.index
    assert not list(tmp_path.rglob(".tmp-*"))


def test_an_engine_whose_disk_fills_keeps_serving_and_says_its_writes_are_paused(loaded, workload, cold, monkeypatch):
    from ridge.daemon.cli.commands import format_status

    eng = tier_engine(loaded)
    real_write = os.write

    def full(fd, data):  # only the tier's block files (written under a temporary name, then renamed)
        if "/.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    assert one_by_one(eng, workload[:1])[0][0] == cold[0]
    eng.tiers.flush()
    t = tiers(eng)
    assert t["disk"]["enabled"] and t["disk"]["paused"] and t["disk"]["blocks"] == 0
    daemon = {"state": "serving", "pid": 1, "in_flight": 0, "clients": 0, "aborts": {}}
    text = format_status("ipc://test", {"model": eng.model_info(), "stats": eng.stats(), "daemon": daemon})
    assert "writes paused: the disk is full" in text
