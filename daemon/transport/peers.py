"""A connected client, as the ROUTER sees it: its requests, its liveness, and
the frames waiting for room in its queue (docs/protocol.md §4.4)."""
from __future__ import annotations

import errno
import time
from collections import deque

import zmq

from ..protocol import SUPPORTED


class Peer:
    __slots__ = ("key", "sock", "ident", "identity", "requests", "dirty", "outq", "last_recv", "last_send",
                 "stalled_since", "gone", "version")

    def __init__(self, key, sock: zmq.Socket, ident: bytes, identity: str = ""):
        self.key, self.sock, self.ident = key, sock, ident
        self.identity = identity  # who is at the other end, for prefix sharing (daemon/transport/sharing.py)
        self.requests: dict = {}  # client id -> InFlight
        self.dirty: dict = {}  # InFlight with frames to take, in arrival order (a dict as an ordered set)
        self.outq: deque[bytes] = deque()  # encoded frames the socket had no room for yet
        self.last_recv = time.monotonic()
        # Sent nothing yet: its first heartbeat goes out at the first sweep once it has a request in
        # flight, also when it is a client that idled until the daemon forgot it (§4.4).
        self.last_send = float("-inf")
        self.stalled_since: float | None = None
        self.gone = False
        # The protocol version of its last message, which the daemon's frames to it are in; the oldest
        # until it has sent one, since its errors and heartbeats read the same in every version.
        self.version = SUPPORTED[0]

    def send_pending(self) -> tuple[str | None, int]:
        """Send queued frames until the queue empties or the socket pushes back.
        -> (None, "stalled" (the client is not reading fast enough) or "gone" (its connection closed),
        frames sent)."""
        sock, ident, q = self.sock, self.ident, self.outq
        sent = 0
        while q:
            try:
                sock.send_multipart((ident, q[0]), zmq.NOBLOCK)
            except zmq.Again:
                if self.stalled_since is None:
                    self.stalled_since = time.monotonic()
                return "stalled", sent
            except zmq.ZMQError as e:
                if e.errno == errno.EHOSTUNREACH:  # ROUTER_MANDATORY: the peer's connection is gone
                    return "gone", sent
                raise
            q.popleft()
            sent += 1
            self.last_send = time.monotonic()
        self.stalled_since = None
        return None, sent
