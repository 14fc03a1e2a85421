"""The grammar of a chat turn's answer (docs/protocol.md §3.2.3), in
llguidance's Lark: the thinking, free and within its budget, then the answer:
free text, the response_format, or tool calls in the model's format, each
call's arguments held to its tool's schema.

For `auto` the calls are lazy, as llguidance's tool-calling grammars are:
any text until the format's trigger, then a call; a trigger that is a special
token cannot occur in text at all, one written as text ends the text lexeme
lazily, where it first appears. For `required` and a named tool the calls
begin at the first token of the answer. The thinking text cannot hold the
close tag, so the model closes it by writing `</think>`, or at the budget the
grammar does."""
from __future__ import annotations

import json

from ridge.engine.structured.grammar import JSON_WHITESPACE, named_grammars

from .chat_format import HERMES, LLAMA3_JSON, MISTRAL, ChatFormat
from .tools import ChatTurn, Tool

ANY = "ANY: /(.|\\n)*/"
_META = set("\\.+*?()|[]{}^$/#&-~")  # what a Lark /regex/ escapes (Rust regex refuses \< and \>)


def _regex_text(text: str) -> str:
    return "".join("\\" + c if c in _META else c for c in text)


class Marks:
    """The markers as the grammar names them: a token the grammar engine holds as special by its
    id (text cannot spell it), any other as its text."""

    def __init__(self, fmt: ChatFormat, tokens: frozenset[str]):
        self.fmt, self.tokens = fmt, tokens  # tokens: the roles whose marker is such a token

    def __getitem__(self, role: str) -> str:
        m = self.fmt.markers[role]
        return f"<[{m.token_id}]>" if role in self.tokens else json.dumps(m.text)

    def is_token(self, role: str) -> bool:
        return role in self.tokens


def turn_grammar(fmt: ChatFormat, turn: ChatTurn, start: str, budget: int | None, rf,
                 tokens: frozenset[str] = frozenset()) -> str | None:
    """The turn's grammar (llguidance's JSON form), or None when nothing but the response_format
    (or nothing at all) constrains it. start: ChatFormat.reasoning_start of the prompt; rf: the
    parsed response_format (SamplingParams.constraint()) or None; tokens: the marker roles the
    grammar engine holds as special tokens."""
    thinks = start != "content"
    if not turn.calls and not (thinks and (rf is not None or budget is not None)):
        return None
    marks = Marks(fmt, tokens)
    rules = ["%llguidance {}", ANY]
    head = _thinking(marks, start, budget, rules) if thinks else ""
    rules.insert(1, f"start: {head} answer".replace("  ", " "))
    rules += _answer(marks, turn, rf is not None)
    grammars = [{"name": "turn", "lark_grammar": "\n".join(rules)}]
    if rf is not None:
        grammars += named_grammars(rf, "rf")
    return json.dumps({"grammars": grammars})


