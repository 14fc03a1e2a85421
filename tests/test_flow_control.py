"""Readers that stop reading, and the client's own reader: bounded memory and
aborts on both sides of the gateway (docs/protocol.md §4.4), the engine's
bounded outbox, and the asyncio client's failure modes (issue 23).

The asyncio client is driven first against a ZeroMQ ROUTER bound here, which
sends it exactly the frames a test needs (bad ones included); then a real
`ridge serve` on the tiny model (4096 positions, client_timeout 1 s) serves
a raw DEALER and an in-process gateway that read nothing. No mocks."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import socket
import threading
import time
import tracemalloc

import msgpack
import pytest
import zmq
import zmq.asyncio

from ridge.daemon.aio_client import AsyncClient
from ridge.daemon.client import VERSION as CLIENT_VERSION, Inbox, RidgeError
from test_daemon_harness import Daemon, Raw, stats, wait_idle
from tiny_models import make_tiny

CLIENT_TIMEOUT = 1.0
QUICK_TIMEOUT, QUICK_HEARTBEAT = 0.5, 0.15
PEER_FORGET = 1.0  # the daemon's forgetting of idle clients, shrunk from 60 s
MIB = 1 << 20


# -- the merged inbox ----------------------------------------------------------------------------
def delta(rid: str, index: int, ids: list[int], text: str) -> dict:
    return {"v": 1, "type": "delta", "id": rid, "index": index, "token_ids": ids, "text": text}


def test_inbox_merges_each_samples_deltas_and_ends_last():
    box = Inbox()
    for k in range(1000):
        box.put(delta("r", k % 2, [k], f"{k},"), time.monotonic())
    box.put({"type": "final", "id": "r"}, time.monotonic())
    box.put({"type": "error", "id": "r"}, time.monotonic())  # the first end stays
    assert len(box.deltas) == 2 and box.held_bytes() < 200_000
    d0, d1, end = box.take(), box.take(), box.take()
    assert (d0["index"], d0["token_ids"], d0["text"]) == (0, list(range(0, 1000, 2)), "".join(f"{k}," for k in
                                                                                          range(0, 1000, 2)))
    assert (d1["index"], d1["token_ids"]) == (1, list(range(1, 1000, 2))) and end["type"] == "final"
    assert box.take() is None and box.since is None
    with pytest.raises(ValueError, match="wrong type"):
        box.put(delta("r", 0, "not a list", "x"), time.monotonic())


# -- the engine's outbox --------------------------------------------------------------------------
def test_engine_outbox_stays_bounded_while_nobody_drains_it(tmp_path_factory):
    """The socket thread held up for a whole request: the engine keeps stepping (it never waits for
    the outbox), the outbox stays at its bound, and the outputs past it arrive merged, in order."""
    from engine_utils import greedy, load_tiny, make_engine
    from ridge.daemon.cli.config import defaults
    from ridge.daemon.frontend.engine_loop import OUTBOX_STEPS, EngineLoop

    loaded = load_tiny(tmp_path_factory, "outbox")
    loop = EngineLoop(lambda: make_engine(loaded), defaults()["stats_interval"])
    engine = loop.start_engine()
    try:
        loop.add("held up", [5, 6, 7], greedy(400))
        wait_for(engine.has_unfinished, 10, "the request never started")
        while engine.has_unfinished():  # nobody drains
            assert len(loop.outbox) <= OUTBOX_STEPS
            time.sleep(0.01)
        items = loop.drain_outbox()
        loop.add("drained", [5, 6, 7], greedy(400))
        wait_for(engine.has_unfinished, 10, "the request never started")
        steady = []
        while engine.has_unfinished() or loop.outbox:
            steady += loop.drain_outbox()
            time.sleep(0.001)
    finally:
        loop.stop()
        loop.join(10)
    assert len(items) == OUTBOX_STEPS + 1  # the last one: every later step, merged
    outs = [o for _, batch in items for o in batch]
    assert [len(o.new_token_ids) for o in outs] == [1] * OUTBOX_STEPS + [400 - OUTBOX_STEPS]
    assert outs[-1].finished and outs[-1].num_output_tokens == 400
    same = [o for _, batch in steady for o in batch]  # greedy: the same output, taken as it came
    assert [t for o in outs for t in o.new_token_ids] == [t for o in same for t in o.new_token_ids]
    assert "".join(o.new_text for o in outs) == "".join(o.new_text for o in same)


# -- the asyncio client against a ROUTER bound here ------------------------------------------------
class Router:
    """A ROUTER standing in for the daemon's socket, to send the client exact frames."""

    def __init__(self, tmp_path):
        self.endpoint = f"ipc://{tmp_path}/r.sock"
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue waits, as the daemon's does, never drops
        self.sock.bind(self.endpoint)
        self.ident = None

    async def recv(self, timeout: float = 5.0) -> dict:
        """The next message that is not a heartbeat."""
        deadline = time.monotonic() + timeout
        while True:
            self.ident, frame = await asyncio.wait_for(self.sock.recv_multipart(), deadline - time.monotonic())
            msg = msgpack.unpackb(frame, raw=False)
            if msg["type"] != "heartbeat":
                return msg

    async def send_raw(self, frame: bytes) -> None:
        await self.sock.send_multipart((self.ident, frame))

    async def send(self, msg: dict) -> None:
        await self.send_raw(msgpack.packb({"v": 1, **msg}))

    async def hello(self, client: AsyncClient, interval: float, client_timeout: float = 10.0) -> None:
        hello = asyncio.ensure_future(client.hello())
        msg = await self.recv()
        await self.send({"type": "hello", "id": msg["id"],
                         "heartbeat": {"interval": interval, "client_timeout": client_timeout}})
        await hello

    def close(self) -> None:
        self.sock.close()


