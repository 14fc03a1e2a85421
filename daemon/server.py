"""The socket thread: ROUTER in, frames out, and everything that is not the
engine's own work (docs/protocol.md §10).

One thread owns every ZeroMQ socket. It decodes and checks frames, answers
the small operations itself, turns engine outputs into frames, keeps clients'
liveness, publishes stats, and drains on a signal. What costs CPU in
proportion to a request (tokenizing, chat templates, compiling constraints)
runs on the admission workers (daemon/admission.py); this thread only takes
their results, each client's in the order it sent them."""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from ridge.errors import internal_error

from . import protocol as P
from .admission import Admission
from .embeddings import EmbedFlight
from .engine_loop import EngineLoop
from .models import Models
from .peers import Peer
from .protocol import Limits, ProtocolError, message, pack
from .registry import FOREVER, Entry, Registry
from .sharing import engine_salt, peer_identity, uid_identity
from .streams import InFlight
from .validate import Validator

log = logging.getLogger("ridge.daemon")

SWEEP_S = 0.1  # liveness sweeps and retries of stalled queues
PEER_FORGET_S = 60.0  # a peer with nothing in flight is forgotten after this much silence
FORCE_AFTER_ABORT_S = 5.0  # past the grace period, finals the engine has not sent by then are written here


class _NoEngine:
    """No model is loaded: the last engine stats known, and no engine to be late or dead."""

    def __init__(self, snapshot: tuple):
        self.snapshot, self.tick = snapshot, time.monotonic()

    @staticmethod
    def is_alive() -> bool:
        return True


@dataclass(kw_only=True)
class ServerConfig:
    """Built by `ridge serve` (daemon/serve.py) from the resolved options: the values of
    options have no defaults here, only in their declarations (daemon/config.py)."""
    endpoint: str
    tcp: str | None  # None: no TCP listener
    pub_endpoint: str | None  # None: no stats PUB socket
    curve: object | None = None  # endpoint.CurveConfig, for the TCP socket
    limits: Limits
    heartbeat_interval: float
    client_timeout: float
    drain_grace: float
    stats_interval: float
    socket_mode: int = 0o600
    prefix_sharing: str  # daemon/sharing.py


def make_validator(engine, model: dict, limits: Limits) -> Validator:
    return Validator(engine.tokenizer, model["vocab_size"], model["max_model_len"], model["block_size"],
                     model["num_kv_blocks"], limits, engine.grammars,
                     model["hidden_size"] if model.get("pooling") else None, model.get("pooling") == "rank")


