"""The grammar of a chat turn's answer (docs/protocol.md §3.2.3), in
llguidance's Lark: the thinking, free and within its budget, then the answer:
free text, the response_format, or tool calls in the model's format, each
call's arguments held to its tool's schema.

For `auto` the calls are lazy, as llguidance's tool-calling grammars are:
any text until the format's trigger, then a call; a trigger that is a special
token cannot occur in text at all, one written as text ends the text lexeme
lazily, where it first appears. For `required` and a named tool the calls
begin at the first token of the answer. The thinking text cannot hold the
close tag, so the model closes it by writing it (`</think>`, Gemma 4's
`<channel|>`), or at the budget the grammar does.

Calls whose arguments are not JSON are built from the schema here: Qwen3.5's
<parameter=KEY> blocks (a string raw, any other value JSON through %json) and
Gemma 4's call:NAME{key:value} syntax (_GemmaCalls)."""
from __future__ import annotations

import json

from ridge.engine.structured.grammar import JSON_WHITESPACE, named_grammars

from .chat_format import GEMMA4, HERMES, LLAMA3_JSON, MISTRAL, QWEN3_XML, ChatFormat
from .chat_calls import text_params
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
        if role not in self.tokens:
            return json.dumps(m.text)
        return f"<[{m.token_id}]>" + (f" {json.dumps(m.rest)}" if m.rest else "")

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
    if fmt == QWEN3_XML:
        rules = _xml_calls(tools)
    elif fmt == GEMMA4:
        rules = _GemmaCalls(marks["g_quote"]).calls(tools)
    else:
        rules = [f"c{i}: %json {json.dumps(_call_schema(t, key))}" for i, t in enumerate(tools)]
    rules.append("obj: " + " | ".join(f"c{i}" for i in range(len(tools))))
    many = turn.parallel
    trigger = None
    if fmt == GEMMA4:  # calls follow one another with nothing between them
        rules.append(f'block: obj {marks["g_call_close"]}')
        forced = f'{marks["g_call_open"]} block' + (f' ({marks["g_call_open"]} block)*' if many else "")
        auto = "answer: call* ANY" if many else "answer: call | ANY"
        trigger, body = "g_call_open", "block"
    elif fmt in (HERMES, QWEN3_XML):
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


def _params(tool: Tool) -> tuple[dict, dict]:
    """The tool's parameters, closed, and their $defs (where "#/$defs/..." references point)."""
    params = closed(without_vacuous(tool.parameters))
    return params, {k: params[k] for k in ("$defs", "definitions") if k in params}


def _text_regex(schema: dict) -> str:
    """A string's raw text, within its length bounds, as a Lark /regex/."""
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    return "/(.|\\n)*/" if not lo and hi is None else f"/(.|\\n){{{lo},{'' if hi is None else hi}}}/"


PARAM_END = '"\\n</parameter>"'


