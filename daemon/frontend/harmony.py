"""gpt-oss's harmony chat format (docs/protocol.md §3.2.3): the prompt as
its chat template renders it, the grammar of its answer, and the reader of
its output channels.

A harmony conversation is messages `<|start|>{role}<|message|>{text}<|end|>`,
each assistant message on a channel: `analysis` (the thinking, read into
reasoning_content), `final` (the answer, content, ended by `<|return|>`) and
`commentary` (a call when addressed `to=functions.NAME`, its arguments a JSON
text ended by `<|call|>`). The system message carries the reasoning effort, the
developer message the instructions and the tools as a TypeScript namespace.

ridge renders the prompt itself, as the gpt-oss template does (openai-harmony,
the reference library, downloads its tokenizer's files at run time, so it is
not used): each call of parallel calls as its own message and a tool result
addressed by its call's id, which the template, rendering one call a turn,
cannot. gpt-oss stops at `<|call|>`, so a turn makes at most one call."""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

from ridge.engine.structured.grammar import JSON_WHITESPACE, named_grammars

from ..protocol import ProtocolError
from .chat_format import HARMONY_TOKENS as TOKENS
from .chat_output import Parsed

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
EFFORTS = ("low", "medium", "high")
# The efforts OpenAI's API names beyond harmony's three, as the nearest harmony knows; "none" also
# turns the analysis channel off (the grammar admits no analysis message).
EFFORT_ALIASES = {"minimal": "low", "none": "low"}
KWARGS = frozenset({"reasoning_effort", "model_identity", "enable_thinking"})
NAMESPACE = "functions"


def effort(kwargs: dict) -> str:
    e = kwargs.get("reasoning_effort", "medium")
    return EFFORT_ALIASES.get(e, e)


def thinks(kwargs: dict) -> bool:
    return kwargs.get("reasoning_effort") != "none" and kwargs.get("enable_thinking", True) is not False


def check_kwargs(kwargs: dict, rid: str | None) -> None:
    if extra := sorted(set(kwargs) - KWARGS):
        raise ProtocolError("invalid_field", f"chat_template_kwargs.{extra[0]}: gpt-oss's harmony prompt takes only "
                            f"{', '.join(sorted(KWARGS))} (builtin tools are not run by ridge)", rid)
    if effort(kwargs) not in EFFORTS:
        raise ProtocolError("invalid_field", "reasoning_effort: one of none, minimal, low, medium, high", rid)
    if not isinstance(kwargs.get("model_identity", ""), str):
        raise ProtocolError("invalid_field", "chat_template_kwargs.model_identity: a string", rid)


# -- the prompt ------------------------------------------------------------------------------------
def _ts_type(spec: dict) -> str:
    """A JSON schema as the gpt-oss template writes it in TypeScript."""
    t = spec.get("type")
    null = " | null" if spec.get("nullable") else ""
    if t == "array":
        if "items" not in spec:
            return "any[]" + null
        item = spec["items"].get("type")
        if item in ("string", "number", "integer", "boolean"):
            return ("number" if item == "integer" else item) + "[]" + null
        inner = _ts_type(spec["items"])
        return ("any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]") + null
    if isinstance(t, list) and t:
        return " | ".join(t)
    if spec.get("oneOf"):
        variants = spec["oneOf"]
        if len(variants) > 1 and any(v.get("type") == "object" for v in variants):
            return "any"
        out = ""
        for i, v in enumerate(variants):
            out += _ts_type(v)
            if v.get("description"):
                out += "// " + v["description"]
            if "default" in v:
                out += "\n" + "// default: " + json.dumps(v["default"], ensure_ascii=False)
            if i < len(variants) - 1:
                out += " | "
        return out
    if t == "string":
        return '"' + '" | "'.join(map(str, spec["enum"])) + '"' if spec.get("enum") else "string" + null
    if t in ("number", "integer"):
        return "number"
    if t == "boolean":
        return "boolean"
    if t == "object":
        props = spec.get("properties")
        if not props:
            return "object"
        required = spec.get("required") or []
        fields = [name + ("" if name in required else "?") + ": " + "\n" + " " * 16 + _ts_type(p)
                  for name, p in props.items()]
        return "{\n" + ", ".join(fields) + "}"
    return "any"


def _default(p: dict) -> str:
    if "default" not in p:
        return ""
    if p.get("enum"):
        return ", // default: " + str(p["default"])
    if p.get("oneOf"):
        return "// default: " + str(p["default"])
    return ", // default: " + json.dumps(p["default"], ensure_ascii=False)


def namespace(tools: list[dict]) -> str:
    out = f"## {NAMESPACE}\n\nnamespace {NAMESPACE} {{\n\n"
    for t in tools:
        f = t["function"]
        out += "// " + (f.get("description") or "") + "\n" + "type " + f["name"] + " = "
        params = f.get("parameters") or {}
        if not params.get("properties"):
            out += "() => any;\n\n"
            continue
        out += "(_: {\n"
        required = params.get("required") or []
        for name, p in params["properties"].items():
            if p.get("description"):
                out += "// " + p["description"] + "\n"
            out += name + ("" if name in required else "?") + ": " + _ts_type(p) + _default(p) + ",\n"
        out += "}) => any;\n\n"
    return out + f"}} // namespace {NAMESPACE}"