def _thinking(marks: Marks, start: str, budget: int | None, rules: list[str]) -> str:
    close = marks["think_close"]
    if marks.is_token("think_close"):  # text cannot hold a special token: any text is thinking
        rules.append("THINK: /(.|\\n)*/")
    else:
        text = marks.fmt.markers["think_close"].text
        rules.append(f"THINK: /(.|\\n)*/ & ~/(?s:.*){_regex_text(text)}(?s:.*)/")
    if budget == 0:
        body = close
    elif budget is not None:
        rules.append(f"thought[max_tokens={budget}]: THINK")
        body = f"thought {close}"
    else:
        body = f"THINK {close}"
    rules += [f"think: {body} GAP", "GAP: /[ \\t\\r\\n]{0,4}/"]
    return "think" if start == "think" else f"{marks['think_open']} think"


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SUBSCHEMAS = ("items", "not", "additionalItems", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def closed(schema):
    """The schema with every object that does not say what else it admits admitting no other key
    (xgrammar's strict mode, as vLLM runs it): a call's arguments are those its tool declares. A
    small model otherwise writes keys of its own until max_tokens. allOf's members are left open,
    where closing one would refuse the keys of the others."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if ("properties" in out or out.get("type") == "object") and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    for k in _SUBSCHEMAS:
        if k in out:
            out[k] = closed(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed(x) for x in out[k]]
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(x) for name, x in out[k].items()}
    return out


_KEY_SCHEMAS = ("items", "not", "additionalItems", "contains", "additionalProperties", "unevaluatedProperties",
                "unevaluatedItems", "if", "then", "else")
_KEY_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_KEY_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def without_vacuous(schema):
    """The schema less the `propertyNames` every key meets ({"type": "string"}, {}, true: a JSON
    key is a string), which the grammar engine does not implement; nothing it admits changes.
    Claude Code's AskUserQuestion tool declares one."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if out.get("propertyNames") in ({"type": "string"}, {}, True):
        del out["propertyNames"]
    for k in _KEY_SCHEMAS:
        if k in out:
            out[k] = without_vacuous(out[k])
    for k in _KEY_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [without_vacuous(x) for x in out[k]]
    for k in _KEY_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: without_vacuous(x) for name, x in out[k].items()}
    return out


def _call_schema(tool: Tool, key: str) -> dict:
    """{"name": const, key: the tool's parameters, closed}; the parameters' $defs move to the root,
    where their "#/$defs/..." references point."""
    params = closed(without_vacuous(tool.parameters))
    root = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    return {"type": "object", "properties": {"name": {"const": tool.name}, key: params},
            "required": ["name", key], "additionalProperties": False,
            "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, **root}


def _answer(marks: Marks, turn: ChatTurn, has_rf: bool) -> list[str]:
    tools, fmt = turn.calls, marks.fmt.tool_format
    if not tools:
        return ["answer: @rf" if has_rf else "answer: ANY"]
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    rules = [f"c{i}: %json {json.dumps(_call_schema(t, key))}" for i, t in enumerate(tools)]
    rules.append("obj: " + " | ".join(f"c{i}" for i in range(len(tools))))
    many = turn.parallel
    trigger = None
    if fmt == HERMES:
        rules.append(f'block: "\\n" obj "\\n" {marks["call_close"]}')
        forced = f'{marks["call_open"]} block' + (f' ("\\n" {marks["call_open"]} block)*' if many else "")
        auto = "answer: call* ANY" if many else "answer: call | ANY"
        trigger, body = "call_open", "block"
    elif fmt == MISTRAL:
        rules.append('arr: "[" obj ' + ('(", " obj)* ' if many else "") + '"]"')
        forced = f'{marks["tool_calls"]} arr'
        auto = "answer: call | ANY"
        trigger, body = "tool_calls", "arr"
    else:
        rules.append("calls: obj" + (' ("; " obj)*' if many else ""))
        forced = "calls"
        # Text that does not open with "{": a leading "{" is a call, as Llama 3's templates ask.
        auto = f"answer: TEXT | calls | {marks['python_tag']} calls\nTEXT: /([^{{ \\t\\r\\n](.|\\n)*)?/"
    if turn.forced:
        rules.append(f"answer: {forced}")
    elif has_rf:
        rules.append(f"answer: {forced} | @rf")
    else:
        rules.append(auto)
        if trigger is not None:
            rules += _lazy_call(marks, trigger, body)
    return rules


def _lazy_call(marks: Marks, trigger: str, body: str) -> list[str]:
    """`call`: any text, the trigger, the body. Text cannot hold a special token, so that trigger
    ends it by itself; a trigger written as text ends a lazy lexeme where it first appears."""
    if marks.is_token(trigger):
        return [f"call: ANY {marks[trigger]} {body}"]
    return [f"call_head[lazy]: ANY {marks[trigger]}", f"call: call_head {body}"]