class Server:
    def __init__(self, cfg: ServerConfig, engine, loop: EngineLoop, model: dict, notifier=None, version: str = "",
                 models: Models | None = None):
        """models: the daemon's models (daemon/models.py), the default one (engine, loop, model) among
        them; None: a daemon of that one model."""
        self.cfg, self.model, self.notifier = cfg, model, notifier
        self.server_name = f"ridge {version}".strip()
        self.validator = make_validator(engine, model, cfg.limits)  # the default model's: tokenize, detokenize
        self.model = {**model, "chat": self.validator.chat.info()}
        if models is None:
            entry = Entry(model["name"], model.get("path"), source="default")
            models = Models(Registry(entry, Path("/nonexistent")), None, lambda slot, eng: (self.validator, self.model),
                            max_loaded=1, keep_alive=FOREVER, memory_bytes=None, park_bytes=0, kv_share_gib=None)
            models.adopt(entry, loop, engine)
        self.models = models
        models.send, models.admit, models.refuse = self._send, self._admit_waiting, self._refuse_waiting
        self._owners: dict = {}  # admission Pending -> (Slot, keep_alive) of a generate or embed
        self.admission = Admission()
        self._frame_bytes = 0
        self.finishers = {"generate": self._admit, "tokenize": self._send_frame, "detokenize": self._send_frame,
                          "embed": self._admit_embed, "rerank": self._admit_embed}
        self.ctx = zmq.Context.instance()
        self.routers: list[zmq.Socket] = []
        self.pub: zmq.Socket | None = None
        self.peers: dict = {}  # (router index, routing id) -> Peer
        self.inflight: dict[str, InFlight] = {}  # engine id -> request
        self._ids = itertools.count()
        self.state = "ok"  # ok | draining | error
        self.started = time.monotonic()
        self.counts = {"frames_in": 0, "frames_out": 0, "errors_sent": 0}
        self.aborts = {"client": 0, "disconnected": 0, "timeout": 0, "shutdown": 0}
        self._drain_requested = self._hurry = False
        self._drain_deadline = self._forced_at = self._quiet_since = None
        self._last_sweep = self._last_status = 0.0
        self._published_seq: tuple | None = None
        self.handlers = {"hello": self._hello, "generate": self._generate, "abort": self._abort,
                         "tokenize": self._tokenize, "detokenize": self._detokenize, "stats": self._stats,
                         "health": self._health, "heartbeat": self._heartbeat, "embed": self._embed,
                         "models": self._models, "rerank": self._rerank}

    @property
    def loop(self):
        """The engine loop whose stats and liveness the daemon reports (Models.primary)."""
        slot = self.models.primary()
        return slot.loop if slot is not None else _NoEngine(self.models.snapshot())

    # -- sockets -------------------------------------------------------------------
    def _router(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a closed peer fails (EHOSTUNREACH): liveness
        s.setsockopt(zmq.SNDHWM, 1000)
        s.setsockopt(zmq.RCVHWM, 10000)
        s.setsockopt(zmq.MAXMSGSIZE, 4 * self.cfg.limits.max_frame_bytes)
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # ZMTP pings: a TCP peer that vanished is closed after 5 s
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        s.setsockopt(zmq.HEARTBEAT_TTL, 10000)
        return s

    def bind(self) -> None:
        from .endpoint import ipc_path, secure_curve_socket

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

    # -- the loop ------------------------------------------------------------------
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
            if len(frames) != 1:
                raise ProtocolError(P.BAD_FRAME, f"a message is exactly one frame; got {len(frames)}")
            msg = P.unpack(frames[0], self.cfg.limits.max_frame_bytes)
            rid = P.reply_id_of(msg)
            P.check_plain(msg, rid)
            env = P.envelope(msg)
            peer.version = env.v  # what it is answered in, heartbeats too
            self._frame_bytes = len(frames[0])  # what an admission of this message holds (admission.py)
            self.handlers[env.type](peer, env)
        except Exception as e:
            self._refuse(peer, e, rid)

    def _on_admitted(self, done: list) -> None:
        """The workers' results, each client's in arrival order: the rest of each message's
        handling (and every error frame) happens here, on the socket thread."""
        for p in done:
            owner = self._owners.pop(p, None)
            if p.peer.gone:  # it disconnected or timed out while its admission ran: nothing to send
                if owner is not None:
                    self.models.release(*owner)
                continue
            try:
                if p.error is not None:
                    raise p.error
                if owner is None:
                    self.finishers[p.env.type](p)
                else:
                    self.finishers[p.env.type](p, owner)
                    owner = None  # its flight holds it now
            except Exception as e:
                self._refuse(p.peer, e, p.env.id)
            if owner is not None:
                self.models.release(*owner)

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

    # -- handlers ------------------------------------------------------------------
    def _hello(self, peer: Peer, env) -> None:
        version = self.validator.hello(env)
        if (sub := env.body.get("principal")) is not None:
            self._subdivide(peer, sub, env.id)
        c = self.cfg
        self._send(peer, message("hello", env.id, version=version, supported=list(P.SUPPORTED),
                                 server=self.server_name, model=self._seen_by(peer, self.model),
                                 limits=c.limits.to_dict(),
                                 heartbeat={"interval": c.heartbeat_interval, "client_timeout": c.client_timeout},
                                 pub_endpoint=c.pub_endpoint, state=self.state, prefix_sharing=c.prefix_sharing))

    def _generate(self, peer: Peer, env) -> None:
        self._admitting(env.id)
        self.models.request(peer, env, "generate", self._frame_bytes, self.cfg.limits.max_queue)

    def _embed(self, peer: Peer, env) -> None:
        self._admitting(env.id)
        self.models.request(peer, env, "embed", self._frame_bytes, self.cfg.limits.max_queue)

    def _rerank(self, peer: Peer, env) -> None:
        self._admitting(env.id)
        self.models.request(peer, env, "rerank", self._frame_bytes, self.cfg.limits.max_queue)

    def _admit_waiting(self, w, slot) -> None:
        """A generate or embed whose model is loaded: to the admission workers, with that model's validator."""
        try:
            # generate, embed or rerank; those with steps run in turns with other clients' work
            work = getattr(slot.validator, f"{w.kind}_steps", None) or getattr(slot.validator, w.kind)
            p = self.admission.submit(w.peer, w.env, work, w.size)
        except Exception as e:
            self.models.release(slot, w.keep)
            self._refuse(w.peer, e, w.env.id)
            return
        p.aborted = w.aborted
        self._owners[p] = (slot, w.keep)

    def _refuse_waiting(self, peer: Peer, e: ProtocolError) -> None:
        self._refuse(peer, e, e.request_id)

    def _admitting(self, rid: str) -> None:
        if self.state != "ok":
            raise ProtocolError(P.SHUTTING_DOWN, "the daemon is shutting down and admits no new requests", rid)

    def _admit(self, p, owner) -> None:
        """A generate the validator passed: the daemon's own limits, then its model's engine queue.
        It arrived before any drain began (`_admitting`), so a drain that began while it was
        validated still owes it a final frame: it is queued, and aborted at once past the grace."""
        peer, req = p.peer, p.result
        self._room(peer, req.id)
        eid = f"r{next(self._ids)}"
        inf = InFlight(peer, req.id, eid, req.stream, req.params.n, req.params.logprobs > 0, req.output, req.version)
        inf.owner = owner
        peer.requests[req.id] = self.inflight[eid] = inf
        loop = owner[0].loop
        loop.add(eid, req.prompt_token_ids, req.params, engine_salt(peer.identity, req.cache_salt,
                                                                   self.cfg.prefix_sharing))
        self._abort_admitted(p, inf)

    def _abort_admitted(self, p, inf) -> None:
        """A request admitted late: its client aborted it while it was validated, or the drain's
        grace ran out meanwhile. Either way the engine sends its final."""
        if p.aborted:
            self.aborts["client"] += 1
            self._engine_abort(inf)
        elif self._forced_at is not None:
            inf.detail = "shutdown"
            self.aborts["shutdown"] += 1
            self._engine_abort(inf)

    def _admit_embed(self, p, owner) -> None:
        """An embed the validator passed: every input one prefill, answered in one frame (embeddings.py)."""
        peer, req = p.peer, p.result
        self._room(peer, req.id)
        eid = f"r{next(self._ids)}"
        inf = peer.requests[req.id] = self.inflight[eid] = EmbedFlight(peer, req.id, eid, req.version, req.top_n)
        inf.owner = owner
        owner[0].loop.embed(eid, req.inputs, req.dimensions)
        self._abort_admitted(p, inf)

    @staticmethod
    def _engine_abort(inf) -> None:
        inf.owner[0].loop.abort(inf.engine_id)

    def _room(self, peer: Peer, rid: str) -> None:
        """The daemon's own limits on a request about to be queued."""
        lim = self.cfg.limits
        if rid in peer.requests:
            raise ProtocolError(P.DUPLICATE_ID, f"request id {rid!r} is already in flight on this connection", rid)
        if len(peer.requests) >= lim.max_requests_per_client:
            raise ProtocolError(P.TOO_MANY_REQUESTS, f"this client has {len(peer.requests)} requests in flight; "
                                f"the limit is {lim.max_requests_per_client}", rid, retry_after=1.0)
        if len(self.inflight) >= lim.max_queue:
            raise ProtocolError(P.BUSY, f"the daemon holds {len(self.inflight)} requests, its limit; retry later",
                                rid, retry_after=1.0)

    def _abort(self, peer: Peer, env) -> None:
        self.validator.no_fields(env)
        inf = peer.requests.get(env.id)
        if inf is not None and not inf.done:
            self.aborts["client"] += 1
            self._engine_abort(inf)
        self.models.abort_waiting(peer, env.id)  # still waiting for its model: aborted once admitted
        for p in self.admission.pending_for(peer):  # still being validated: aborted once admitted
            if p.env.type in ("generate", "embed", "rerank") and p.env.id == env.id:
                p.aborted = True

    def _tokenize(self, peer: Peer, env) -> None:
        self.admission.submit(peer, env, self._tokenize_frame, self._frame_bytes)

    def _tokenize_frame(self, env) -> bytes:
        """On a worker: the reply is encoded there too (a 512 KiB text is 140K ids to pack)."""
        ids = self.validator.tokenize(env)
        return pack(message("tokenize", env.id, token_ids=ids, count=len(ids)))

    def _detokenize(self, peer: Peer, env) -> None:
        self.admission.submit(peer, env, self._detokenize_frame, self._frame_bytes)

    def _detokenize_frame(self, env) -> bytes:
        return pack(message("detokenize", env.id, text=self.validator.detokenize(env)))

    def _send_frame(self, p) -> None:
        if not p.peer.gone:
            p.peer.outq.append(p.result)
            self._flush(p.peer)

    def _stats(self, peer: Peer, env) -> None:
        self.validator.no_fields(env)
        msg = self.stats_message("stats", env.id)
        msg["model"] = self._seen_by(peer, msg["model"])
        self._send(peer, msg)

    def _subdivide(self, peer: Peer, sub: str, rid: str) -> None:
        """A gateway speaks for many people over connections of its own uid: the daemon's own user
        may split its identity per connection (each API key's holder, or keyless HTTP), and then
        admission, prefix sharing and model control treat each part as its own principal. No one
        else may: an identity is what the transport proves (daemon/sharing.py)."""
        owner = uid_identity(os.getuid())
        if peer.identity == f"{owner}/{sub}":  # a hello again (the gateway's refresh)
            return
        if peer.identity != owner or peer.requests:
            raise ProtocolError(P.INVALID_REQUEST, "principal: only the daemon's own user may name one, "
                                "once, on a connection with no request in flight", rid)
        peer.identity = f"{owner}/{sub}"

    @staticmethod
    def _is_owner(peer: Peer) -> bool:
        """The daemon's own uid over ipc: the one client that may see where its files are."""
        return peer.identity == uid_identity(os.getuid())

    def _seen_by(self, peer: Peer, model: dict) -> dict:
        """A model's description as this peer may see it: others get its name, not its path."""
        return model if self._is_owner(peer) else {k: v for k, v in model.items() if k != "path"}

    def _health(self, peer: Peer, env) -> None:
        self.validator.no_fields(env)
        st = self.loop.snapshot[2]
        self._send(peer, message("health", env.id, status=self.state, uptime=time.monotonic() - self.started,
                                 engine_lag=time.monotonic() - self.loop.tick, running=st["running"],
                                 waiting=st["waiting"], model=self.model["name"]))

    def _heartbeat(self, peer: Peer, env) -> None:
        self.validator.no_fields(env)

    def stats_message(self, type_: str, rid: str | None = None) -> dict:
        seq, t, st = self.loop.snapshot
        daemon = {"clients": len(self.peers), "in_flight": len(self.inflight), "admitting": self.admission.count,
                  **self.counts,
                  "aborts": dict(self.aborts), "held_bytes": self._held_bytes(), "state": self.state,
                  "pid": os.getpid(),
                  "cpu_s": {"socket_thread": time.thread_time(), "process": time.process_time()}}
        slot = self.models.primary()  # the model whose engine the figures are (Models.primary)
        model = slot.info if slot is not None and slot.info is not None else self.model
        return message(type_, rid, model=model, stats=st, daemon=daemon, time=t, seq=seq,
                       models=self._loaded_models())

    def _loaded_models(self) -> list[dict]:
        """What `ridge top` shows of the models (docs/protocol.md §7): the loaded and loading ones."""
        return self.models.held()

    def _models(self, peer: Peer, env) -> None:
        if env.v < 3:
            raise ProtocolError(P.UNKNOWN_TYPE, f"models is a version 3 message; this one is version {env.v}", env.id)
        self.validator.no_fields(env)
        self._send(peer, message("models", env.id, default=self.models.registry.default.name,
                                 models=self.models.listing(owner=self._is_owner(peer)),
                                 counts=dict(self.models.counts),
                                 max_loaded_models=self.models.max_loaded))

    def _held_bytes(self) -> int:
        """Encoded bytes waiting for clients that read too slowly: frames their queues had no room for,
        and the merged output behind them (docs/protocol.md §7.3)."""
        return sum(sum(map(len, p.outq)) + sum(inf.held_bytes() for inf in p.dirty) for p in self.peers.values())

    # -- engine outputs --------------------------------------------------------------
    def _on_engine(self, items: list, loop=None) -> None:
        touched: dict = {}
        for item in items:
            if item[0] in ("ready", "failed"):  # a model loaded on request (daemon/models.py)
                if (slot := self.models.slot_of(loop)) is not None:
                    self.models.on_loop(slot, item)
            elif item[0] == "out":
                for o in item[1]:
                    inf = self.inflight.get(o.request_id)
                    if inf is not None:
                        inf.add(o)
                        self._mark(inf, touched)
            elif item[0] == "reject":
                inf = self.inflight.get(item[1])
                if inf is not None:
                    self._retire(inf)
                    self.counts["errors_sent"] += 1
                    self._send(inf.peer, P.error(item[3], item[2], inf.id))
            else:  # the engine loop died: every request ends with an error, then the daemon exits
                log.error("engine failed: %s", item[1])
                self.state = "error"
                for inf in list(self.inflight.values()):
                    inf.force_finish("error", error=f"the engine failed: {item[1]}")
                    self._mark(inf, touched)
        for peer in touched:
            self._flush(peer)

    def _mark(self, inf: InFlight, touched: dict) -> None:
        if inf.orphaned:
            if inf.done:
                self._retire(inf)
        else:
            inf.peer.dirty[inf] = None
            touched[inf.peer] = None

    def _retire(self, inf: InFlight) -> None:
        if self.inflight.pop(inf.engine_id, None) is not None:
            self.models.release(*inf.owner)
        if inf.peer.requests.get(inf.id) is inf:
            del inf.peer.requests[inf.id]

    def _peer_gone(self, peer: Peer, why: str) -> None:
        """Abort all of a peer's requests: it disconnected, went silent or stopped reading."""
        peer.gone = True
        peer.outq.clear()
        peer.dirty.clear()
        self.peers.pop(peer.key, None)
        live = [inf for inf in peer.requests.values() if not inf.done]
        for inf in live:
            inf.orphaned = True
            self._engine_abort(inf)  # retired when the engine's final output comes back
        for inf in [i for i in peer.requests.values() if i.done]:
            self._retire(inf)
        if live:
            self.aborts[why] += len(live)
            log.info("client %s %s: aborted %d request(s)", peer.ident.hex(), why, len(live))

    def _time_out(self, peer: Peer) -> None:
        """A client that went silent but may still be reading: abort its requests and send their
        finals (`detail: "timeout"`), so that it learns why its streams ended (§4.4)."""
        live = [inf for inf in peer.requests.values() if not inf.done and inf.detail is None]
        for inf in live:
            inf.detail = "timeout"
            self._engine_abort(inf)
        if live:
            self.aborts["timeout"] += len(live)
            log.info("client %s timeout: aborted %d request(s)", peer.ident.hex(), len(live))

    # -- timers: liveness, stats feed, systemd ---------------------------------------
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

    # -- draining --------------------------------------------------------------------
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
