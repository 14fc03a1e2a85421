"""What the daemon answers itself, on the socket thread: hello, stats, health, heartbeat and
models (docs/protocol.md §3, §3.10, §7), each model's description as a peer may see it, and a
gateway's principals (daemon/transport/sharing.py).

Control is one part of the Server (daemon/server.py), beside the socket loop (transport/loop.py)
and the request flow (requests.py)."""
from __future__ import annotations

import os
import time

from .. import protocol as P
from ..protocol import ProtocolError, message
from ..transport.peers import Peer
from ..transport.sharing import uid_identity


class Control:
    """The Server's handlers of what it answers at once, from its own state."""

    # -- hello ------------------------------------------------------------------
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

    def _subdivide(self, peer: Peer, sub: str, rid: str) -> None:
        """A gateway speaks for many people over connections of its own uid: the daemon's own user
        may split its identity per connection (each API key's holder, or keyless HTTP), and then
        admission, prefix sharing and model control treat each part as its own principal. No one
        else may: an identity is what the transport proves (daemon/transport/sharing.py)."""
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

    # -- stats, health, heartbeat -----------------------------------------------
    def _stats(self, peer: Peer, env) -> None:
        self.validator.no_fields(env)
        msg = self.stats_message("stats", env.id)
        msg["model"] = self._seen_by(peer, msg["model"])
        self._send(peer, msg)

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

    def _held_bytes(self) -> int:
        """Encoded bytes waiting for clients that read too slowly: frames their queues had no room for,
        and the merged output behind them (docs/protocol.md §7.3)."""
        return sum(sum(map(len, p.outq)) + sum(inf.held_bytes() for inf in p.dirty) for p in self.peers.values())

    # -- models (version 3) -----------------------------------------------------
    def _models(self, peer: Peer, env) -> None:
        if not P.speaks(env.v, "models"):
            raise P.too_old("models", env.v, env.id)
        self.validator.no_fields(env)
        self._send(peer, message("models", env.id, default=self.models.registry.default.name,
                                 models=self.models.listing(owner=self._is_owner(peer)),
                                 counts=dict(self.models.counts),
                                 max_loaded_models=self.models.max_loaded))
