"""What the engine hands back per request per step, and the text side of it:
incremental detokenization and stop strings (O(batch) Python per step)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ridge.tokenizer import IncrementalDetokenizer

from .request import FinishReason, Request


@dataclass(slots=True)
class RequestOutput:
    request_id: str  # the client's id; samples of one prompt share it
    index: int  # which sample (n > 1)
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list | None = None  # per new token: (logprob, [(token, logprob), ...])
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timings: dict = field(default_factory=dict)
    embeddings: list | None = None  # an embedding request's vectors, one per input (pooling.py)
    scores: list | None = None  # a rerank's: each input's P(yes) (rerank.py)


class TextState:
    """Streams whole UTF-8 text, and holds back a tail that could still grow
    into a stop string, so that a stop string is never half emitted."""

    def __init__(self, tokenizer, req: Request):
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, keep=req.params.keep_special_ids)
        self.stops = req.params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # all decoded output text
        self.sent = 0  # chars of it already emitted

    def add(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """-> (text to emit now, hit a stop string)."""
        for t in token_ids:
            self.text += self.detok.add(t)
        if finished:
            self.text += self.detok.flush()
        hit = False
        if self.stops:
            start = max(0, self.sent - self.hold)
            cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.text, hit, finished = self.text[:cut], True, True
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta, hit


def timings_of(req: Request) -> dict:
    t = req.timings
    return {"queue": t.queue, "ttft": t.ttft, "decode_tps": t.decode_tps,
            "e2e": None if t.finished is None else t.finished - t.arrival}


def make_output(req: Request, index: int, request_id: str, new_tokens: list[int], text: str,
                logprobs: list | None) -> RequestOutput:
    fr = req.finish_reason
    return RequestOutput(
        request_id=request_id, index=index, new_token_ids=new_tokens, new_text=text,
        finished=req.is_finished, finish_reason=None if fr is None else str(fr), error=req.error,
        logprobs=logprobs, num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(req.output_token_ids),
        num_cached_tokens=req.num_cached_tokens, timings=timings_of(req) if req.is_finished else {})


__all__ = ["RequestOutput", "TextState", "FinishReason", "make_output"]
