"""Sampling parameters: what a request asks of the sampler, validated at admission."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from ridge.errors import InvalidRequest


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int = 0  # top-N logprobs per generated token
    n: int = 1
    speculative: bool = True  # let the engine speculate for this request when it is configured to
    # The same tokens whatever the batch, chunking and speculation (docs/architecture.md, Deterministic
    # mode): None takes the engine's --deterministic; the engine resolves it at admission.
    deterministic: bool | None = None
    # What the output must be (structured/format.py): OpenAI's json_schema / json_object, or
    # ridge's regex / grammar. None or {"type": "text"}: free text.
    response_format: dict | None = None
    # The grammar the daemon composes for a chat turn (tools, reasoning; daemon/frontend/chat_grammar.py), in
    # llguidance's own form; it replaces the response_format's, which it embeds. Not on the wire.
    chat_grammar: str | None = None
    # Special tokens whose text the output keeps (chat markers the daemon reads, such as Llama 3's
    # <|python_tag|>); decoding drops every other special token. Not on the wire.
    keep_special_ids: tuple[int, ...] = ()
    # response_format parsed once, when the params are made (structured.format.Constraint or None).
    _constraint: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._check()
        if self.response_format is not None or self.chat_grammar is not None:
            self._constraint = self._parse()  # its shape; whether it compiles is asked at admission

    def _check(self) -> None:
        checks = [
            (isinstance(self.max_tokens, int) and 1 <= self.max_tokens <= 1 << 20, "max_tokens must be an integer >= 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 1 << 63), "seed must be a non-negative integer"),
            (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (isinstance(self.n, int) and 1 <= self.n <= 64, "n must be in [1, 64]"),
            (self.deterministic is None or isinstance(self.deterministic, bool), "deterministic must be a boolean"),
            (all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16, "stop must be up to 16 non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequest(msg)

    def _parse(self):
        from .structured.format import parse_response_format

        c = parse_response_format(self.response_format, self.chat_grammar)
        if c is not None and self.ignore_eos:
            raise InvalidRequest("ignore_eos cannot be combined with a response_format: "
                                 "the end of the constrained output is its end of sequence")
        return c

    def constraint(self):
        """-> the parsed response_format (structured.format.Constraint), or None for free text."""
        return self._constraint

    def derive(self, **changes) -> "SamplingParams":
        """A copy with some fields changed, checked again, its parsed response_format shared."""
        if {"response_format", "chat_grammar", "ignore_eos"} & set(changes):
            raise ValueError("derive() keeps the response_format: make new params for another one")
        new = copy.copy(self)
        for k, v in changes.items():
            setattr(new, k, v)
        new._check()
        return new

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls) if f.init}
        unknown = set(d) - names
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(sorted(map(str, unknown)))}")
        try:
            return cls(**d)
        except TypeError as e:
            raise InvalidRequest(str(e)) from None
