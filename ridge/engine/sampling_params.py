"""Sampling parameters: what a request asks of the sampler, validated at admission."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields

from ridge.errors import InvalidRequest

# llama.cpp's sampler names (its `samplers` list, tools/server/README.md) and the aliases it takes.
SAMPLER_NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
SAMPLER_ALIASES = {"top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "typical_p": "typ_p", "typical-p": "typ_p",
                   "typical": "typ_p", "typ-p": "typ_p", "typ": "typ_p", "min-p": "min_p", "temp": "temperature",
                   "top-n-sigma": "top_n_sigma"}
# llama-server's order, when a request names none of its own in `samplers`.
LLAMA_ORDER = SAMPLER_NAMES
# ridge's order when `samplers` is not given: temperature first, as HF and vLLM (and ridge before
# these samplers) apply it; the rest in llama.cpp's order. penalties and dry always act first.
RIDGE_ORDER = ("penalties", "dry", "temperature", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc")
DRY_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's default dry_sequence_breakers


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF's and llama.cpp's: divides positive logits, multiplies negative ones
    # The tokens the repetition penalty reads: the last n of prompt + output (llama.cpp's
    # repeat_last_n); -1: all of them (ridge's default, as before), 0: none (the penalty is off).
    repeat_last_n: int = -1
    # OpenAI's: logit -= count * frequency_penalty + (count > 0) * presence_penalty, count over the
    # tokens generated so far (not the prompt).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> added to its logit; -inf bans it (llama-server's `false`).
    logit_bias: dict[int, float] | None = None
    typical_p: float = 1.0  # locally typical sampling; 1 = off
    top_n_sigma: float = -1.0  # keep logits >= max - n * std; <= 0 = off
    # Mirostat (1 or 2; 0 = off): replaces the samplers chain by temperature then mirostat, as
    # llama.cpp does. Its state, mu, lives with the request (Request.mirostat_mu).
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # DRY ("don't repeat yourself"): a token that would extend a repeat of n >= allowed_length
    # tokens loses multiplier * base ** (n - allowed_length); 0 = off.
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # the tokens DRY searches: -1 all, 0 off
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DRY_BREAKERS))
    # The tokens whose text holds a breaker: a repeat never spans one. Set by the daemon's validator
    # from the tokenizer (not on the wire).
    dry_breaker_ids: frozenset[int] = frozenset()
    # XTC ("exclude top choices"): with probability xtc_probability, every token at or above
    # xtc_threshold but the least likely of them is removed; 0 = off.
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    # The sampler order (llama.cpp's names, SAMPLER_NAMES); None: RIDGE_ORDER.
    samplers: list[str] | None = None
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
        self._check_llama()

    def _check_llama(self) -> None:
        """llama.cpp's samplers: the ranges llama-server takes (-1 for "the whole context" counts)."""
        bias = self.logit_bias
        checks = [
            (isinstance(self.repeat_last_n, int) and self.repeat_last_n >= -1, "repeat_last_n must be an integer >= -1"),
            (_finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (_finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (bias is None or (isinstance(bias, dict) and len(bias) <= 1024 and all(
                isinstance(t, int) and t >= 0 and (_finite(b) or b == float("-inf")) for t, b in bias.items())),
             "logit_bias must map up to 1024 token ids to finite numbers (or -inf)"),
            (_finite(self.typical_p) and 0.0 <= self.typical_p <= 1.0, "typical_p must be in [0, 1]"),
            (_finite(self.top_n_sigma), "top_n_sigma must be a finite number (<= 0: off)"),
            (self.mirostat in (0, 1, 2) and not isinstance(self.mirostat, bool), "mirostat must be 0, 1 or 2"),
            (_finite(self.mirostat_tau) and self.mirostat_tau >= 0, "mirostat_tau must be a number >= 0"),
            (_finite(self.mirostat_eta) and self.mirostat_eta >= 0, "mirostat_eta must be a number >= 0"),
            (_finite(self.dry_multiplier) and self.dry_multiplier >= 0, "dry_multiplier must be a number >= 0"),
            (_finite(self.dry_base) and self.dry_base >= 1, "dry_base must be a number >= 1"),
            (isinstance(self.dry_allowed_length, int) and self.dry_allowed_length >= 0,
             "dry_allowed_length must be an integer >= 0"),
            (isinstance(self.dry_penalty_last_n, int) and self.dry_penalty_last_n >= -1,
             "dry_penalty_last_n must be an integer >= -1"),
            (isinstance(self.dry_sequence_breakers, (list, tuple)) and 0 < len(self.dry_sequence_breakers) <= 16
             and all(isinstance(b, str) and b for b in self.dry_sequence_breakers),
             "dry_sequence_breakers must be 1 to 16 non-empty strings"),
            (_finite(self.xtc_probability) and 0.0 <= self.xtc_probability <= 1.0, "xtc_probability must be in [0, 1]"),
            (_finite(self.xtc_threshold) and 0.0 <= self.xtc_threshold <= 1.0, "xtc_threshold must be in [0, 1]"),
            (self.samplers is None or (isinstance(self.samplers, (list, tuple)) and len(self.samplers) <= 16
                                       and all(isinstance(n, str) for n in self.samplers)),
             "samplers must be a list of sampler names"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequest(msg)
        order = RIDGE_ORDER
        if self.samplers is not None:
            order = tuple(SAMPLER_ALIASES.get(n, n) for n in self.samplers)
            if bad := [n for n in order if n not in SAMPLER_NAMES]:
                raise InvalidRequest(f"samplers: unknown sampler {bad[0]!r} (known: {', '.join(SAMPLER_NAMES)})")
        self._order = order
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