@contextlib.asynccontextmanager
async def router_and_client(tmp_path, timeout: float):
    r = Router(tmp_path)
    c = AsyncClient(r.endpoint, timeout=timeout)
    try:
        yield r, c
    finally:  # closed whatever failed, so that the shared context can end
        try:
            await asyncio.wait_for(c.aclose(), 5)
        finally:
            c.sock.close(linger=0)
            r.close()


def final(rid: str, reason: str = "length") -> dict:
    return {"type": "final", "id": rid, "finish_reason": reason, "usage": {}, "timings": {}, "choices": []}


def test_a_bad_frame_is_dropped_and_the_reader_goes_on(tmp_path):
    """Issue 23: one undecodable frame used to end the reader silently, and every request after it
    timed out. Now it is logged and dropped; a malformed frame for a request in flight ends that
    request with an error and aborts it on the daemon; the others go on."""
    async def main():
        async with router_and_client(tmp_path, 5.0) as (r, c):
            call = asyncio.ensure_future(c.call("health"))
            msg = await r.recv()
            for bad in (b"\xc1", b"", msgpack.packb([1, 2]), msgpack.packb({"type": "health"}),
                        msgpack.packb({"id": ["a", "list"]}), msgpack.packb({"id": "nobody's", "type": 1})):
                await r.send_raw(bad)
            await r.send({"type": "health", "id": msg["id"], "status": "ok"})
            assert (await asyncio.wait_for(call, 2))["status"] == "ok"
            s = c.stream("x", max_tokens=8)
            nxt = asyncio.ensure_future(s.__anext__())
            gen = await r.recv()
            await r.send(delta(gen["id"], 0, "not a list", "a"))
            with pytest.raises(RidgeError) as e:
                await asyncio.wait_for(nxt, 2)
            assert e.value.code == "internal" and "malformed frame" in e.value.message
            assert await r.recv() == {"v": CLIENT_VERSION, "type": "abort", "id": gen["id"]}
            call = asyncio.ensure_future(c.call("health"))
            msg = await r.recv()
            await r.send({"type": "health", "id": msg["id"], "status": "ok"})
            assert (await asyncio.wait_for(call, 2))["status"] == "ok"

    asyncio.run(main())


