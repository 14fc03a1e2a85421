"""`params.response_format`: what a request asks its output to be, checked for
shape only (no library, no tokenizer). Whether it compiles is the grammar
compiler's question (grammar.py), asked at admission too.

The shapes are OpenAI's, plus ridge's own regex and grammar types:
  {"type": "text"}                                          no constraint
  {"type": "json_object"}                                   any JSON object
  {"type": "json_schema", "json_schema": {"schema": {...}, "name"?, "strict"?, "description"?}}
  {"type": "regex", "regex": "..."}                         the whole output matches
  {"type": "grammar", "grammar": "..."}                     Lark (llguidance's dialect) or GBNF"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ridge.errors import InvalidRequest

TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
_FIELDS = {"text": set(), "json_object": set(), "json_schema": {"json_schema"}, "regex": {"regex"},
           "grammar": {"grammar"}}
_SCHEMA_FIELDS = {"name", "schema", "strict", "description"}
MAX_TEXT = 1 << 20  # characters of a regex, a grammar or a schema (as compact JSON)


@dataclass(frozen=True, slots=True)
class Constraint:
    """One parsed response_format: kind is json_schema, regex or grammar; text is the
    schema as compact JSON, the regex or the grammar. key names it in caches. A chat turn's
    grammar (SamplingParams.chat_grammar) is kind llguidance, text in the library's form."""
    kind: str
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.text


def _bad(msg: str) -> InvalidRequest:
    return InvalidRequest(f"response_format{msg}")


def parse_response_format(fmt, chat_grammar: str | None = None) -> Constraint | None:
    """-> the constraint, or None for no constraint (absent, or type text). Raises
    InvalidRequest for a shape error; a schema that does not compile is found later.
    chat_grammar: a chat turn's grammar (SamplingParams.chat_grammar), which embeds the
    response_format and replaces it."""
    if chat_grammar is not None:
        parse_response_format(fmt)  # its shape is still checked
        return Constraint("llguidance", chat_grammar)
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad(" must be a map with a type")
    kind = fmt.get("type")
    if kind not in TYPES:
        raise _bad(f".type must be one of {', '.join(TYPES)}")
    unknown = set(fmt) - _FIELDS[kind] - {"type"}
    if unknown:
        raise _bad(f": unknown field(s) {', '.join(sorted(map(str, unknown)))} for type {kind}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", '{"type":"object"}')
    if kind == "json_schema":
        return Constraint("json_schema", _schema_text(fmt.get("json_schema")))
    text = fmt.get(kind)
    if not isinstance(text, str) or not text or len(text) > MAX_TEXT:
        raise _bad(f".{kind} must be a non-empty string of at most {MAX_TEXT} characters")
    return Constraint(kind, text)


def _schema_text(js) -> str:
    if not isinstance(js, dict):
        raise _bad(".json_schema must be a map with a schema")
    unknown = set(js) - _SCHEMA_FIELDS
    if unknown:
        raise _bad(f".json_schema: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    schema = js.get("schema", {"type": "object"})  # OpenAI's schema is optional: any object
    if not isinstance(schema, (dict, bool)):
        raise _bad(".json_schema.schema must be a JSON schema (a map)")
    try:
        # Not sorted: properties are generated in the schema's order, so order is meaning.
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _bad(f".json_schema.schema is not JSON: {e}") from None
    if len(text) > MAX_TEXT:  # as a regex's or a grammar's: the compiler's work grows with it
        raise _bad(f".json_schema.schema must be at most {MAX_TEXT} characters as compact JSON")
    return text
