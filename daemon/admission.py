"""The validator's CPU work off the socket thread (issue 24): tokenizing
prompts, rendering chat templates and compiling constraints run on a small
pool of worker threads, so one large request never holds up heartbeats,
`health` or another client's frames (docs/protocol.md §10).

The workers only call the validator (the tokenizer and llguidance) and encode
small replies; no torch, no sockets, no daemon state. Their results come back
as the engine's do: objects the socket thread reads, plus a pipe byte it polls. The socket thread takes
them in each connection's arrival order (a later small request of a client
never overtakes its earlier large one) and does the rest itself, so every
piece of daemon state stays on one thread."""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from . import protocol as P
from .protocol import ProtocolError
from .wake import drain, poke, wake_pipe

# One core is left to the socket and engine threads: on 2 cores, 2 workers made health's p99
# 17-30 ms under load, 1 worker 5 ms (docs/benchmarks.md, health under admission load).
WORKERS = max(1, min(4, (os.cpu_count() or 1) - 1))
# Admissions queued or running, and the bytes of their frames: a burst of small requests (one
# client may send 256) passes, while what waits stays bounded in memory; past either, `busy`.
MAX_PENDING = 1024
MAX_PENDING_BYTES = 64 << 20


class Pending:
    """One message whose validator work runs on a worker: its result or the error it raised."""
    __slots__ = ("peer", "env", "work", "size", "done", "result", "error", "aborted")

    def __init__(self, peer, env, work, size: int):
        self.peer, self.env, self.work, self.size = peer, env, work, size
        self.done = self.aborted = False
        self.result = self.error = None


class Admission:
    def __init__(self, workers: int = WORKERS, max_pending: int = MAX_PENDING, max_bytes: int = MAX_PENDING_BYTES):
        self.max_pending, self.max_bytes = max_pending, max_bytes
        self.bytes = 0
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ridge-admit")
        self.queues: dict = {}  # peer key -> deque[Pending], arrival order; a key goes when its deque empties
        self.count = 0
        self.wake_r, self._wake_w = wake_pipe()

    # -- the socket thread -----------------------------------------------------------
    def submit(self, peer, env, work, size: int) -> Pending:
        """Queue `work(env)` for a worker; `size`: its frame's bytes. Past either bound the client is
        told to retry (busy); the first admission always passes, whatever its size."""
        if self.count >= self.max_pending or (self.count and self.bytes + size > self.max_bytes):
            raise ProtocolError(P.BUSY, f"the daemon is admitting {self.count} messages ({self.bytes} bytes), "
                                "its limit; retry later", env.id, retry_after=0.1)
        p = Pending(peer, env, work, size)
        self.queues.setdefault(peer.key, deque()).append(p)
        self.count += 1
        self.bytes += size
        self.pool.submit(self._run, p)
        return p

    def ready(self) -> list[Pending]:
        """Finished admissions, each connection's in arrival order: a queue's head that is still
        running holds back what its client sent after it (and nothing of other clients)."""
        drain(self.wake_r)
        out = []
        for key in [k for k, q in self.queues.items() if q[0].done]:
            q = self.queues[key]
            while q and q[0].done:
                out.append(q.popleft())
            if not q:
                del self.queues[key]
        self.count -= len(out)
        self.bytes -= sum(p.size for p in out)
        return out

    def pending_for(self, peer) -> list[Pending]:
        return list(self.queues.get(peer.key, ()))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        os.close(self.wake_r)
        os.close(self._wake_w)

    # -- a worker --------------------------------------------------------------------
    def _run(self, p: Pending) -> None:
        try:
            p.result = p.work(p.env)
        except Exception as e:  # ProtocolError and daemon bugs alike go back to the socket thread
            p.error = e
        finally:
            p.done = True  # after the result: the socket thread reads done first
            poke(self._wake_w)
