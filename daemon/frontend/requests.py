"""A request's way through the daemon, on the socket thread: a generate, embed or rerank waits
for its model (models.py), is validated on the admission workers (admission.py), checked against
the daemon's limits and queued on its model's engine (engine_loop.py); the engine's outputs come
back to its flight (streams.py, embeddings.py), which the socket loop writes out. Aborts, from
the client, its disconnection or its silence, take the same way back.

RequestFlow is one part of the Server (daemon/server.py), beside the socket loop
(transport/loop.py), whose _send, _flush and _refuse it calls."""
from __future__ import annotations

import logging

from .. import protocol as P
from ..protocol import ProtocolError, message, pack
from ..transport.peers import Peer
from ..transport.sharing import engine_salt
from ridge.engine.output import TextState

from .embeddings import EmbedFlight
from .streams import InFlight

log = logging.getLogger("ridge.daemon")


class RequestFlow:
    """The Server's handlers of requests that reach an engine or the admission workers."""

    # -- generate, embed, rerank: from the model to the engine ------------------
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

    def _admit(self, p, owner) -> None:
        """A generate the validator passed: the daemon's own limits, then its model's engine queue.
        It arrived before any drain began (`_admitting`), so a drain that began while it was
        validated still owes it a final frame: it is queued, and aborted at once past the grace."""
        peer, req = p.peer, p.result
        self._room(peer, req.id)
        eid = f"r{next(self._ids)}"
        ids, params, tokenizer = req.admitted.prompt_token_ids, req.admitted.params, owner[0].validator.tokenizer
        inf = InFlight(peer, req.id, eid, req.stream, req.params.n, req.params.logprobs > 0, req.output, req.version,
                       detok=lambda: TextState(tokenizer, ids, params))
        inf.owner = owner
        peer.requests[req.id] = self.inflight[eid] = inf
        loop = owner[0].loop
        loop.add(eid, req.admitted, cache_salt=engine_salt(peer.identity, req.cache_salt, self.cfg.prefix_sharing))
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
        owner[0].loop.embed(eid, req.admitted, req.dimensions)
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

    # -- tokenize, detokenize: answered from the workers ------------------------
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

    # -- engine outputs ---------------------------------------------------------
    def _on_engine(self, items: list, loop=None) -> None:
        touched: dict = {}
        for item in items:
            if item[0] in ("ready", "failed"):  # a model loaded on request (daemon/frontend/models.py)
                if (slot := self.models.slot_of(loop)) is not None:
                    self.models.on_loop(slot, item)
            elif item[0] == "out":
                for o in item[1]:
                    inf = self.inflight.get(o.request_id)
                    if inf is not None:
                        if inf.add(o):  # its stop string: the engine finishes that sample
                            inf.owner[0].loop.finish(inf.engine_id, o.index)
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

    # -- a client gone or silent ------------------------------------------------
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
