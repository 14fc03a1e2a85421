"""An embed or rerank request in flight (docs/protocol.md §3.9, §3.11): one engine
request for all of its inputs, answered by one `embedding` (or `rerank`) frame
when the engine's output for the last of them comes back. The server holds it as it holds a generate's
InFlight (streams.py): the same aborts, timeouts and drain."""
from __future__ import annotations

from ..protocol import message, pack


class EmbedFlight:
    def __init__(self, peer, client_id: str, engine_id: str, version: int, top_n: int | None = None):
        """top_n: a rerank's (its best this many documents answered); None: an embed."""
        self.peer, self.id, self.engine_id, self.v, self.top_n = peer, client_id, engine_id, version, top_n
        self.orphaned = False  # its client is gone: the engine was told to abort
        self.detail: str | None = None  # why the daemon aborted it
        self.final_sent = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.data: list = []
        self.prompt_tokens = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, o) -> None:
        if o.finished:
            self.finish_reason, self.error = o.finish_reason, o.error
            self.data = (o.scores if self.top_n is not None else o.embeddings) or []
            self.prompt_tokens = o.num_prompt_tokens

    def force_finish(self, reason: str, detail: str | None = None, error: str | None = None) -> None:
        self.detail = detail or self.detail
        if not self.done:
            self.finish_reason, self.error = reason, error

    def take_frames(self) -> list[dict]:
        return self._frames(take=True)

    def held_bytes(self) -> int:
        return sum(len(pack(f)) for f in self._frames(take=False))

    def _frames(self, take: bool) -> list[dict]:
        if not self.done or self.final_sent:
            return []
        self.final_sent = take
        usage = {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens}
        if self.top_n is None:
            f = message("embedding", self.id, v=self.v, finish_reason=self.finish_reason, data=self.data, usage=usage)
        else:  # the best first; equal scores in the documents' order
            best = sorted(range(len(self.data)), key=lambda i: -self.data[i])[:self.top_n]
            f = message("rerank", self.id, v=self.v, finish_reason=self.finish_reason, usage=usage,
                        results=[{"index": i, "relevance_score": self.data[i]} for i in best])
        if self.error:
            f["error"] = self.error
        if self.detail:
            f["detail"] = self.detail
        return [f]