def test_requests_fail_at_once_when_the_reader_dies(tmp_path):
    async def main():
        async with router_and_client(tmp_path, 30.0) as (r, c):
            call = asyncio.ensure_future(c.call("health"))
            await r.recv()
            t0 = time.monotonic()
            c.sock.close(linger=0)  # the socket fails under the reader
            with pytest.raises(RidgeError) as e:
                await asyncio.wait_for(call, 2)
            assert e.value.code == "unavailable" and "failed" in e.value.message and time.monotonic() - t0 < 1
            with pytest.raises(RidgeError) as e:
                await c.call("health")  # and so does every later one, without waiting
            assert e.value.code == "unavailable"

    asyncio.run(main())


def test_silence_counts_from_the_send_after_an_idle_spell(tmp_path):
    """The client half of the idle 503: after an idle spell longer than its timeout, the first request
    timed out at the first heartbeat interval, because silence was counted from the last frame."""
    async def main():
        async with router_and_client(tmp_path, 1.0) as (r, c):
            await r.hello(c, interval=0.25)
            await asyncio.sleep(1.5)  # idle: the last frame is older than the client's timeout
            gen = asyncio.ensure_future(c.generate("x", max_tokens=4))
            msg = await r.recv()
            for _ in range(2):  # a reply 1.2 s away, the first heartbeat late (as a daemon that forgot us)
                await asyncio.sleep(0.6)
                await r.send({"type": "heartbeat", "time": time.time()})
            await r.send(final(msg["id"]))
            assert (await asyncio.wait_for(gen, 2)).finish_reason == "length"

    asyncio.run(main())


def test_unread_deltas_are_merged_and_a_stuck_stream_is_aborted(tmp_path):
    """A consumer that stops taking deltas: they wait merged (one per sample), the request is aborted
    once its oldest untaken frame is client_timeout old, and a consumer that comes back gets the
    whole output so far, then the final."""
    async def main():
        async with router_and_client(tmp_path, 10.0) as (r, c):
            await r.hello(c, interval=0.2, client_timeout=0.5)
            s = c.stream("x", max_tokens=4000)
            first = asyncio.ensure_future(s.__anext__())
            gen = await r.recv()
            await r.send(delta(gen["id"], 0, [1], "a"))
            assert (await first).token_ids == [1]
            t0 = time.monotonic()
            for k in range(2000):
                await r.send(delta(gen["id"], 0, [k], "b"))
            abort = await r.recv(timeout=3)
            elapsed = time.monotonic() - t0
            assert abort == {"v": CLIENT_VERSION, "type": "abort", "id": gen["id"]}
            assert 0.5 <= elapsed < 0.5 + 0.2 + 0.5, elapsed
            assert c.held_bytes() < 256 * 1024, c.held_bytes()  # one merged delta
            await r.send(final(gen["id"], "abort"))
            d = await s.__anext__()
            assert d.token_ids == list(range(2000)) and d.text == "b" * 2000
            with pytest.raises(StopAsyncIteration):
                await s.__anext__()
            assert s.final.finish_reason == "abort"

    asyncio.run(main())