def _message(header: str, text: str, end: str = "<|end|>") -> str:
    return f"<|start|>{header}<|message|>{text}{end}"


def render(messages: list[dict], tools: list[dict] | None, kwargs: dict, add_generation_prompt: bool = True,
           today: str | None = None) -> str:
    """messages: as tools.template_messages made them (arguments as maps); tools: the shown ones."""
    system = (kwargs.get("model_identity", IDENTITY) + "\nKnowledge cutoff: 2024-06\n"
              f"Current date: {today or datetime.now().strftime('%Y-%m-%d')}\n\n"
              f"Reasoning: {effort(kwargs)}\n\n"
              "# Valid channels: analysis, commentary, final. Channel must be included for every message.")
    if tools:
        system += f"\nCalls to these tools must go to the commentary channel: '{NAMESPACE}'."
    out = _message("system", system)
    developer, rest = "", messages
    if messages and messages[0]["role"] in ("developer", "system"):
        developer, rest = messages[0]["content"], messages[1:]
    if developer or tools:
        text = f"# Instructions\n\n{developer}\n\n" if developer else ""
        out += _message("developer", text + ("# Tools\n\n" + namespace(tools) if tools else ""))
    names: dict[str, str] = {}  # call id -> its tool, for the results
    last = None
    for i, m in enumerate(rest):
        role = m["role"]
        if role == "assistant":
            calls = m.get("tool_calls") or []
            thinking = m.get("reasoning_content")
            if calls:
                # The analysis before a call stays in the history until a final answer follows it.
                answered = any(x["role"] == "assistant" and not x.get("tool_calls") for x in rest[i + 1:])
                if m.get("content") and thinking:
                    raise ValueError("an assistant message with tool calls holds content or reasoning_content, "
                                     "not both (harmony has one analysis message before a call)")
                if (m.get("content") or thinking) and not answered:
                    out += _message("assistant<|channel|>analysis", m.get("content") or thinking)
                for c in calls:
                    f = c["function"]
                    out += _message(f"assistant to={NAMESPACE}.{f['name']}<|channel|>commentary json",
                                    json.dumps(f["arguments"], ensure_ascii=False), "<|call|>")
                    last = f["name"]
                    if c.get("id"):
                        names[c["id"]] = f["name"]
            elif i == len(rest) - 1 and not add_generation_prompt:
                if thinking is not None:
                    out += _message("assistant<|channel|>analysis", thinking)
                out += _message("assistant<|channel|>final", m["content"], "<|return|>")
            else:  # earlier turns' thinking is dropped, as in inference
                out += _message("assistant<|channel|>final", m["content"])
                last = None
        elif role == "tool":
            name = names.get(m.get("tool_call_id") or "", last)
            if name is None:
                raise ValueError("a tool message without an earlier assistant tool call")
            out += _message(f"{NAMESPACE}.{name} to=assistant<|channel|>commentary",
                            json.dumps(m["content"], ensure_ascii=False))
        elif role == "user":
            out += _message("user", m["content"])
    return out + ("<|start|>assistant" if add_generation_prompt else "")


# -- the grammar -----------------------------------------------------------------------------------
def _call_rule(i: int, tool, closed) -> list[str]:
    params = closed(tool.parameters)
    params["x-guidance"] = {"whitespace_pattern": JSON_WHITESPACE}
    return [f"a{i}: %json {json.dumps(params)}",
            f'c{i}: {json.dumps(tool.name)} " " <[constrain]> "json" <[message]> a{i} <[call]>']


def grammar(ids: dict, turn, think: bool, budget: int | None, rf, closed) -> str:
    """The answer's grammar in llguidance's Lark: the analysis (when thinking, within its budget),
    then the final message (free, or the response_format) or a call (one, its arguments held to
    the tool's schema), as tool_choice says. ids: TOKENS' key -> token id (every one special)."""
    rules = ["%llguidance {}"]
    head = ""
    if think and budget != 0:
        rules.append("THINK: /(.|\\n)*/")  # text cannot spell a special token: <|end|> ends it
        if budget is not None:
            rules.append(f"thought[max_tokens={budget}]: THINK")
        body = "thought" if budget is not None else "THINK"
        rules.append(f'analysis: <[channel]> "analysis" <[message]> {body} <[end]> <[start]> "assistant"')
        head = "analysis? "
    rules.append("ANY: /(.|\\n)*/")
    final = '<[channel]> "final" <[message]> ' + ("@rf" if rf is not None else "ANY") + " <[return]>"
    tools = turn.calls
    for i, t in enumerate(tools):
        rules += _call_rule(i, t, closed)
    if tools:
        rules.append(f'call: <[channel]> "commentary to={NAMESPACE}." (' + " | ".join(f"c{i}" for i in range(len(tools)))
                     + ")")
    answer = "call" if turn.forced else "final | call" if tools else "final"
    rules[1:1] = [f"start: {head}answer", f"answer: {answer}", f"final: {final}"]
    text = "\n".join(rules)
    for k, i in ids.items():
        text = text.replace(f"<[{k}]>", f"<[{i}]>")
    grammars = [{"name": "turn", "lark_grammar": text}]
    if rf is not None:
        grammars += named_grammars(rf, "rf")
    return json.dumps({"grammars": grammars})


