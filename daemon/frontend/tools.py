"""A chat turn's version-2 fields (docs/protocol.md §3.2.3): the messages with
their tool calls and tool results, `tools`, `tool_choice`,
`parallel_tool_calls` and `chat_template_kwargs`, checked into a ChatTurn,
and the messages as the chat template reads them.

Plain data in, plain data out: no tokenizer, no engine. Which format the
model writes its calls in, and the grammar that holds it to them, are
chat_format.py's and chat_grammar.py's."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ridge.request import GENERATE

from ..protocol import SINCE, ProtocolError, fail, speaks

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
CHOICES = ("auto", "none", "required")
# What the renderer sets itself: a client's chat_template_kwargs cannot replace them.
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content"})
V2_FIELDS = tuple(k for k, f in GENERATE.items() if f.since == "tools")  # declared in ridge/request.py
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict  # the JSON schema of its arguments: an object
    spec: dict  # {"type": "function", "function": {...}} as the client sent it, for the template


@dataclass(slots=True)
class ChatTurn:
    """What a chat request asks about tools, checked. tool_choice: auto | none | required | named."""
    messages: list[dict]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str = "auto"
    named: str | None = None  # the tool a named tool_choice forces
    parallel: bool = True
    template_kwargs: dict = field(default_factory=dict)

    @property
    def calls(self) -> list[Tool]:
        """The tools the model may call now: none, one (named) or all."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t for t in self.tools if t.name == self.named] if self.named else self.tools

    @property
    def forced(self) -> bool:
        """A call is required from the first token of the answer."""
        return self.tool_choice in ("required", "named") and bool(self.calls)

    @property
    def shown_tools(self) -> list[dict] | None:
        """The tools the template is given: none when the model may call none (tool_choice none)."""
        return [t.spec for t in self.tools] if self.calls else None


# -- checks ----------------------------------------------------------------------------------
def check_messages(x, rid: str | None, max_messages: int, tools: bool) -> list[dict]:
    """Without tools (protocol version 1): {role, content: str}. With them (SINCE["tools"]):
    OpenAI's tool calls, tool results and reasoning_content too (§3.2.3)."""
    if not isinstance(x, list) or not x or len(x) > max_messages:
        raise fail("messages", f"a non-empty array of at most {max_messages} maps", rid)
    for i, m in enumerate(x):
        where = f"messages[{i}]"
        if not tools:
            if not isinstance(m, dict) or set(m) - {"role", "content"}:
                raise fail(where, "a map with exactly the keys role and content", rid)
        elif not isinstance(m, dict) or set(m) - MESSAGE_KEYS:
            raise fail(where, "a map with the keys role, content, tool_calls, tool_call_id, name, "
                       "reasoning_content", rid)
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise fail(f"{where}.role", "a non-empty string", rid)
        calls = m.get("tool_calls")
        if calls is not None:
            _check_calls(calls, f"{where}.tool_calls", rid)
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and calls)):
            raise fail(f"{where}.content", "a string (nil only beside tool_calls)", rid)
        for key in ("tool_call_id", "name", "reasoning_content"):
            if key in m and not isinstance(m[key], str):
                raise fail(f"{where}.{key}", "a string", rid)
    return x


def _check_calls(calls, where: str, rid: str | None) -> None:
    if not isinstance(calls, list):
        raise fail(where, "an array of calls", rid)
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(c, dict) and set(c) <= {"id", "type", "function"} and c.get("type", "function") == "function"
                and isinstance(c.get("id", ""), str) and isinstance(f, dict) and set(f) <= {"name", "arguments"}
                and isinstance(f.get("name"), str) and isinstance(f.get("arguments", ""), (str, dict))):
            raise fail(f"{where}[{j}]", 'a map {"id", "type": "function", "function": {"name", "arguments"}} '
                       "with arguments a JSON text or a map", rid)


def check_turn(body: dict, messages: list[dict], rid: str | None) -> ChatTurn:
    """body: the generate (or tokenize) message's fields."""
    tools = _tools(body.get("tools"), rid)
    names = {t.name for t in tools}
    choice, named = _choice(body.get("tool_choice"), names, rid)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise fail("parallel_tool_calls", "a boolean", rid)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise fail("chat_template_kwargs", "a map", rid)
    if taken := sorted(RESERVED_KWARGS & set(kwargs)):
        raise fail("chat_template_kwargs", f"a map without {', '.join(taken)} (the renderer sets them)", rid)
    return ChatTurn(messages, tools, choice, named, parallel, kwargs)


def _tools(raw, rid: str | None) -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise fail("tools", f"an array of at most {MAX_TOOLS} function tools", rid)
    out, seen = [], set()
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        f = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and set(t) <= {"type", "function"} and t.get("type") == "function"
                and isinstance(f, dict)):
            raise fail(where, 'a map {"type": "function", "function": {...}}', rid)
        if set(f) - {"name", "description", "parameters", "strict"}:
            raise fail(f"{where}.function", "a map of name, description, parameters, strict", rid)
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise fail(f"{where}.function.name", "1-64 characters of A-Z, a-z, 0-9, _, . and -", rid)
        if name in seen:
            raise fail(f"{where}.function.name", f"unique ({name!r} is named twice)", rid)
        seen.add(name)
        if not isinstance(f.get("description", ""), str) or not isinstance(f.get("strict", False), bool):
            raise fail(f"{where}.function", "a map whose description is a string and strict a boolean", rid)
        params = f.get("parameters")
        if params is None:
            params = ANY_OBJECT
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise fail(f"{where}.function.parameters", "a JSON schema of an object", rid)
        out.append(Tool(name, params, t))
    return out


def _choice(raw, names: set[str], rid: str | None) -> tuple[str, str | None]:
    if raw is None:
        return "auto", None
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise fail("tool_choice", f"one of {', '.join(CHOICES)} or a named function", rid)
        if raw == "required" and not names:
            raise fail("tool_choice", "auto or none when there are no tools", rid)
        return raw, None
    f = raw.get("function") if isinstance(raw, dict) else None
    name = f.get("name") if isinstance(f, dict) else None
    if not (isinstance(raw, dict) and raw.get("type") == "function" and isinstance(name, str)):
        raise fail("tool_choice", '"auto", "none", "required" or {"type": "function", "function": {"name": N}}', rid)
    if name not in names:
        raise fail("tool_choice.function.name", f"one of the tools (no tool is named {name[:64]!r})", rid)
    return "named", name


def version_fields(body: dict, version: int, rid: str | None) -> None:
    """The tools' fields are refused, by name, in a message of a version before them."""
    if not speaks(version, "tools"):
        for k in V2_FIELDS:
            if k in body:
                raise ProtocolError("invalid_field", f"{k} needs protocol version {SINCE['tools']}", rid)


# -- the messages as the template reads them -------------------------------------------------------
def template_messages(messages: list[dict]) -> list[dict]:
    """Each call's arguments as a map (what Hugging Face templates render with tojson; a text that
    is not a JSON object stays as it is), and "" for the nil content beside calls."""
    out = []
    for m in messages:
        if "tool_calls" not in m and m.get("content") is not None:
            out.append(m)
            continue
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": arguments_map(c["function"].get("arguments", {}))}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def arguments_map(arguments):
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
