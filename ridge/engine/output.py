"""What the engine core hands back per request per step (token ids), and the output processor's
text side of it: incremental detokenization and stop strings (O(batch) Python per step)."""
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
    stopping: bool = False  # the output processor found a stop string here; the core is yet to finish it


class TextState:
    """One sample's text: streams whole UTF-8 text, and holds back a tail that could still grow
    into a stop string, so that a stop string is never half emitted. It runs where the text is
    read (the output processor: the daemon's socket thread, or LLMEngine in-process), not in the
    engine core."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, keep=params.keep_special_ids)
        self.stops = params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # all decoded output text
        self.sent = 0  # chars of it already emitted
        self.stopped = False  # a stop string ended it: the core was told to finish it

    def add(self, token_ids: list[int], finished: bool) -> tuple[str, bool, int]:
        """-> (text to emit now, hit a stop string, how many of token_ids it took: all of them, or
        those up to the one whose text completed the stop string)."""
        hit, used = False, len(token_ids)
        for i, t in enumerate(token_ids):
            self.text += self.detok.add(t)
            if self.stops and self._cut():
                hit, used = True, i + 1
                break
        if finished and not hit:
            self.text += self.detok.flush()
            hit = bool(self.stops) and self._cut()
        end = len(self.text) if finished or hit else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta, hit, used

    def _cut(self) -> bool:
        """Cut the text at the first stop string in what was not yet emitted (and the tail that
        could have begun one); -> whether there was one."""
        start = max(0, self.sent - self.hold)
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
        return cut >= 0

    def read(self, o: RequestOutput) -> bool:
        """Sets o.new_text from o's tokens; where a stop string ends the sample, o keeps only the
        tokens up to it and says finish_reason stop. -> True where the core has yet to be told
        to finish the sample (EngineCore.finish_sample); the outputs the core made past it
        (steps that ran before it heard) then carry nothing."""
        if self.stopped:
            o.new_token_ids, o.logprobs, o.new_text = [], None, ""
            return False
        o.new_text, hit, used = self.add(o.new_token_ids, o.finished)
        if not hit:
            return False
        dropped = len(o.new_token_ids) - used
        if dropped:
            o.new_token_ids = o.new_token_ids[:used]
            o.logprobs = None if o.logprobs is None else o.logprobs[:used]
            o.num_output_tokens -= dropped
        self.stopped = True
        if o.finished:  # it also ended otherwise in the same output: the stop string came first
            o.finish_reason, o.error = "stop", None
        return not o.finished


class OutputProcessor:
    """Token outputs in, text outputs out, for an engine used in-process (LLMEngine): each
    sample's TextState, and the samples a stop string ended, for the core to finish."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.texts: dict[tuple[str, int], TextState] = {}

    def add(self, request_id: str, index: int, prompt_token_ids: list[int], params) -> None:
        self.texts[(request_id, index)] = TextState(self.tokenizer, prompt_token_ids, params)

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """-> the outputs with their text; those a stop string ended are marked `stopping`
        (finished here, and still to be finished in the core). Outputs past a stop are dropped."""
        kept = []
        for o in outputs:
            key = (o.request_id, o.index)
            state = self.texts.get(key)
            if state is None:  # an embedding's (no text)
                kept.append(o)
                continue
            was_stopped = state.stopped
            hit = state.read(o)
            if o.finished:
                del self.texts[key]
            if not was_stopped:
                o.stopping = hit
                kept.append(o)
        return kept


def timings_of(req: Request) -> dict:
    t = req.timings
    return {"queue": t.queue, "ttft": t.ttft, "decode_tps": t.decode_tps,
            "e2e": None if t.finished is None else t.finished - t.arrival}


def make_output(req: Request, index: int, request_id: str, new_tokens: list[int],
                logprobs: list | None) -> RequestOutput:
    """The core's output: token ids, no text (the output processor adds it)."""
    fr = req.finish_reason
    return RequestOutput(
        request_id=request_id, index=index, new_token_ids=new_tokens, new_text="",
        finished=req.is_finished, finish_reason=None if fr is None else str(fr), error=req.error,
        logprobs=logprobs, num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(req.output_token_ids),
        num_cached_tokens=req.num_cached_tokens, timings=timings_of(req) if req.is_finished else {})


__all__ = ["RequestOutput", "TextState", "OutputProcessor", "FinishReason", "make_output"]