# -- a real daemon ---------------------------------------------------------------------------------
ENTRY = f"""
import sys

import ridge.daemon.transport.loop as server
from ridge.cli import main

server.PEER_FORGET_S = {PEER_FORGET}
sys.exit(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(tmp_path_factory, name: str, *flags, **model) -> Daemon:
    tmp = tmp_path_factory.mktemp(name)
    model, _, _ = make_tiny(tmp, "llama", max_position=4096, **model)
    script = tmp / "ridge_forgetful.py"
    script.write_text(ENTRY)
    return Daemon(tmp, str(model), "--num-kv-blocks", 4400, "--max-num-seqs", 16, "--served-model-name", "tiny",
                  *flags, entry=(str(script),))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory, "flow", "--client-timeout", CLIENT_TIMEOUT)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """A daemon whose readers are held to a short client_timeout, on a model a few times the tiny one
    (about 3 ms a token here), so that a 2,000-token stream is still running when its reader is found
    stuck, even on a fast machine, and the gateway keeps up with it until then."""
    d = start_daemon(tmp_path_factory, "quick", "--client-timeout", QUICK_TIMEOUT,
                     "--heartbeat-interval", QUICK_HEARTBEAT, hidden_size=256, intermediate_size=1024, num_layers=4,
                     head_dim=64)
    yield d
    d.stop()


@contextlib.contextmanager
def gateway_on(daemon: Daemon):
    """The HTTP gateway in this process, so that what it holds can be measured here."""
    from ridge.daemon.gateway.run import GatewayThread, listen
    from ridge.daemon.gateway.settings import GatewaySettings

    settings = GatewaySettings("127.0.0.1", free_port())
    gw = GatewayThread(settings, daemon.endpoint, listen(settings))
    gw.start()
    gw.addr, gw.link = ("127.0.0.1", settings.port), gw.server.config.app.state.link
    try:
        wait_for(lambda: gw.server.started, 30, "the gateway did not start")
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def gateway(daemon):
    with gateway_on(daemon) as gw:
        yield gw


@pytest.fixture(scope="module")
def quick_gateway(quick):
    with gateway_on(quick) as gw:
        yield gw


def on_gateway_loop(gw, fn):
    """fn(the link's client), run on the gateway's event loop, which owns the client."""
    client = gw.link.client
    result = concurrent.futures.Future()
    client.loop.call_soon_threadsafe(lambda: result.set_result(fn(client)))
    return result.result(5)


def http_post(addr, path: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window it offers
    s.connect(addr)
    data = json.dumps(body).encode()
    s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (path.encode(), len(data), data))
    return s


def read_all(s: socket.socket, timeout: float = 10.0) -> bytes:
    s.settimeout(timeout)
    parts = []
    while not (parts and b"data: [DONE]" in b"".join(parts[-2:])):
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        parts.append(chunk)
    return b"".join(parts)


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return value


STUCK = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0.0}
# The HTTP reader's tokens first fill the gateway's socket buffers (a few MB once the kernel has grown
# them), so its stream must outlast that and the stuck timer too: nearly the model's whole context.
STUCK_HTTP = {**STUCK, "max_tokens": 4000}


def oldest_untaken(client: AsyncClient) -> float | None:
    """Seconds since the oldest frame a reader has not taken arrived."""
    since = [box.since for box in client._inboxes.values() if box.since is not None]
    return time.monotonic() - min(since) if since else None


def test_an_http_client_that_reads_nothing_costs_little_and_is_aborted(quick, quick_gateway):
    """4,000 tokens (with their top-20 logprobs, so that the kernel's and uvicorn's buffers fill early)
    streamed to an HTTP client that reads none of them: the gateway holds one merged delta, not a
    frame per token, and aborts the request once nothing was taken for client_timeout.

    What it holds is measured once, after the abort: nothing is taken meanwhile, so that is its peak.
    Walking a half-megabyte delta on the gateway's loop every few ms (0.4 s a walk on a busy 2-core
    machine) would starve the loop's own heartbeats past the daemon's 0.5 s client_timeout."""
    gw = quick_gateway
    before = stats(quick.endpoint)["daemon"]["aborts"]["client"]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        s = http_post(gw.addr, "/v1/chat/completions",
                      {"model": "tiny", "messages": [{"role": "user", "content": "talk"}], "stream": True,
                       "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 20, **STUCK_HTTP},
                      rcvbuf=4096)
        stuck_for = []
        deadline = time.monotonic() + 30
        while (aborts := stats(quick.endpoint)["daemon"]["aborts"])["client"] == before:
            assert time.monotonic() < deadline, f"never aborted ({aborts}); stuck for {stuck_for[-3:]}"
            if gw.link.client is not None:
                stuck_for.append(on_gateway_loop(gw, oldest_untaken) or 0.0)
            time.sleep(0.02)
        held = on_gateway_loop(gw, lambda client: client.held_bytes())
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    wait_idle(quick.endpoint, timeout=10)
    body = read_all(s).decode()  # read at last: what it had, then the end
    s.close()
    events = [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: {")]
    reasons = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    print(f"\nheld by the gateway: {held} B; traced peak {peak / MIB:.2f} MiB; aborted "
          f"{max(stuck_for):.2f} s after the client stopped taking; {usage['completion_tokens']} of 4000 tokens")
    assert reasons[-1] == "abort" and "data: [DONE]" in body
    # the tokens of about client_timeout at ~1.7 KB each (20 logprobs): 0.55-1.0 MB here
    assert held < 2 * MIB and peak < 4 * MIB
    assert QUICK_TIMEOUT - 0.05 < max(stuck_for) < QUICK_TIMEOUT + QUICK_HEARTBEAT + 0.5
    assert 0 < usage["completion_tokens"] < STUCK_HTTP["max_tokens"]


def test_a_zmq_client_that_reads_nothing_is_aborted_with_bounded_daemon_memory(quick):
    """A raw DEALER that sends a generate (16 samples of 2,000 tokens) and heartbeats, but never reads:
    the daemon merges what its queue has no room for, holds a bounded number of bytes for it, and
    drops it once its queue stayed full for client_timeout. Another that sends nothing at all is timed
    out the same way."""
    before = stats(quick.endpoint)["daemon"]["aborts"]["timeout"]
    c = Raw(quick.endpoint)
    c.send({"type": "generate", "id": "stuck", "prompt": "never read", "params": {**STUCK, "n": 16}})
    silent = Raw(quick.endpoint)
    silent.send({"type": "generate", "id": "silent", "prompt": "never heard", "params": STUCK})
    held, deadline = [], time.monotonic() + 30
    while True:
        s = stats(quick.endpoint)
        held.append(s["daemon"]["held_bytes"])
        if s["daemon"]["aborts"]["timeout"] >= before + 2:
            break
        assert time.monotonic() < deadline, s["daemon"]
        c.send({"type": "heartbeat"})
        time.sleep(0.02)
    wait_idle(quick.endpoint, timeout=10)
    tokens = 0
    while c.sock.poll(200):
        msg = msgpack.unpackb(c.sock.recv(), raw=False)
        assert msg["type"] in ("delta", "heartbeat"), msg  # dropped: no final could reach it
        tokens += len(msg.get("token_ids", ()))
    print(f"\nthe daemon held at most {max(held)} B for the stuck client; it got {tokens} of 32000 tokens")
    assert 0 < max(held) < 2 * MIB and tokens < 16 * 2000
    c.close()
    silent.close()


def test_a_stream_sent_right_after_hello_is_kept_alive_at_the_daemons_interval(quick):
    """The asyncio client's heartbeats first waited its default interval (1 s), begun before hello's
    reply named the daemon's (0.15 s here, with a 0.5 s client_timeout): a stream sent at once after
    hello that ran past 0.5 s was aborted as a silent client's. The reply now starts the wait over."""
    async def main():
        async with AsyncClient(quick.endpoint) as c:
            await c.hello()
            t0 = time.monotonic()
            async with c.stream("a long one", max_tokens=3000, ignore_eos=True) as s:
                async for _ in s:
                    pass
            return s.final, time.monotonic() - t0

    before = stats(quick.endpoint)["daemon"]["aborts"]["timeout"]
    final, took = asyncio.run(main())
    assert final.finish_reason == "length" and final.usage["completion_tokens"] == 3000, final
    assert took > 2 * QUICK_TIMEOUT, f"the stream took {took:.2f} s: too short to show anything"
    assert stats(quick.endpoint)["daemon"]["aborts"]["timeout"] == before


