"""The validator's CPU work off the socket thread (issue 24): tokenizing
prompts, rendering chat templates and compiling constraints run on a small
pool of worker threads, so one large request never holds up heartbeats,
`health` or another client's frames (docs/protocol.md §10).

The workers only call the validator (the tokenizer and llguidance) and encode
small replies; no torch, no sockets, no daemon state. Their results come back
as the engine's do: objects the socket thread reads, plus a pipe byte it polls. The socket thread takes
them in each connection's arrival order (a later small request of a client
never overtakes its earlier large one) and does the rest itself, so every
piece of daemon state stays on one thread.

Fair shares (issue 38): on 2 cores there is one worker, so whoever's work runs
decides everyone's latency. Work waits in one queue per connection, grouped by
principal (the identity the transport proves: daemon/transport/sharing.py), and the
workers serve principals round-robin, then each principal's connections
round-robin: opening more connections or sending more work buys a principal
nothing over another. Work that is a generator (a rerank) runs one step per
turn, so a long admission is interleaved with everyone else's, never waited for
whole. One principal's outstanding work is capped apart from the daemon's."""
from __future__ import annotations

import os
import threading
import types
from collections import OrderedDict, deque

from .. import protocol as P
from ..protocol import ProtocolError
from ..transport.wake import drain, poke, wake_pipe

# One core is left to the socket and engine threads: on 2 cores, 2 workers made health's p99
# 17-30 ms under load, 1 worker 5 ms (docs/benchmarks.md, health under admission load).
WORKERS = max(1, min(4, (os.cpu_count() or 1) - 1))
# Admissions queued or running, and the bytes of their frames: a burst of small requests (one
# client may send 256) passes, while what waits stays bounded in memory; past either, `busy`.
MAX_PENDING = 1024
MAX_PENDING_BYTES = 64 << 20
# One principal's share of those: a client (or a user's many connections) that floods admission is
# told `busy` while others still get in. Its first admission always passes, whatever its size.
MAX_PRINCIPAL_PENDING = 256
MAX_PRINCIPAL_BYTES = 16 << 20


class Pending:
    """One message whose validator work runs on a worker: its result or the error it raised."""
    __slots__ = ("peer", "env", "work", "size", "done", "result", "error", "aborted", "principal", "steps")

    def __init__(self, peer, env, work, size: int, principal: str):
        self.peer, self.env, self.work, self.size, self.principal = peer, env, work, size, principal
        self.done = self.aborted = False
        self.result = self.error = self.steps = None


def principal_of(peer) -> str:
    """Whose share a connection's work counts against: what its transport proves (sharing.py)."""
    return getattr(peer, "identity", "") or ""


class Admission:
    def __init__(self, workers: int = WORKERS, max_pending: int = MAX_PENDING, max_bytes: int = MAX_PENDING_BYTES,
                 principal_pending: int = MAX_PRINCIPAL_PENDING, principal_bytes: int = MAX_PRINCIPAL_BYTES):
        self.max_pending, self.max_bytes = max_pending, max_bytes
        self.principal_pending, self.principal_bytes = principal_pending, principal_bytes
        self.bytes = 0
        self.queues: dict = {}  # peer key -> deque[Pending], arrival order; a key goes when its deque empties
        self.count = 0
        self.owed: dict = {}  # principal -> [admissions, bytes] not yet taken by the socket thread
        # What waits for a worker: principal -> (peer key -> deque[Pending]); both maps in turn order.
        self._runnable: OrderedDict = OrderedDict()
        self._served: dict = {}  # principal, or connection key -> the turn it was last given a worker
        self._turn = 0
        self._cv = threading.Condition()
        self._closed = False
        self.wake_r, self._wake_w = wake_pipe()
        self._threads = [threading.Thread(target=self._worker, name=f"ridge-admit_{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    # -- the socket thread -----------------------------------------------------------
    def submit(self, peer, env, work, size: int) -> Pending:
        """Queue `work(env)` for a worker; `size`: its frame's bytes. Past the daemon's bounds, or its
        principal's, the client is told to retry (busy); the first admission always passes, whatever
        its size."""
        who = principal_of(peer)
        n, b = self.owed.get(who, (0, 0))
        if self.count >= self.max_pending or (self.count and self.bytes + size > self.max_bytes):
            raise ProtocolError(P.BUSY, f"the daemon is admitting {self.count} messages ({self.bytes} bytes), "
                                "its limit; retry later", env.id, retry_after=0.1)
        if n >= self.principal_pending or (n and b + size > self.principal_bytes):
            raise ProtocolError(P.BUSY, f"you have {n} messages ({b} bytes) being admitted, the limit for one "
                                "user; retry later", env.id, retry_after=0.1)
        p = Pending(peer, env, work, size, who)
        self.queues.setdefault(peer.key, deque()).append(p)
        self.count += 1
        self.bytes += size
        self.owed[who] = [n + 1, b + size]
        with self._cv:
            self._runnable.setdefault(who, OrderedDict()).setdefault(peer.key, deque()).append(p)
            self._cv.notify()
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
        for p in out:
            o = self.owed[p.principal]
            o[0] -= 1
            o[1] -= p.size
            if not o[0]:
                del self.owed[p.principal]
        return out

    def pending_for(self, peer) -> list[Pending]:
        return list(self.queues.get(peer.key, ()))

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._runnable.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        os.close(self.wake_r)
        os.close(self._wake_w)

    # -- a worker --------------------------------------------------------------------
    def _next(self) -> Pending | None:
        """The oldest work of the connection served longest ago, of the principal served longest ago
        (one that had nothing waiting for a while keeps its place: its turn is not lost by leaving)."""
        with self._cv:
            while not self._runnable and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            self._turn += 1
            last = self._served
            who = min(self._runnable, key=lambda k: last.get(k, -1))
            conns = self._runnable[who]
            key = min(conns, key=lambda k: last.get(k, -1))
            q = conns[key]
            p = q.popleft()
            last[who] = last[key] = self._turn
            if not q:
                del conns[key]
            if not conns:
                del self._runnable[who]
            if len(last) > 4096:  # those with nothing waiting start afresh
                keep = {k for c in self._runnable.values() for k in c} | set(self._runnable)
                self._served = {k: t for k, t in last.items() if k in keep}
            return p

    def _resume(self, p: Pending) -> None:
        """A stepped work's next step waits its principal's next turn, ahead of its connection's others."""
        with self._cv:
            if self._closed:
                return
            self._runnable.setdefault(p.principal, OrderedDict()).setdefault(p.peer.key, deque()).appendleft(p)
            self._cv.notify()

    def _worker(self) -> None:
        while (p := self._next()) is not None:
            if self._step(p):
                self._resume(p)

    def _step(self, p: Pending) -> bool:
        """Run p's work, or its next step; -> True when steps remain."""
        try:
            if p.steps is None:
                out = p.work(p.env)
                if not isinstance(out, types.GeneratorType):
                    p.result = out
                    return self._finish(p)
                p.steps = out
            if getattr(p.peer, "gone", False):  # no one to answer: the rest of its work is not done
                return self._finish(p)
            next(p.steps)
            return True
        except StopIteration as e:
            p.result = e.value
        except Exception as e:  # ProtocolError and daemon bugs alike go back to the socket thread
            p.error = e
        return self._finish(p)

    def _finish(self, p: Pending) -> bool:
        p.steps = None
        p.done = True  # after the result: the socket thread reads done first
        poke(self._wake_w)
        return False