def _xml_calls(tools: list[Tool]) -> list[str]:
    """Qwen3.5's calls: <function=NAME>, each declared parameter in the schema's order (the required
    ones always) as <parameter=KEY>, its value raw text for a string (one lazy lexeme that ends at
    the first close tag, as the reader does; within the length bounds; or an enum's values), JSON
    held to its schema otherwise, then </function>. A tool that declares no parameters takes any,
    as text."""
    texts, rules = text_params(tools), []
    for i, t in enumerate(tools):
        params, defs = _params(t)
        props, required = params.get("properties") or {}, set(params.get("required") or ())
        seq = []
        for k, (key, schema) in enumerate(props.items()):
            v = f"v{i}_{k}"
            if key in texts[t.name]:
                values = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
                if values:
                    rules.append(f"{v}: (" + " | ".join(json.dumps(x) for x in values) + f") {PARAM_END}")
                else:
                    rules.append(f"{v}[lazy]: {_text_regex(schema)} {PARAM_END}")
            else:
                sub = {**schema, **defs, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
                rules += [f"j{i}_{k}: %json {json.dumps(sub)}", f"{v}: j{i}_{k} {PARAM_END}"]
            rules.append(f'p{i}_{k}: {json.dumps(f"<parameter={key}>" + chr(10))} {v} "\\n"')
            seq.append(f"p{i}_{k}" + ("" if key in required else "?"))
        if not props and params.get("additionalProperties") is not False:
            seq.append("xany*")
            if "xany" not in {r.split(":")[0] for r in rules}:
                rules += ["XKEY: /[A-Za-z0-9_.\\-]+/", f"xval[lazy]: {_text_regex({})} {PARAM_END}",
                          'xany: "<parameter=" XKEY ">\\n" xval "\\n"']
        rules.append(f'c{i}: {json.dumps(f"<function={t.name}>" + chr(10))} {" ".join(seq)} "</function>"')
    return rules


class _GemmaCalls:
    """Gemma 4's calls, call:NAME{key:value,...}, as grammar rules from each tool's schema: keys bare
    and in sorted order (as its template writes a call's arguments), the required ones always;
    strings between <|"|> tokens, raw, within their length bounds or among their enum; numbers,
    integers (with their bounds) as JSON; objects, arrays, anyOf and $defs references by structure.
    What a schema leaves open is any value of the syntax."""

    def __init__(self, quote: str):
        self.q, self.rules, self.names, self.defs = quote, [], {}, {}

    def calls(self, tools: list[Tool]) -> list[str]:
        for i, t in enumerate(tools):
            params, self.defs = _params(t)
            self.names = {k: v for k, v in self.names.items() if not k.startswith("#")}
            self.rules.append(f'c{i}: {json.dumps("call:" + t.name)} {self.value(params)}')
        return self.rules

    def _new(self, body: str) -> str:
        name = f"g{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema) -> str:
        if schema is True or not isinstance(schema, dict) or not schema:
            return self.any()
        if isinstance(ref := schema.get("$ref"), str):
            if ref not in self.names:
                self.names[ref] = name = f"g{len(self.rules)}"
                self.rules.append(f"{name}: ")  # filled below: a reference may recur
                target = self.defs
                for part in ref.removeprefix("#/").split("/"):
                    target = target.get(part, {}) if isinstance(target, dict) else {}
                at = self.rules.index(f"{name}: ")
                self.rules[at] = f"{name}: {self.value(target)}"
            return self.names[ref]
        for k in ("anyOf", "oneOf"):
            if isinstance(schema.get(k), list):
                return "(" + " | ".join(self.value(s) for s in schema[k]) + ")"
        values = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
        if values:
            return "(" + " | ".join(self.literal(v) for v in values) + ")"
        t = schema.get("type")
        if isinstance(t, list):
            return "(" + " | ".join(self.value({**schema, "type": x}) for x in t) + ")"
        if t == "string":
            lexeme = f"GS{len(self.rules)}"
            self.rules.append(f"{lexeme}: {_text_regex(schema)}")
            return f"{self.q} {lexeme} {self.q}"
        if t in ("integer", "number"):
            return self._new(f"%json {json.dumps(schema)}")
        if t == "boolean":
            return '("true" | "false")'
        if t == "null":
            return '"null"'
        if t == "array":
            item = self.value(schema.get("items", True))
            return self._new(f'"[" {item} ("," {item})* "]"' if schema.get("minItems", 0) > 0 else
                             f'"[" ({item} ("," {item})*)? "]"')
        if t == "object" or "properties" in schema:
            return self.object(schema)
        return self.any()

    def object(self, schema: dict) -> str:
        props = sorted((schema.get("properties") or {}).items())
        if not props:
            return self.any_object() if schema.get("additionalProperties") is not False else '"{" "}"'
        required = set(schema.get("required") or ())
        items = [(self._new(f'{json.dumps(k + ":")} {self.value(v)}'), k in required) for k, v in props]
        # first: the items from k on, none written yet; rest: from k on after one, a comma first. Each
        # rule holds its non-empty forms; `?` where it is used admits none.
        first = rest = ""  # the rule as used: name, name? (it may be empty) or "" (nothing from k on)
        for item, needed in reversed(items):
            head, lead = self._new(f'"," {item} {rest}'.rstrip()), self._new(f"{item} {rest}".rstrip())
            rest = head if needed else self._either(head, rest)
            first = lead if needed else self._either(lead, first)
        return f'"{{" {first} "}}"'

    def _either(self, present: str, absent: str) -> str:
        """An optional item's rule: written (present) or not (absent: what may follow, or "")."""
        if not absent:
            return present + "?"
        return self._new(f"{present} | {absent.rstrip('?')}") + ("?" if absent.endswith("?") else "")

    def literal(self, v) -> str:
        if isinstance(v, str):
            return f"{self.q} {json.dumps(v)} {self.q}" if v else f"{self.q} {self.q}"
        if isinstance(v, dict):
            inner = ' "," '.join(f'{json.dumps(k + ":")} {self.literal(x)}' for k, x in sorted(v.items()))
            return f'"{{" {inner} "}}"'
        if isinstance(v, list):
            return '"[" ' + ' "," '.join(self.literal(x) for x in v) + ' "]"' if v else '"[" "]"'
        return json.dumps(json.dumps(v))

    def any(self) -> str:
        if "gany" not in self.names:
            self.names["gany"] = "gany"
            self.rules += [f'gany: {self.q} GTEXT {self.q} | GNUM | "true" | "false" | "null" | gobj | garr',
                           "GTEXT: /(.|\\n)*/", "GNUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+\\-]?[0-9]+)?/",
                           "GKEY: /[A-Za-z0-9_.\\-]+/", 'gobj: "{" (GKEY ":" gany ("," GKEY ":" gany)*)? "}"',
                           'garr: "[" (gany ("," gany)*)? "]"']
        return "gany"

    def any_object(self) -> str:
        self.any()
        return "gobj"