# -- the output ------------------------------------------------------------------------------------
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_HEADER_OPENINGS = ("<|channel|>", "<|start|>", " to=", "to=")
MAX_HEADER = 512  # characters: a header longer than this is no header


def _held(text: str, markers) -> int:
    """The length of the longest end of text that begins one of the markers: held back."""
    best = 0
    for m in markers:
        for n in range(min(len(text), len(m) - 1), best, -1):
            if m.startswith(text[-n:]):
                best = n
                break
    return best


@dataclass(frozen=True, slots=True)
class HarmonySpec:
    """How a request's samples are read (chat_output.OutputSpec's role); one per request."""
    reads_calls: bool  # the request offers tools: a commentary message to functions.NAME is a call

    def parser(self) -> "HarmonyParser":
        return HarmonyParser(self.reads_calls)


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class HarmonyParser:
    """One sample's reader, OutputParser's interface (chat_output.py): feed(text, final, cut) ->
    Parsed; calls; thought (this feed read the analysis channel); tool_calls()."""

    def __init__(self, reads_calls: bool):
        self.mode, self.buf = "head", ""
        self.reads_calls = reads_calls
        self.channel = self.recipient = None
        self.calls: list[dict] = []
        self.thought = False

    def feed(self, text: str, final: bool = False, cut: bool = False) -> Parsed:
        out = Parsed()
        self.thought = self.mode == "body" and self.channel == "analysis"
        self.buf += text
        while getattr(self, "_" + self.mode)(out, final and not cut):  # cut: what may be markup stays held
            pass
        if final and cut:
            # chat_output's rule: a call whose arguments max_tokens ended midway is no call (one cut
            # only in its <|call|> stands); a header or an end marker begun is no text
            if self.mode == "body" and self.channel == "commentary" and self.recipient and self.reads_calls \
                    and not _whole_json(self.calls[-1]["arguments"]):
                self.calls.pop()
            self.buf = ""
        elif final and self.buf:
            out.content += self.buf
            self.buf = ""
        return out

    def _head(self, out: Parsed, final: bool) -> bool:
        i = self.buf.find("<|message|>")
        if i < 0:
            s = self.buf
            if not final and len(s) <= MAX_HEADER and (not s or any(s.startswith(o) or o.startswith(s)
                                                                  for o in _HEADER_OPENINGS)):
                return False
            self.mode = "plain"  # not harmony's framing (a model without its grammar): content
            return True
        header, self.buf = self.buf[:i], self.buf[i + len("<|message|>"):]
        if header.startswith("<|start|>"):
            header = header[len("<|start|>"):].removeprefix("assistant")
        ch = re.search(r"<\|channel\|>\s*([A-Za-z_]+)", header)
        to = re.search(r"to=([^\s<]+)", header)
        self.channel, self.recipient = (ch.group(1) if ch else None), (to.group(1) if to else None)
        self.mode = "body"
        if self.channel == "commentary" and self.recipient and self.reads_calls:
            name = self.recipient.removeprefix(NAMESPACE + ".")
            call = {"index": len(self.calls), "id": "call_" + secrets.token_hex(12), "name": name, "arguments": ""}
            self.calls.append(call)
            out.piece(call["index"], "", id=call["id"], name=name)
        return True

    def _body(self, out: Parsed, final: bool) -> bool:
        ends = [(self.buf.find(e), e) for e in _ENDS if e in self.buf]
        if ends:
            i, end = min(ends)
            self._give(out, self.buf[:i])
            self.buf = self.buf[i + len(end):]
            self.mode = "head" if end == "<|end|>" else "done"
            return True
        cut = len(self.buf) - (0 if final else _held(self.buf, _ENDS))
        self._give(out, self.buf[:cut])
        self.buf = self.buf[cut:]
        return False

    def _give(self, out: Parsed, text: str) -> None:
        if not text:
            return
        if self.channel == "analysis":
            out.reasoning += text
            self.thought = True
        elif self.channel == "commentary" and self.recipient and self.reads_calls:
            call = self.calls[-1]
            call["arguments"] += text
            out.piece(call["index"], text)
        else:  # final, and commentary to the user (a preamble)
            out.content += text

    def _plain(self, out: Parsed, final: bool) -> bool:
        out.content += self.buf
        self.buf = ""
        return False

    def _done(self, out: Parsed, final: bool) -> bool:
        self.buf = ""  # after <|call|> or <|return|>: the turn is over
        return False

    def tool_calls(self) -> list[dict]:
        return [dict(c) for c in self.calls]
