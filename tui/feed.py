"""The dashboard's only link to the daemon: docs/protocol.md, nothing else.

A `Connection` says `hello` on a DEALER (for the PUB endpoint), asks `stats`
once so the screen fills at once, then follows the PUB feed. When the feed
falls silent it asks `stats` again; no answer means the daemon is gone.
`follow()` wraps that in the reconnect loop a thread worker runs. Plain data
out (the events below), so it is testable without Textual; no torch."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator

import msgpack
import zmq

from ridge.daemon import protocol
from ridge.daemon.client import resolve_endpoint
from ridge.daemon.transport.endpoint import ipc_path, socket_alive

MAX_FRAME = 64 << 20  # a stats frame lists at most running + 64 waiting requests; be generous
SILENCE_S = 1.5  # no PUB frame for this long: ask `stats` over the DEALER
REPLY_S = 2.0  # ...and give the daemon this long to answer before calling it gone
RETRY_S = 1.0  # between reconnect attempts


class Lost(Exception):
    """The daemon stopped answering."""


# -- events handed to the app -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Connected:
    endpoint: str
    hello: dict


@dataclass(frozen=True, slots=True)
class Frame:
    reply: dict  # a decoded `stats` reply or PUB snapshot (docs/protocol.md §3.6, §6)
    raw: bytes  # the msgpack bytes it came from, for --record


@dataclass(frozen=True, slots=True)
class Disconnected:
    reason: str


Event = Connected | Frame | Disconnected


def decode(raw: bytes) -> dict:
    """One stats map, through the daemon's own decoder and checks. Raises protocol.ProtocolError."""
    msg = protocol.unpack(raw, MAX_FRAME)
    protocol.check_plain(msg)
    if msg.get("type") != "stats" or not isinstance(msg.get("stats"), dict):
        raise protocol.ProtocolError(protocol.INVALID_FIELD, f"expected a stats map, got type {msg.get('type')!r}")
    return msg


class Connection:
    def __init__(self, endpoint: str | None = None, ctx: zmq.Context | None = None, silence: float = SILENCE_S,
                 reply_timeout: float = REPLY_S):
        self.endpoint = resolve_endpoint(endpoint)  # DaemonUnavailable when nothing listens
        self.ctx = ctx or zmq.Context.instance()
        self.silence, self.reply_timeout = silence, reply_timeout
        self._ids = (f"top-{n}" for n in itertools.count())
        self.dealer = self._socket(zmq.DEALER)
        self.dealer.connect(self.endpoint)
        self.sub: zmq.Socket | None = None
        self._last = time.monotonic()
        try:
            self.hello = self._call({"type": "hello", "versions": [protocol.VERSION], "client": "ridge-top"})
            if self.hello.get("type") != "hello":
                raise Lost(f"hello answered with {self.hello.get('code', self.hello.get('type'))}")
            if pub := self.hello.get("pub_endpoint"):
                self.sub = self._socket(zmq.SUB)
                self.sub.setsockopt(zmq.SUBSCRIBE, protocol.PUB_TOPIC)
                self.sub.connect(pub)
        except Exception:
            self.close()
            raise

    def _socket(self, kind: int) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        return s

    def _request(self, msg: dict) -> bytes:
        """Send one message on the DEALER; -> the raw frame of the reply with its id. Raises Lost."""
        rid = next(self._ids)
        self.dealer.send(protocol.pack({"v": protocol.VERSION, "id": rid, **msg}))
        deadline = time.monotonic() + self.reply_timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.dealer.poll(int(left * 1000) + 1):
                raw = self.dealer.recv()
                if protocol.unpack(raw, MAX_FRAME).get("id") == rid:  # else a late reply to an earlier ask
                    self._last = time.monotonic()
                    return raw
        raise Lost(f"no reply from {self.endpoint} in {self.reply_timeout:.0f} s")

    def _call(self, msg: dict) -> dict:
        return protocol.unpack(self._request(msg), MAX_FRAME)

    def ask_stats(self) -> Frame:
        raw = self._request({"type": "stats"})
        return Frame(decode(raw), raw)

    def next(self, timeout: float) -> Frame | None:
        """The next snapshot within `timeout` s, or None. Raises Lost."""
        if self.sub is not None and self.sub.poll(int(timeout * 1000)):
            topic, raw = self.sub.recv_multipart()[:2]
            self._last = time.monotonic()
            return Frame(decode(raw), raw)
        if self.sub is None:
            time.sleep(timeout)
        if time.monotonic() - self._last < self.silence:
            return None
        path = ipc_path(self.endpoint)
        if path is not None and not socket_alive(path):  # the daemon removes its socket as it exits
            raise Lost(f"{self.endpoint} is gone")
        return self.ask_stats()

    def close(self) -> None:
        for s in (self.dealer, self.sub):
            if s is not None:
                s.close(0)


def follow(endpoint: str | None, emit: Callable[[Event], None], stopped: Callable[[], bool],
           tick: float = 0.2, retry: float = RETRY_S, **kw) -> None:
    """Connect, stream snapshots, reconnect after any loss, until stopped(). Whatever goes wrong
    (no daemon, a daemon gone silent, a frame that does not decode) becomes a Disconnected event
    and a retry: the dashboard never freezes on an exception."""
    connected: bool | None = None
    while not stopped():
        conn = None
        try:
            conn = Connection(endpoint, **kw)
            emit(Connected(conn.endpoint, conn.hello))
            connected = True
            emit(conn.ask_stats())
            while not stopped():
                if (frame := conn.next(tick)) is not None:
                    emit(frame)
        except Exception as e:
            if connected is not False:  # say it once per outage
                emit(Disconnected(_reason(e)))
                connected = False
        finally:
            if conn is not None:
                conn.close()
        _sleep(retry if conn is None else tick, stopped, tick)


def _reason(e: Exception) -> str:
    if isinstance(e, Lost):
        return str(e)
    return getattr(e, "message", None) or f"{type(e).__name__}: {e}"  # DaemonUnavailable has a message


def _sleep(seconds: float, stopped: Callable[[], bool], tick: float) -> None:
    end = time.monotonic() + seconds
    while not stopped() and time.monotonic() < end:
        time.sleep(min(tick, max(0.0, end - time.monotonic())))


# -- recordings: raw stats frames, one msgpack bin object after another --------------------
def record(path: Path, raw: bytes) -> None:
    with open(path, "ab") as f:
        f.write(msgpack.packb(raw, use_bin_type=True))


def replay(path: Path) -> Iterator[Frame]:
    with open(path, "rb") as f:
        for raw in msgpack.Unpacker(f, raw=False, max_bin_len=MAX_FRAME):
            yield Frame(decode(raw), raw)
