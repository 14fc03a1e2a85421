"""Each HTTP API's words for the request's declared fields (ridge/request.py).

A dialect only renames fields and maps their defaults and special values: the
fields, their types and their docs come from the declaration, both for the
pydantic models (schemas.py and its siblings, hence /openapi.json) and for the
daemon's params built from a body (`Dialect.params`). The values are the
daemon's to check, once, and its refusal names the field.

Fields a dialect leaves out are those it takes in a shape of its own, handled
by its translator (max_tokens is a ceiling everywhere, n and logprobs take
OpenAI's forms, response_format each API's), or that have no meaning there."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ridge.request import Spec, wire_specs

_TYPES = {int: StrictInt, float: StrictFloat, bool: StrictBool, str: StrictStr}


def _annotation(s: Spec):
    if s.kind is list:
        return Optional[list[_TYPES[s.item]]]
    return Optional[_TYPES.get(s.kind, dict[str, Any])]


class DialectError(ValueError):
    """A value the API's form cannot carry to the daemon: its field and why."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.field, self.message = name, message


@dataclass(frozen=True)
class Dialect:
    """renames: the API's name -> the declared one, for a field it takes only under its own name.
    aliases: a second name for a declared field, beside it (one request gives one of them), with
    what it implies unless given (llama-server's repeat_penalty reads the last 64 tokens).
    defaults: the API's value (declared names) where a request leaves a field out. values: the
    API's value -> the daemon's (None: as if absent). exclude: declared fields it does not take
    under their names (see the module's doc)."""
    name: str
    exclude: frozenset = frozenset()
    renames: dict = field(default_factory=dict)
    aliases: dict = field(default_factory=dict)  # API name -> (declared name, {declared: implied value})
    defaults: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)  # declared name -> callable(API value) -> daemon value
    notes: dict = field(default_factory=dict)  # API name -> its doc in this API, where it differs
    alias_notes: dict = field(default_factory=dict)  # an alias -> whose name it is

    def names(self) -> dict[str, Spec]:
        """The API's field name -> the declared field, in declaration order."""
        back = {v: k for k, v in self.renames.items()}
        out = {}
        for name, s in wire_specs().items():
            if name in self.exclude:
                continue
            out[back.get(name, name)] = s
            out.update({a: s for a, (target, _) in self.aliases.items() if target == name})
        return out

    def model_fields(self, shapes: dict | None = None) -> dict:
        """pydantic field definitions (for create_model): each field optional, typed as declared
        unless shapes (declared name -> annotation) gives its JSON shape in this API."""
        shapes = shapes or {}
        out = {}
        for api, s in self.names().items():
            doc = s.rule.doc
            if s.name in self.defaults:
                doc += f" (default {self.defaults[s.name]}, as {self.name}'s)"
            if note := self.notes.get(api):
                doc = note
            out[api] = (shapes.get(s.name, _annotation(s)), Field(None, description=doc))
        return out

    def params(self, given: Callable[[str], Any], defaults: bool = True) -> dict:
        """The daemon's params (declared names) from the API's fields; given(api name) -> the
        value, None when absent."""
        out: dict = {}
        for api, s in self.names().items():
            if api in self.aliases or (v := given(api)) is None:
                continue
            value = self.values[s.name](v) if s.name in self.values else v
            if value is not None:
                out[s.name] = value
        for api, (target, implied) in self.aliases.items():
            if (v := given(api)) is None:
                continue
            if given(self.api_name(target)) is not None:
                raise DialectError(api, f"give {api} ({self.alias_notes.get(api, self.name)}) or "
                                   f"{self.api_name(target)}, not both")
            out[target] = v
            for k, iv in implied.items():
                out.setdefault(k, iv)
        if defaults:
            for k, v in self.defaults.items():
                out.setdefault(k, v)
        return out

    def api_name(self, declared: str) -> str:
        return next((a for a, d in self.renames.items() if d == declared), declared)


def bias_pairs(v) -> list:
    """OpenAI's logit_bias map (token ids as JSON keys) or llama-server's pairs -> pairs: msgpack
    maps keep string keys, and llama-server's strings need pairs anyway."""
    if not isinstance(v, dict):
        return [list(pair) for pair in v] or None
    pairs = []
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit()):
            raise DialectError("logit_bias", f"logit_bias: {key!r} is not a token id")
        pairs.append([int(key), bias])
    return pairs or None


def stop_list(v) -> list[str]:
    """A stop string or strings -> the declared list, empty strings dropped (they never match)."""
    return [s for s in ([v] if isinstance(v, str) else v) if s] or None


# Handled by every translator in its own shape: the ceiling of max_tokens, OpenAI's forms of n and
# logprobs, each API's response_format.
OWN_SHAPES = frozenset({"max_tokens", "n", "logprobs", "response_format"})
# llama-server's repeat_penalty (a window of 64 tokens unless repeat_last_n) beside vLLM's
# repetition_penalty (the whole context).
REPEAT = {"repeat_penalty": ("repetition_penalty", {"repeat_last_n": 64})}

_VALUES = {"top_k": lambda v: 0 if v == -1 else v, "stop": stop_list, "logit_bias": bias_pairs}
_NOTES = {"top_k": "keep the k likeliest tokens; 0 or -1 (vLLM's) = off",
          "repetition_penalty": "vLLM's: over the whole context unless repeat_last_n",
          "repeat_penalty": "llama-server's: over the last repeat_last_n (64) tokens",
          "presence_penalty": "[-2, 2], over the generated tokens",
          "frequency_penalty": "[-2, 2], over the generated tokens",
          "logit_bias": "token id -> bias; or llama-server's [[token id or string, bias or false], ...]"}
_WHOSE = {"repeat_penalty": "llama-server's"}
OPENAI = Dialect("OpenAI", exclude=OWN_SHAPES, aliases=REPEAT, defaults={"temperature": 1.0}, values=_VALUES,
                 notes=_NOTES, alias_notes=_WHOSE)
# The Responses and Messages APIs take ridge's fields under chat's names, as extensions.
RESPONSES = OPENAI
ANTHROPIC = Dialect("Anthropic", exclude=OWN_SHAPES, renames={"stop_sequences": "stop"}, aliases=REPEAT,
                    defaults={"temperature": 1.0}, values=_VALUES, notes=_NOTES, alias_notes=_WHOSE)
# Ollama's options (its docs/modelfile.md), with its defaults when a Modelfile sets none:
# repeat_penalty 1.1 over repeat_last_n 64. A negative seed asks for a random one, as Ollama's -1.
OLLAMA = Dialect("Ollama", exclude=OWN_SHAPES | {"logit_bias", "stop_token_ids", "ignore_eos", "speculative",
                                                 "deterministic"},
                 renames={"repeat_penalty": "repetition_penalty"},
                 defaults={"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1,
                           "repeat_last_n": 64},
                 values={"seed": lambda seed: seed if seed >= 0 else None, "stop": stop_list})
