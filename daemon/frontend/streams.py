"""One accepted generate request on the daemon side: engine outputs in,
`delta` and `final` frames out (docs/protocol.md §4.1-4.2).

Outputs that arrive while the client's queue is full stay here, merged per
sample, so a slow reader costs one pending delta per sample, not a backlog."""
from __future__ import annotations

from ..client import merge_pieces
from ..protocol import VERSION, message, pack


class Sample:
    __slots__ = ("token_ids", "text", "logprobs", "finished", "finish_reason", "error", "completion_tokens",
                 "timings", "all_token_ids", "all_text", "all_logprobs", "parser", "reasoning", "pieces",
                 "all_reasoning", "reasoning_tokens", "detok")

    def __init__(self, keep_all: bool, parser=None, detok=None):
        self.detok = detok  # its engine/output.TextState: the engine's tokens -> text; None: outputs carry text
        self.token_ids: list[int] = []  # not yet sent
        self.text = ""  # the content, when a parser reads the output (chat_output.py)
        self.logprobs: list = []
        self.parser = parser
        self.reasoning = ""  # not yet sent
        self.pieces: list = []  # tool call pieces not yet sent
        self.all_reasoning = ""
        self.reasoning_tokens = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.completion_tokens = 0
        self.timings: dict = {}
        # non-streaming requests keep everything for the final frame
        self.all_token_ids: list[int] | None = [] if keep_all else None
        self.all_text = ""
        self.all_logprobs: list = []


def _logprobs(raw) -> list:
    out = []
    for entry in raw or ():
        if entry is None:
            out.append(None)
        else:
            lp, top = entry
            out.append([float(lp), [[int(t), float(p)] for t, p in top]])
    return out


class InFlight:
    def __init__(self, peer, client_id: str, engine_id: str, stream: bool, n: int, logprobs: bool,
                 output=None, version: int = VERSION, detok=None):
        """output: chat_output.OutputSpec, to read each sample's reasoning and calls; version: the
        request's protocol version, that of its frames; detok: a sample -> its TextState
        (engine/output.py), where the engine core's outputs carry token ids only (the daemon's);
        None where they carry their text already (an engine run in-process)."""
        self.peer, self.id, self.engine_id = peer, client_id, engine_id
        self.stream, self.want_logprobs, self.v = stream, logprobs, version
        self.samples = [Sample(not stream, output.parser() if output else None, detok() if detok else None)
                        for _ in range(n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.orphaned = False  # its client is gone: outputs are dropped, the engine was told to abort
        self.detail: str | None = None  # why the daemon aborted it
        self.final_sent = False

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.samples)

    def add(self, o) -> bool:
        """-> True where this output's text meets a stop string: its caller has the engine finish
        the sample (EngineCore.finish_sample). What the engine made past the stop, before it heard,
        is dropped; its final output closes the sample with the stop's count of tokens."""
        s = self.samples[o.index]
        hit = False
        if s.detok is not None:
            past = s.detok.stopped
            hit = s.detok.read(o)  # o's text; past the stop, o emptied
            if past and not o.finished:
                return False
            if past:
                o.finish_reason, o.error, o.num_output_tokens = "stop", None, s.completion_tokens
        self._take(s, o)
        return hit

    def _take(self, s: Sample, o) -> None:
        lps = _logprobs(o.logprobs) if self.want_logprobs else []
        text = o.new_text if s.parser is None else self._read(s, o)
        if self.stream:
            s.token_ids += o.new_token_ids
            s.text += text
            s.logprobs += lps
        else:
            s.all_token_ids += o.new_token_ids
            s.all_text += text
            s.all_logprobs += lps
        s.completion_tokens = o.num_output_tokens
        self.prompt_tokens, self.cached_tokens = o.num_prompt_tokens, o.num_cached_tokens
        if o.finished:
            s.finished, s.finish_reason, s.error = True, o.finish_reason, o.error
            s.timings = dict(o.timings)
            if s.parser is not None and s.parser.calls and o.finish_reason == "stop":
                s.finish_reason = "tool_calls"

    @staticmethod
    def _read(s: Sample, o) -> str:
        """The output's text split by the sample's parser: -> its content; the reasoning and the
        call pieces wait in the sample. A step's tokens count as reasoning when it read thinking."""
        p = s.parser.feed(o.new_text, final=o.finished, cut=o.finished and o.finish_reason == "length")
        if s.parser.thought:
            s.reasoning_tokens += len(o.new_token_ids)
        s.reasoning += p.reasoning
        s.all_reasoning += p.reasoning
        merge_pieces(s.pieces, p.pieces)
        return p.content

    def force_finish(self, reason: str, detail: str | None = None, error: str | None = None) -> None:
        """Finish every open sample without the engine (shutdown past its grace, engine failure)."""
        self.detail = detail or self.detail
        for s in self.samples:
            if not s.finished:
                s.finished, s.finish_reason, s.error = True, reason, error
                if s.parser is not None:  # what it held back goes out
                    p = s.parser.feed("", final=True)
                    s.text, s.all_text = s.text + p.content, s.all_text + p.content
                    s.reasoning, s.all_reasoning = s.reasoning + p.reasoning, s.all_reasoning + p.reasoning
                    merge_pieces(s.pieces, p.pieces)

    def take_frames(self) -> list[dict]:
        return self._frames(take=True)

    def held_bytes(self) -> int:
        """The encoded size of what take_frames would return now."""
        return sum(len(pack(f)) for f in self._frames(take=False))

    def _frames(self, take: bool) -> list[dict]:
        frames = []
        if self.stream:
            for i, s in enumerate(self.samples):
                if s.token_ids or s.text or s.reasoning or s.pieces:
                    d = message("delta", self.id, v=self.v, index=i, token_ids=s.token_ids, text=s.text)
                    if self.want_logprobs:
                        d["logprobs"] = s.logprobs
                    if s.reasoning:
                        d["reasoning"] = s.reasoning
                    if s.pieces:
                        d["tool_calls"] = s.pieces
                    frames.append(d)
                    if take:
                        s.token_ids, s.text, s.logprobs, s.reasoning, s.pieces = [], "", [], "", []
        if self.done and not self.final_sent:
            frames.append(self.final())
            self.final_sent = take
        return frames

    def final(self) -> dict:
        choices = []
        for i, s in enumerate(self.samples):
            c = {"index": i, "finish_reason": s.finish_reason, "completion_tokens": s.completion_tokens,
                 "timings": s.timings}
            if s.error:
                c["error"] = s.error
            if not self.stream:
                c["text"], c["token_ids"] = s.all_text, s.all_token_ids
                if self.want_logprobs:
                    c["logprobs"] = s.all_logprobs
            if s.parser is not None:
                c["reasoning_tokens"] = s.reasoning_tokens
                if not self.stream:
                    c["reasoning"], c["tool_calls"] = s.all_reasoning, s.parser.tool_calls()
            choices.append(c)
        first = self.samples[0]
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": sum(s.completion_tokens for s in self.samples),
                 "cached_tokens": self.cached_tokens}
        if first.parser is not None:
            usage["reasoning_tokens"] = sum(s.reasoning_tokens for s in self.samples)
        f = message("final", self.id, v=self.v, finish_reason=first.finish_reason, usage=usage,
                    timings=first.timings, choices=choices)
        if self.detail:
            f["detail"] = self.detail
        if first.error:
            f["error"] = first.error
        if not self.stream:
            f["text"], f["token_ids"] = first.all_text, first.all_token_ids
            if self.want_logprobs:
                f["logprobs"] = first.all_logprobs
        return f