def test_dropping_an_unfinished_stream_aborts_it_from_the_clients_loop(daemon):
    """AsyncStream.__del__ used to send on the socket from the finalizer's thread; it now hands the
    abort to the client's loop. Dropped on another thread, the stream is still aborted."""
    async def main():
        async with AsyncClient(daemon.endpoint) as c:
            await c.hello()
            before = (await c.stats())["daemon"]["aborts"]["client"]
            held = [c.stream("dropped", max_tokens=2000, ignore_eos=True)]
            await held[0].__anext__()
            await asyncio.to_thread(held.clear)  # the last reference goes on that thread
            gc.collect()
            for _ in range(50):
                if (await c.stats())["daemon"]["aborts"]["client"] == before + 1:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the dropped stream was not aborted")

    asyncio.run(main())
    wait_idle(daemon.endpoint)


def blocker(endpoint: str, seconds: float, started: threading.Event) -> None:
    """Every engine slot busy for `seconds`, from a client that reads and heartbeats."""
    async def main():
        async with AsyncClient(endpoint) as c:
            await c.hello()
            async with c.stream("block", n=16, max_tokens=4000, ignore_eos=True) as s:
                t0, running = None, set()
                async for d in s:
                    running.add(d.index)
                    if len(running) == 16 and t0 is None:  # every slot taken (the samples start one step apart):
                        t0 = time.monotonic()  # the `seconds` count from here, whatever the start took
                        started.set()
                    if t0 is not None and time.monotonic() - t0 > seconds:
                        break

    asyncio.run(main())


