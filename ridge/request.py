"""A request, declared once: each field with its type, default, bounds and doc.

`Sampling` is the generate message's `params` map (docs/protocol.md §3.2) as a
dataclass whose fields carry their rules; `GENERATE` declares the message's
other fields (the cache salt, keep_alive, tools, and what comes next: images,
an adapter). Everything else is derived from these: the msgpack checks
(daemon/frontend/validate.py), the gateway's dialects, which only rename
fields and map their defaults (daemon/gateway/dialects.py), the CLI's sampling
flags (daemon/cli/commands.py) and the engine's SamplingParams, which adds only
what the engine derives (ridge/engine/sampling_params.py).

Torch-free and engine-free, so that the HTTP gateway can import it."""
from __future__ import annotations

import math
import typing
from dataclasses import MISSING, dataclass, field, fields
from functools import cache

from ridge.errors import InvalidRequest

# llama.cpp's sampler names (its `samplers` list, tools/server/README.md) and the aliases it takes.
SAMPLER_NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
SAMPLER_ALIASES = {"top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "typical_p": "typ_p", "typical-p": "typ_p",
                   "typical": "typ_p", "typ-p": "typ_p", "typ": "typ_p", "min-p": "min_p", "temp": "temperature",
                   "top-n-sigma": "top_n_sigma"}
# llama-server's `samplers` as a string: one letter a sampler (common_sampler_type_to_chr, the
# letters of its --sampling-seq, default "edskypmxt").
SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                   "m": "min_p", "x": "xtc", "t": "temperature"}
# ridge's order when `samplers` is not given: temperature first, as HF and vLLM (and ridge before
# these samplers) apply it; the rest in llama.cpp's order. penalties and dry always act first.
RIDGE_ORDER = ("penalties", "dry", "temperature", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc")
DRY_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's default dry_sequence_breakers
MAX_BIAS_ENTRIES = 1024  # logit_bias: entries, and the tokens the strings among them spell
MAX_STOPS = 16


class FieldError(InvalidRequest):
    """A field's value outside what it may be: the message names the field."""

    def __init__(self, name: str, want: str):
        super().__init__(f"{name} must be {want}")
        self.field, self.want = name, want


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x) -> bool:
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)


@dataclass(frozen=True, slots=True)
class Rule:
    """What a field may be, beyond its type. lo/hi: a number's bounds (lo_open: lo itself excluded);
    check/what: a rule a range cannot say, and its words. wire: a client sends it (False: the
    daemon sets it). flag: `ridge generate` and `ridge chat` take it as --name (daemon/cli)."""
    doc: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    check: typing.Callable | None = None
    what: str | None = None
    wire: bool = True
    flag: bool = False
    wire_as: tuple = ()  # other JSON types its wire form may take, which the daemon turns into its type
    wire_what: str | None = None  # the wire form's words, where the type's do not say it


