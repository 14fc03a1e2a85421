"""Sampling parameters: the request's declared fields (ridge/request.py) as the engine holds them,
checked when made, with what the engine derives from them."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from ridge.errors import InvalidRequest
from ridge.request import RIDGE_ORDER, Sampling, check, sampler_order


@dataclass(slots=True)
class SamplingParams(Sampling):
    """The declared fields (ridge/request.Sampling), checked when made, and what the engine derives
    from them once."""
    # response_format parsed once, when the params are made (structured.format.Constraint or None).
    _constraint: object = field(default=None, init=False, repr=False, compare=False)
    # Derived by _check, read per step so that a request without these samplers pays one attribute read:
    # _adjusts: its logits change before the argmax (penalties, bias, DRY); _shapes: its distribution
    # goes through the full chain (sampler_chain.py); _order: the chain's order.
    _adjusts: bool = field(default=False, init=False, repr=False, compare=False)
    _shapes: bool = field(default=False, init=False, repr=False, compare=False)
    _order: tuple = field(default=RIDGE_ORDER, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._check()
        if self.response_format is not None or self.chat_grammar is not None:
            self._constraint = self._parse()  # its shape; whether it compiles is asked at admission

    def _check(self) -> None:
        check(self)  # each field within its declared rule (FieldError names it)
        self._order = RIDGE_ORDER if self.samplers is None else sampler_order(self.samplers)
        self._adjusts = bool(self.penalizes or self.logit_bias or self.dries)
        self._shapes = bool(self.mirostat or self.typical_p < 1.0 or self.top_n_sigma > 0 or self.xtc_on
                            or self.samplers is not None)

    @property
    def penalizes(self) -> bool:
        """A repetition, presence or frequency penalty applies (read from the token history)."""
        rep = self.repetition_penalty != 1.0 and self.repeat_last_n != 0
        # Mirostat replaces the chain, penalties included, as in llama.cpp (common/sampling.cpp).
        return "penalties" in self._order and not self.mirostat and bool(
            rep or self.presence_penalty or self.frequency_penalty)

    @property
    def dries(self) -> bool:
        return (self.dry_multiplier > 0 and self.dry_penalty_last_n != 0 and "dry" in self._order
                and not self.mirostat)

    @property
    def xtc_on(self) -> bool:
        return self.xtc_probability > 0 and self.xtc_threshold <= 0.5 and "xtc" in self._order

    @property
    def reads_history(self) -> bool:
        """Its sampling reads every earlier token on the host (penalties, DRY)."""
        return self._adjusts and (self.penalizes or self.dries)

    @property
    def plain_decoding(self) -> bool:
        """Sampled one token a step, never speculated: penalties, DRY and mirostat read state that a
        rejected draft would corrupt (the token window, mu), XTC draws a coin per token, and a bias
        moves the argmax that greedy verification compares against."""
        return self._adjusts or bool(self.mirostat) or self.xtc_on

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
