"""The socket thread's loop: ROUTER in, frames out (docs/protocol.md §10).

One thread owns every ZeroMQ socket. It decodes each frame and hands its message to a handler
(the Server's table: daemon/server.py), takes the admission workers' results and the engine
threads' outputs, writes what waits for each client as its socket makes room, keeps clients'
liveness (heartbeats, timeouts), publishes stats, and drains on a signal.

SocketLoop is one part of the Server, beside the request flow (frontend/requests.py) and the
small answers (frontend/control.py): it reads the state they keep (peers, inflight, models,
admission) and calls them by name (_on_admitted, _on_engine, _peer_gone, _time_out,
_engine_abort, _mark, stats_message); it never reads a request's body."""
from __future__ import annotations

import logging
import os
import time

import zmq

from ridge.errors import internal_error

from .. import protocol as P
from ..protocol import ProtocolError, message, pack
from .endpoint import ipc_path, secure_curve_socket
from .peers import Peer
from .sharing import peer_identity

log = logging.getLogger("ridge.daemon")

SWEEP_S = 0.1  # liveness sweeps and retries of stalled queues
PEER_FORGET_S = 60.0  # a peer with nothing in flight is forgotten after this much silence
FORCE_AFTER_ABORT_S = 5.0  # past the grace period, finals the engine has not sent by then are written here