def test_a_forgotten_client_gets_its_first_heartbeat_at_once(daemon):
    """The daemon half of the idle 503: a client the daemon forgot (or a new one) with a request
    waiting got its first heartbeat a whole interval late; now at the next sweep."""
    from test_daemon_harness import HEARTBEAT

    started = threading.Event()
    t = threading.Thread(target=blocker, args=(daemon.endpoint, 2.0, started))
    t.start()
    try:
        assert started.wait(30)
        c = Raw(daemon.endpoint)
        c.send({"type": "generate", "id": "q", "prompt": "queued", "params": {"max_tokens": 4}})
        t0 = time.monotonic()
        first = c.recv(5)
        assert first["type"] == "heartbeat" and time.monotonic() - t0 < HEARTBEAT * 0.6, (first, time.monotonic() - t0)
        c.close()
    finally:
        t.join(30)
    wait_idle(daemon.endpoint)


def test_the_first_request_after_an_idle_spell_answers(daemon, gateway):
    """The idle 503 end to end: the gateway idle past its timeout and the daemon's forgetting (shrunk
    to 1 s here; the 60 s of a real daemon were checked by hand), then a request whose reply takes
    2 s (it queues behind a full engine) answers 200."""
    import http.client

    conn = http.client.HTTPConnection(*gateway.addr, timeout=30)
    conn.request("GET", "/v1/models")
    assert conn.getresponse().read() and gateway.link.client is not None
    idle = max(PEER_FORGET, gateway.link.client.timeout) + 1.0
    time.sleep(idle)
    started = threading.Event()
    t = threading.Thread(target=blocker, args=(daemon.endpoint, 2.0, started))
    t.start()
    try:
        assert started.wait(30)
        t0 = time.monotonic()
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        elapsed = time.monotonic() - t0
    finally:
        t.join(30)
    assert resp.status == 200, body
    assert elapsed > 1.0, elapsed  # the reply took longer than a heartbeat interval
    conn.close()
    wait_idle(daemon.endpoint)
