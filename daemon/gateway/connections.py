"""How many HTTP connections the gateway holds, and for how long one may take to
say what it wants.

Every connection is a file descriptor of the daemon's process, which its
socket clients, model files and KV tier need too; when they run out, any of
them can fail (docs/service.md, "Limits"). So the process's HTTP connections,
over both listeners, are capped well below the open-file limit, and a
connection must send each request's headers within `http_header_timeout`
seconds (from its connect, or the first byte of its next request) and its
body within `http_body_timeout` of the headers, or it is closed.

At the cap, the connection that has been idle longest (one with no request
in progress: still sending headers, or kept alive between requests) is closed
to make room: a client that sends its headers at once is never the oldest,
so a flood of connections that send nothing cannot keep it out. Only when
every connection has a request in progress is a new one refused, with 503."""
from __future__ import annotations

import logging
import resource
import threading
import time
from collections import OrderedDict

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ridge.gateway")

# Descriptors kept for everything but HTTP: socket clients (one each), model files, the KV disk tier,
# the ZeroMQ and wake-up pipes, libraries. HTTP gets at most half of what is left, and by default no
# more than the daemon's default max_queue (1,024 requests), past which more connections only wait.
FD_RESERVE = 256
AUTO_MAX_CONNECTIONS = 1024
MIN_CONNECTIONS = 8
FD_CEILING = 1 << 20  # where the hard limit is "unlimited": the kernel's usual nr_open
# Connections asyncio accepts in one go before any of them is counted here (the listen backlog):
# they hold descriptors for a moment, past the cap.
MAX_BACKLOG = 256
REPORT_EVERY_S = 60.0
_BODY = b'{"error": {"message": "too many HTTP connections; retry", "type": "server_error", "code": "busy"}}'
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
           b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


def raise_fd_limit() -> int:
    """The soft open-file limit up to the hard one (systemd's and most shells' soft limit is 1024,
    for select()'s sake, which nothing here uses) -> the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return FD_CEILING if soft == resource.RLIM_INFINITY else soft


def connection_cap(configured: int, fd_limit: int | None = None) -> int:
    """The HTTP connections this process may hold: `configured` (0: automatic), never more than the
    open-file limit leaves once FD_RESERVE is kept and the rest halved."""
    if fd_limit is None:
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fd_limit = FD_CEILING if fd_limit == resource.RLIM_INFINITY else fd_limit
    bound = max(MIN_CONNECTIONS, (fd_limit - FD_RESERVE) // 2)
    if not configured:
        return min(AUTO_MAX_CONNECTIONS, bound)
    if configured > bound:
        log.warning("http_max_connections %d leaves too few of the %d open files for the daemon; using %d",
                    configured, fd_limit, bound)
        return bound
    return configured


class Connections:
    """The process's HTTP connections, over every listener and its thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.cap = AUTO_MAX_CONNECTIONS
        self.open = 0
        self.idle: OrderedDict = OrderedDict()  # connections with no request in progress, oldest first
        self.closed = {"timed out": 0, "evicted": 0, "refused": 0}
        self._reported, self._last_report = dict(self.closed), -REPORT_EVERY_S

    def admit(self, conn: "GuardedH11") -> bool:
        """Count a new connection, making room by closing the longest-idle one; False: refuse it."""
        with self.lock:
            if self.open >= self.cap:
                if not self.idle:
                    self.closed["refused"] += 1
                    return False
                victim, _ = self.idle.popitem(last=False)
                victim.counted = False
                self.open -= 1
                self.closed["evicted"] += 1
                victim.loop.call_soon_threadsafe(victim.shed)
            self.open += 1
            self.idle[conn] = None
        return True

    def busy(self, conn: "GuardedH11") -> None:
        with self.lock:
            self.idle.pop(conn, None)

    def rest(self, conn: "GuardedH11") -> None:
        with self.lock:
            if conn.counted:
                self.idle[conn] = None
                self.idle.move_to_end(conn)

    def gone(self, conn: "GuardedH11") -> None:
        with self.lock:
            self.idle.pop(conn, None)
            if conn.counted:
                conn.counted = False
                self.open -= 1

    def count(self, why: str) -> None:
        with self.lock:
            self.closed[why] += 1

    def report(self) -> None:
        """At once, then at most once a minute: how many connections were closed for being slow or surplus."""
        now = time.monotonic()
        if now - self._last_report < REPORT_EVERY_S:
            return
        with self.lock:
            new = {k: v - self._reported[k] for k, v in self.closed.items() if v > self._reported[k]}
            self._reported, self._last_report = dict(self.closed), now
        if new:
            log.warning("HTTP connections closed in the last minute: %s (limit %d connections; headers within "
                        "http_header_timeout, bodies within http_body_timeout)",
                        ", ".join(f"{n} {why}" for why, n in new.items()), self.cap)


CONNECTIONS = Connections()


def guarded(header_timeout: float, body_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol under CONNECTIONS' cap, with these timeouts."""
    return type("GuardedH11", (GuardedH11,), {"header_timeout": header_timeout, "body_timeout": body_timeout})


class GuardedH11(H11Protocol):
    header_timeout: float
    body_timeout: float
    counted = False
    _phase: str | None = None  # "headers" | "body" | "busy" (the app has the request) | None (kept alive)
    _timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if not CONNECTIONS.admit(self):
            transport.write(REFUSAL)
            transport.close()
            CONNECTIONS.report()
            return
        self.counted = True
        self._wait("headers")

    def connection_lost(self, exc) -> None:
        self._wait(None)
        CONNECTIONS.gone(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase is None and self.conn.their_state is h11.IDLE:  # a kept-alive connection's next request
            self._wait("headers")
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timeout for the idle time
        if self.transport.is_closing():
            return
        self._wait(None)
        CONNECTIONS.rest(self)
        if self.conn.their_state is not h11.IDLE:  # a pipelined request, already parsed
            self._phase = "headers"
            self._follow()

    def _follow(self) -> None:
        """Past the headers, the body's deadline; past the body, the app's time, unlimited here."""
        if self.transport.is_closing():
            self._wait(None)
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            return
        if self._phase == "headers":
            CONNECTIONS.busy(self)
            self._wait("body" if state is h11.SEND_BODY else "busy")
        elif self._phase == "body" and state is not h11.SEND_BODY:
            self._wait("busy")

    def _wait(self, phase: str | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        if phase in ("headers", "body"):
            self._timer = self.loop.call_later(self.header_timeout if phase == "headers" else self.body_timeout,
                                               self._late, phase)

    def _late(self, phase: str) -> None:
        self._timer = None
        if self._phase != phase or self.transport.is_closing():
            return
        if phase == "body" and self.flow.read_paused:  # the app is behind, not the client
            self._wait("body")
            return
        CONNECTIONS.count("timed out")
        CONNECTIONS.report()
        self.transport.close()

    def shed(self) -> None:
        """Closed to make room (Connections.admit), unless a request began meanwhile."""
        if self._phase in ("headers", None) and self.conn.their_state is h11.IDLE \
                and not self.transport.is_closing():
            self._wait(None)
            self.transport.close()
        CONNECTIONS.report()