class SocketLoop:
    """The Server's sockets and their loop; its state is set in Server.__init__ (daemon/server.py)."""

    # -- sockets ----------------------------------------------------------------
    def _router(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a closed peer fails (EHOSTUNREACH): liveness
        s.setsockopt(zmq.SNDHWM, 1000)
        s.setsockopt(zmq.RCVHWM, 10000)
        # per frame: a message's map, or one of a generate's image frames (§3.2.5), bounded after
        s.setsockopt(zmq.MAXMSGSIZE, max(4 * self.cfg.limits.max_frame_bytes, P.MAX_IMAGE_FRAME_BYTES))
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # ZMTP pings: a TCP peer that vanished is closed after 5 s
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        s.setsockopt(zmq.HEARTBEAT_TTL, 10000)
        return s

    def bind(self) -> None:
        main = self._router()
        main.bind(self.cfg.endpoint)
        if path := ipc_path(self.cfg.endpoint):
            os.chmod(path, self.cfg.socket_mode)
        self.routers.append(main)
        if self.cfg.tcp:
            tcp = self._router()
            if self.cfg.curve is not None:
                self.auth = secure_curve_socket(self.ctx, tcp, self.cfg.curve)
            tcp.bind(self.cfg.tcp)
            self.routers.append(tcp)
        if self.cfg.pub_endpoint:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.SNDHWM, 16)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind(self.cfg.pub_endpoint)
            if path := ipc_path(self.cfg.pub_endpoint):
                os.chmod(path, self.cfg.socket_mode)

    def close(self) -> None:
        for s in self.routers + ([self.pub] if self.pub else []):
            s.close()
        if getattr(self, "auth", None) is not None:
            self.auth.stop()
        self.admission.close()

    # -- the loop ---------------------------------------------------------------
    def request_drain(self) -> None:
        """From a signal handler: the first call drains, the second skips the rest of the grace."""
        if self._drain_requested:
            self._hurry = True
        self._drain_requested = True

    def run(self) -> int:
        poller = zmq.Poller()
        for r in self.routers:
            poller.register(r, zmq.POLLIN)
        poller.register(self.admission.wake_r, zmq.POLLIN)
        polled: set = set()  # the engine loops' wake pipes: one per model loaded or loading
        while True:
            loops = self.models.loops()
            for fd in {lp.wake_r for lp in loops} - polled:
                poller.register(fd, zmq.POLLIN)
                polled.add(fd)
            for fd in polled - {lp.wake_r for lp in loops}:
                poller.unregister(fd)
                polled.discard(fd)
            events = dict(poller.poll(50))
            for r in self.routers:
                if r in events:
                    self._receive(r)
            if self.admission.wake_r in events:
                self._on_admitted(self.admission.ready())
            for lp in loops:
                if lp.wake_r in events or lp.outbox:
                    self._on_engine(lp.drain_outbox(), lp)
            now = time.monotonic()
            self._timers(now)
            if self._drain_requested and self.state == "ok":
                self._start_drain(now)
            if self.state != "ok" and self._drain_step(now):
                return 1 if self.state == "error" else 0

    def _receive(self, sock: zmq.Socket) -> None:
        index = self.routers.index(sock)
        for _ in range(256):  # then let engine outputs through
            try:
                head = sock.recv(zmq.NOBLOCK, copy=False)  # a Frame: it carries the connection's properties
            except zmq.Again:
                return
            frames = [head.bytes] + (sock.recv_multipart() if head.more else [])
            self.counts["frames_in"] += 1
            key = (index, frames[0])
            peer = self.peers.get(key)
            if peer is None:
                identity = peer_identity(head, sock.last_endpoint.startswith(b"ipc://"))
                peer = self.peers[key] = Peer(key, sock, frames[0], identity)
            peer.last_recv = time.monotonic()
            self._handle(peer, frames[1:])

    def _handle(self, peer: Peer, frames: list[bytes]) -> None:
        rid = None
        try:
            if not frames or len(frames) > 1 + P.MAX_IMAGES:  # a map, then a generate's image frames (§3.2.5)
                raise ProtocolError(P.BAD_FRAME, f"a message is one frame, then at most {P.MAX_IMAGES} image "
                                    f"frames; got {len(frames)}")
            msg = P.unpack(frames[0], self.cfg.limits.max_frame_bytes)
            rid = P.reply_id_of(msg)
            P.check_plain(msg, rid)
            env = P.envelope(msg, frames[1:])
            peer.version = env.v  # what it is answered in, heartbeats too
            # what an admission of this message holds (frontend/admission.py)
            self._frame_bytes = sum(len(f) for f in frames)
            self.handlers[env.type](peer, env)
        except Exception as e:
            self._refuse(peer, e, rid)

    def _refuse(self, peer: Peer, e: Exception, rid: str | None) -> None:
        """The error frame for what handling a message raised; a daemon bug must not take the daemon down."""
        self.counts["errors_sent"] += 1
        if isinstance(e, ProtocolError):
            self._send(peer, P.error(e.code, e.message, e.request_id, **e.extra))
        else:
            self._send(peer, P.error(P.INTERNAL, internal_error(log, "internal error on a client message", e), rid))

    def _send(self, peer: Peer, msg: dict) -> None:
        msg["v"] = peer.version
        if not peer.gone:
            peer.outq.append(pack(msg))
            self._flush(peer)

    def _flush(self, peer: Peer) -> None:
        while not peer.gone:
            status, sent = peer.send_pending()
            self.counts["frames_out"] += sent
            if status == "gone":
                self._peer_gone(peer, "disconnected")
            if status or not peer.dirty:
                return
            for inf in peer.dirty:
                peer.outq.extend(pack(f) for f in inf.take_frames())
                if inf.final_sent:
                    self._retire(inf)
            peer.dirty.clear()

    # -- timers: liveness, stats feed, systemd ----------------------------------
    def _timers(self, now: float) -> None:
        key = (self.loop.snapshot[0], tuple((s.name, s.state) for s in self.models.slots.values()))
        if self.pub is not None and key != self._published_seq:
            self._published_seq = key
            try:
                feed = self.stats_message("stats")  # read by every member of the socket's group
                feed["model"] = {k: v for k, v in feed["model"].items() if k != "path"}
                self.pub.send_multipart((P.PUB_TOPIC, pack(feed)), zmq.NOBLOCK)
            except zmq.Again:
                pass
        if now - self._last_sweep >= SWEEP_S:
            self._last_sweep = now
            self._sweep(now)
            self.models.tick(now)
        if self.notifier is not None:
            if now - self._last_status >= 2.0:
                self._last_status = now
                st = self.loop.snapshot[2]
                self.notifier.status(f"{self.state}: {self.model['name']}, {st['running']} running, "
                                     f"{st['waiting']} waiting, {len(self.peers)} clients")
            self.notifier.watchdog(all(now - lp.tick < 30.0 and lp.is_alive() for lp in self.models.loops()
                                       if (s := self.models.slot_of(lp)) is not None and s.state == "ready"))

    def _sweep(self, now: float) -> None:
        c = self.cfg
        for peer in list(self.peers.values()):
            if peer.outq or peer.dirty:
                self._flush(peer)
            if peer.gone:
                continue
            if peer.requests:
                if peer.stalled_since is not None and now - peer.stalled_since > c.client_timeout:
                    self._peer_gone(peer, "timeout")  # not reading: nothing more can reach it
                elif now - peer.last_recv > c.client_timeout:
                    self._time_out(peer)
                elif now - peer.last_send >= c.heartbeat_interval and not peer.outq:
                    self._send(peer, message("heartbeat", time=time.time()))
            elif not peer.outq and now - peer.last_recv > PEER_FORGET_S and not self.admission.pending_for(peer):
                del self.peers[peer.key]

    # -- draining ---------------------------------------------------------------
    def _start_drain(self, now: float) -> None:
        self.state = "draining"
        self._drain_deadline = now + self.cfg.drain_grace
        self.models.fail_waiting(P.SHUTTING_DOWN, "the daemon is shutting down before the model loaded")
        log.info("draining: %d request(s) in flight, %.0f s grace", len(self.inflight), self.cfg.drain_grace)
        if self.notifier is not None:
            self.notifier.stopping(f"draining {len(self.inflight)} request(s)")
        for peer in list(self.peers.values()):
            self._send(peer, message("shutdown", grace=self.cfg.drain_grace))

    def _drain_step(self, now: float) -> bool:
        """-> True once every request has its final frame out (or its client is gone)."""
        if self._forced_at is None and (self.state == "error" or self._hurry or now >= self._drain_deadline):
            self._forced_at = now
            for inf in self.inflight.values():
                if not inf.done and inf.detail is None:  # not already aborted for a timeout
                    inf.detail = "shutdown"
                    self.aborts["shutdown"] += 1
                    self._engine_abort(inf)
        if self._forced_at is not None and now - self._forced_at > FORCE_AFTER_ABORT_S:
            touched: dict = {}
            for inf in list(self.inflight.values()):  # the engine is stuck: write the finals ourselves
                inf.force_finish("abort", "shutdown")
                self._mark(inf, touched)
            for peer in touched:
                self._flush(peer)
        if self.inflight or self.admission.count:  # a pending admission ends in a reply too
            return False
        self._quiet_since = self._quiet_since or now
        pending = [p for p in self.peers.values() if p.outq]
        for p in pending:
            self._flush(p)
        return not any(p.outq for p in pending) or now - self._quiet_since > 2.0  # a client not reading