def _field(default, doc: str, **rule):
    meta = {"rule": Rule(doc, **rule)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _strings(x, most: int) -> bool:
    return isinstance(x, (list, tuple)) and len(x) <= most and all(isinstance(s, str) and s for s in x)


def _token_ids(v) -> bool:
    return isinstance(v, (list, tuple)) and all(is_int(t) and t >= 0 for t in v)


def _bias(b) -> bool:
    return b is None or (isinstance(b, dict) and len(b) <= MAX_BIAS_ENTRIES and all(
        is_int(t) and t >= 0 and (is_num(v) or v == float("-inf")) for t, v in b.items()))


def sampler_order(given) -> tuple[str, ...]:
    """`samplers` -> llama.cpp's sampler names in order: a list of names (or their aliases), or
    llama-server's string of letters ("dkypmxt"). Raises FieldError naming the unknown one."""
    if isinstance(given, str):
        if bad := [c for c in given if c not in SAMPLER_LETTERS]:
            raise FieldError("samplers", f"sampler names, or letters of {''.join(SAMPLER_LETTERS)} "
                             f"(unknown letter {bad[0]!r})")
        return tuple(SAMPLER_LETTERS[c] for c in given)
    order = tuple(SAMPLER_ALIASES.get(n, n) for n in given)
    if bad := [n for n in order if n not in SAMPLER_NAMES]:
        raise FieldError("samplers", f"sampler names (unknown sampler {bad[0]!r}; known: {', '.join(SAMPLER_NAMES)})")
    return order


@dataclass(slots=True)
class Sampling:
    """The params map of a generate (docs/protocol.md §3.2), with its defaults."""
    max_tokens: int = _field(256, "the most tokens to generate", lo=1, hi=1 << 20, flag=True)
    temperature: float = _field(0.0, "0 = greedy", lo=0.0, hi=100.0, flag=True)
    top_k: int = _field(0, "keep the k likeliest tokens; 0 = off", lo=0, flag=True)
    top_p: float = _field(1.0, "keep the likeliest tokens up to this probability mass", lo=0.0, lo_open=True, hi=1.0,
                          flag=True)
    min_p: float = _field(0.0, "drop tokens below this fraction of the likeliest one's probability", lo=0.0, hi=1.0,
                          flag=True)
    repetition_penalty: float = _field(
        1.0, "HF's and llama.cpp's: divides the logits of tokens already seen if positive, multiplies them if "
             "negative; over the last repeat_last_n tokens of prompt and output", lo=0.0, lo_open=True, hi=10.0,
        flag=True)
    repeat_last_n: int = _field(-1, "the tokens the repetition penalty reads (llama.cpp's): -1 all, 0 none",
                                lo=-1, flag=True)
    presence_penalty: float = _field(0.0, "OpenAI's: subtracted once from each token generated so far",
                                     lo=-2.0, hi=2.0, flag=True)
    frequency_penalty: float = _field(0.0, "OpenAI's: subtracted per occurrence among the tokens generated so far",
                                      lo=-2.0, hi=2.0, flag=True)
    logit_bias: dict[int, float] | None = _field(
        None, "token id -> added to its logit; -inf bans it. On the wire: a map of token ids, or "
              "llama-server's [[token id or string, bias or false], ...]", check=_bias,
        what=f"a map of up to {MAX_BIAS_ENTRIES} token ids to finite numbers (or -inf)", wire_as=(list,),
        wire_what="a map of token id to bias, or an array of [token id or string, bias] pairs")
    typical_p: float = _field(1.0, "locally typical sampling; 1 = off", lo=0.0, hi=1.0, flag=True)
    top_n_sigma: float = _field(-1.0, "keep logits >= max - n * std; <= 0 = off", flag=True)
    mirostat: int = _field(0, "1 or 2: llama.cpp's mirostat replaces the sampler chain; 0 = off",
                           check=lambda v: is_int(v) and v in (0, 1, 2), what="0, 1 or 2", flag=True)
    mirostat_tau: float = _field(5.0, "mirostat's target surprise", lo=0.0, flag=True)
    mirostat_eta: float = _field(0.1, "mirostat's learning rate", lo=0.0, flag=True)
    dry_multiplier: float = _field(0.0, "DRY: a token extending a repeat of n >= dry_allowed_length tokens loses "
                                        "multiplier * base ** (n - allowed); 0 = off", lo=0.0, flag=True)
    dry_base: float = _field(1.75, "DRY's base", lo=1.0, flag=True)
    dry_allowed_length: int = _field(2, "DRY: the longest repeat not penalized", lo=0, flag=True)
    dry_penalty_last_n: int = _field(-1, "the tokens DRY searches: -1 all, 0 none", lo=-1, flag=True)
    dry_sequence_breakers: list[str] = _field(list(DRY_BREAKERS), "DRY: a repeat never spans these strings",
                                              check=lambda v: 0 < len(v) <= 16 and _strings(v, 16),
                                              what="1 to 16 non-empty strings")
    # The breakers as token sequences (head, *tail): set by the daemon's validator from the tokenizer
    # (sampler_chain.breaker_sequences); a 1-tuple is a token whose text holds a breaker.
    dry_breaker_ids: frozenset[tuple[int, ...]] = _field(frozenset(), "DRY's breakers as token sequences",
                                                         wire=False)
    xtc_probability: float = _field(0.0, "XTC: the chance that the top choices but the least of them are removed; "
                                         "0 = off", lo=0.0, hi=1.0, flag=True)
    xtc_threshold: float = _field(0.1, "XTC: the probability at and above which a token is a top choice",
                                  lo=0.0, hi=1.0, flag=True)
    samplers: list[str] | None = _field(
        None, "llama-server's sampler order: names (penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, "
              "temperature) or a string of their letters (edskypmxt); default: temperature first",
        check=lambda v: isinstance(v, str) or _strings(v, 16), what="a list of sampler names, or a string of letters",
        wire_as=(str,), wire_what="an array of sampler names, or a string of their letters")
    seed: int | None = _field(None, "the draws' seed; none: random", lo=0, hi=(1 << 63) - 1, flag=True)
    stop: list[str] = _field([], "strings that end the output (not included)", check=lambda v: _strings(v, MAX_STOPS),
                             what=f"up to {MAX_STOPS} non-empty strings", flag=True)
    stop_token_ids: list[int] = _field([], "token ids that end the output", check=_token_ids,
                                       what="non-negative integers")
    ignore_eos: bool = _field(False, "run past the end-of-sequence token, to max_tokens")
    logprobs: int = _field(0, "the top-N logprobs of each generated token", lo=0, hi=20)
    n: int = _field(1, "samples of the one prompt", lo=1, hi=64)
    speculative: bool = _field(True, "let the engine speculate for this request when it is configured to")
    deterministic: bool | None = _field(None, "the same tokens whatever the batch, chunking and speculation; "
                                              "none: the engine's --deterministic")
    response_format: dict | None = _field(None, "what the output must be: OpenAI's json_schema / json_object, or "
                                                "ridge's regex / grammar (docs/protocol.md §3.2.1)",
                                          check=lambda v: v is None or isinstance(v, dict), what="a map with a type")
    # The grammar the daemon composes for a chat turn (tools, reasoning; daemon/frontend/chat_grammar.py),
    # in llguidance's own form; it replaces the response_format's, which it embeds.
    chat_grammar: str | None = _field(None, "a chat turn's grammar", wire=False)
    # Special tokens whose text the output keeps (chat markers the daemon reads, such as Llama 3's
    # <|python_tag|>); decoding drops every other special token.
    keep_special_ids: tuple[int, ...] = _field((), "special tokens the output's text keeps", wire=False)


@dataclass(frozen=True, slots=True)
class Spec:
    """One declared field, read from the dataclass: its name, its type's parts, default and rule."""
    name: str
    kind: type  # int, float, bool, str, list, dict, frozenset or tuple
    item: type | None  # a list's items
    optional: bool  # None is a value
    default: object
    rule: Rule

    @property
    def default_value(self):
        return self.default() if callable(self.default) else self.default

    @property
    def type_words(self) -> str:
        words = {int: "an integer", float: "a finite number", bool: "a boolean", str: "a string", dict: "a map",
                 list: f"an array of {'strings' if self.item is str else 'integers'}"}[self.kind]
        return words + (" or nil" if self.optional else "")

    @property
    def wire_words(self) -> str:
        return self.rule.wire_what or (self.rule.what if self.kind is dict else self.type_words)

    def wire_ok(self, v) -> bool:
        """v has this field's JSON type (numbers' ranges apart)."""
        if v is None:
            return self.optional
        if isinstance(v, self.rule.wire_as):
            return True
        if self.kind is float:
            return is_num(v)
        if self.kind is int:
            return is_int(v)
        if self.kind is list:
            return isinstance(v, list) and all(is_int(x) if self.item is int else isinstance(x, self.item) for x in v)
        return isinstance(v, self.kind)

    def problem(self, v) -> str | None:
        """-> what v must be, if it is not that; None when it is."""
        r = self.rule
        if v is None and self.optional:
            return None
        if self.kind in (int, float):
            ok = is_int(v) if self.kind is int else is_num(v)
            if not ok or (r.lo is not None and (v <= r.lo if r.lo_open else v < r.lo)) or \
                    (r.hi is not None and v > r.hi) or (r.check is not None and not r.check(v)):
                return self.bounds_words()
            return None
        if self.kind is bool:
            return None if isinstance(v, bool) else "a boolean"
        try:
            return None if r.check is None or r.check(v) else r.what
        except TypeError:  # a value of another type altogether
            return r.what

    def bounds_words(self) -> str:
        r = self.rule
        if r.what:
            return r.what
        base = "an integer" if self.kind is int else "a finite number"
        if r.lo is not None and r.hi is not None:
            return f"{base} in {'(' if r.lo_open else '['}{_num(r.lo)}, {_num(r.hi)}]"
        if r.lo is not None:
            return f"{base} {'>' if r.lo_open else '>='} {_num(r.lo)}"
        return base


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _parts(hint) -> tuple[type, type | None, bool]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    if optional:
        hint = args[0]
    origin = typing.get_origin(hint) or hint
    items = typing.get_args(hint)
    return origin, items[0] if origin is list and items else None, optional


@cache
def specs(cls=Sampling) -> dict[str, Spec]:
    """name -> Spec, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        if "rule" not in f.metadata:
            continue
        kind, item, optional = _parts(hints[f.name])
        default = f.default_factory if f.default is MISSING else f.default
        out[f.name] = Spec(f.name, kind, item, optional, default, f.metadata["rule"])
    return out


def wire_specs() -> dict[str, Spec]:
    """The params a client may send."""
    return {k: s for k, s in specs().items() if s.rule.wire}


def check(values) -> None:
    """Each declared field of `values` (a Sampling, or anything with those attributes) within its
    rule; raises FieldError naming the first that is not."""
    for name, s in specs().items():
        if (want := s.problem(getattr(values, name))) is not None:
            raise FieldError(name, want)


def from_wire(raw: dict) -> dict:
    """A params map as msgpack or JSON carried it -> Sampling's fields: numbers where floats are
    declared are floats. Unknown keys are left for the caller to refuse."""
    out = dict(raw)
    for k, v in raw.items():
        s = specs().get(k)
        if s is not None and s.kind is float and is_int(v):
            out[k] = float(v)
    return out


# -- the generate message's other fields ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BodyField:
    """A generate field beside params. since: the protocol feature (daemon/protocol.SINCE) it came
    with. check/what: its type, where the validator checks it here (tools and messages have their
    own module, daemon/frontend/tools.py). refusal: the words a daemon that cannot honour it yet
    answers, after the field's name (None: served)."""
    name: str
    doc: str
    since: str | None = None
    check: typing.Callable | None = None
    what: str | None = None
    refusal: str | None = None


MAX_SALT_BYTES = 1024
# Images in one request (its image frames, docs/protocol.md §3.2.5) and their encoded bytes together:
# each image is bounded apart too (ridge/vision/decode.ImageLimits).
MAX_IMAGES = 16
MAX_IMAGE_BYTES = 64 << 20


GENERATE = {f.name: f for f in (
    BodyField("stream", "deltas as they come (default true), or one final", check=lambda v: isinstance(v, bool),
              what="a boolean"),
    BodyField("cache_salt", f"shares cached prefixes only with requests of the same salt",
              check=lambda v: v is None or (isinstance(v, str) and 0 < len(v.encode()) <= MAX_SALT_BYTES),
              what=f"a non-empty string of at most {MAX_SALT_BYTES} bytes, or nil"),
    BodyField("model", "the model to run (default: the daemon's)", since="models"),
    BodyField("keep_alive", "seconds the model stays loaded after this request", since="models"),
    BodyField("tools", "functions the model may call", since="tools"),
    BodyField("tool_choice", "none, auto, required, or a named function", since="tools"),
    BodyField("parallel_tool_calls", "more than one call in a sample", since="tools"),
    BodyField("chat_template_kwargs", "extra variables for the chat template", since="tools"),
    # Served by some models only (images), or not yet (adapter): a client is told by name.
    BodyField("images", "how many image frames follow the message (§3.2.5): the prompt's images, in order",
              since="images", check=lambda v: is_int(v) and 0 <= v <= MAX_IMAGES,
              what=f"an integer in [0, {MAX_IMAGES}]", refusal="this model takes no image input"),
    BodyField("adapter", "the id of an adapter (LoRA) to run the model with",
              check=lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= 256),
              what="an adapter id (a string of 1-256 characters), or nil", refusal="this daemon serves no adapters"),
)}


def body_problem(body: dict) -> tuple[str, str] | None:
    """-> (the field, what it must be) for the first generate field of the wrong type, else None."""
    for name, f in GENERATE.items():
        if name in body and f.check is not None and not f.check(body[name]):
            return name, f.what
    return None


def refusal(body: dict, served: frozenset = frozenset()) -> str | None:
    """The first field given that the daemon cannot honour yet, as its refusal, naming it.
    served: the fields this daemon's model honours after all (images, for a model that takes them)."""
    for name, f in GENERATE.items():
        if f.refusal is not None and name not in served and body.get(name) not in (None, [], 0):
            return f"{name}: {f.refusal}"
    return None
