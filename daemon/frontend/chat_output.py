"""A sample's output read as the model wrote it (docs/protocol.md §3.2.3): its
thinking, its content and its tool calls, split as the text streams in.

Text goes out as soon as it cannot be the start of a marker (`<tool_c`... is
held until the next piece says), and a call's arguments go out as they are
written: the first piece of a call, once its name is read, carries its id and
name; then its arguments in pieces. The grammar (chat_grammar.py) holds the
model to its format, so the reader trusts the framing; a frame it cannot read
anyway (a text cut by max_tokens, a model without a grammar) falls back to
content, never to a call with a made-up name.

Calls are JSON objects in Hermes', Mistral's and Llama 3's formats (_CallObject);
Qwen3.5's XML parameters and Gemma 4's own syntax (chat_calls.py: XmlCall, GemmaCall) are
read into the same JSON arguments, streamed as valid JSON pieces."""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

from .chat_calls import WS, GemmaCall, XmlCall, _partial
from .chat_format import GEMMA4, HERMES, LLAMA3_JSON, MISTRAL, QWEN3_XML

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters"
# the marker that opens calls in running text
TRIGGERS = {HERMES: "call_open", MISTRAL: "tool_calls", QWEN3_XML: "call_open", GEMMA4: "g_call_open"}
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """How a request's samples are read; one per request, shared by its samples."""
    start: str  # "think", "maybe" or "content" (ChatFormat.reasoning_start)
    tool_format: str | None  # None: no calls to read
    max_calls: int
    markers: dict  # role -> text (chat_format.marker_texts)
    text_params: dict = field(default_factory=dict)  # qwen3_xml: tool name -> its string parameters (text_params)

    def parser(self) -> "OutputParser":
        return OutputParser(self)

    def new_id(self) -> str:
        if self.tool_format == MISTRAL:  # Mistral's templates refuse any id but 9 letters and digits
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class Parsed:
    """What one piece of output text adds: content, thinking, and call pieces."""
    content: str = ""
    reasoning: str = ""
    pieces: list = field(default_factory=list)  # [{index, id?, name?, arguments}]

    def piece(self, index: int, arguments: str, **first) -> None:
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last["index"] == index and not first:
            last["arguments"] += arguments
        else:
            self.pieces.append({"index": index, **first, "arguments": arguments})




class _Value:
    """One JSON value read a character at a time: its text, and where it ends."""
    __slots__ = ("text", "depth", "in_str", "esc", "scalar")

    def __init__(self):
        self.text, self.depth, self.in_str, self.esc, self.scalar = "", 0, False, False, False

    def add(self, c: str) -> bool | None:
        """-> False: c belongs to the value, which goes on; True: c ends it; None: it ended before c
        (a number, true, false or null, ended by what follows)."""
        if self.in_str:
            self.text += c
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                return self.depth == 0
            return False
        if self.scalar and self.depth == 0:
            if c in WS or c in ",}]":
                return None
            self.text += c
            return False
        self.text += c
        if c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return self.depth == 0
        elif self.depth == 0:
            self.scalar = True
        return False


class _CallObject:
    """One {"name": ..., "arguments": ...} object, read a character at a time."""
    __slots__ = ("expect", "value", "role", "key", "name", "args", "args_sent", "done", "bad")

    def __init__(self):
        self.expect = "open"  # open, key, colon, value, comma
        self.value: _Value | None = None
        self.role = self.key = self.name = None
        self.args: _Value | None = None
        self.args_sent = 0  # characters of the arguments already given out
        self.done = self.bad = False

    def add(self, c: str) -> None:
        v = self.value
        if v is not None:
            ended = v.add(c)
            if ended is False:
                return
            self._ended(v)
            if ended:
                return
        if c in WS:
            return
        e = self.expect
        if e == "open" and c == "{":
            self.expect = "key"
        elif e == "key" and c == '"':
            self._begin("key", c)
        elif e in ("key", "comma") and c == "}":
            self.done = True
        elif e == "colon" and c == ":":
            self.expect = "value"
        elif e == "comma" and c == ",":
            self.expect = "key"
        elif e == "value":
            role = "name" if self.key == "name" else "args" if self.key in ARGUMENT_KEYS else "skip"
            self._begin(role, c)
            if role == "args":
                self.args = self.value
        else:
            self.bad = True

    def _begin(self, role: str, c: str) -> None:
        self.role, self.value = role, _Value()
        self.value.add(c)

    def _ended(self, v: _Value) -> None:
        self.value = None
        try:
            decoded = json.loads(v.text) if self.role in ("key", "name") else None
        except ValueError:
            decoded = None
        if self.role == "key":
            self.key, self.expect = decoded, "colon"
        else:
            if self.role == "name":
                self.name = decoded if isinstance(decoded, str) else None
            self.expect = "comma"

    def new_arguments(self) -> str:
        if self.args is None:
            return ""
        text = self.args.text[self.args_sent:]
        self.args_sent = len(self.args.text)
        return text


class OutputParser:
    """One sample's reader. feed(text) -> what that text adds (Parsed); feed(..., final=True) once
    at the end gives out what was held back (cut=True: the end is max_tokens' or the context's, in
    the middle of what was being written). calls: [{index, id, name, arguments}] so far."""

    def __init__(self, spec: OutputSpec):
        self.spec, self.mode, self.buf = spec, spec.start, ""
        self.calls: list[dict] = []
        self.strip = False  # the content's first whitespace is dropped (after </think>, after a call)
        self.ws = ""  # the content's trailing whitespace, held: dropped before a call
        self.text_begun = False  # llama3_json: the answer began as text, so it is no call
        self.phase = ""  # within calls: open, item, object, sep
        self.obj: _CallObject | None = None
        self.raw = ""  # the text of the calls being read, for content if it cannot be read
        self.thought = False  # this feed read thinking (its tokens count as reasoning)

    def feed(self, text: str, final: bool = False, cut: bool = False) -> Parsed:
        out = Parsed()
        self.thought = self.mode == "think"
        self.buf += text
        while getattr(self, "_" + self.mode)(out, final and not cut):  # cut: what may be markup stays held
            pass
        if final:
            self._finish(out, cut)
        return out

    # -- thinking -------------------------------------------------------------------------------
    def _maybe(self, out: Parsed, final: bool) -> bool:
        opener, s = self.spec.markers["think_open"], self.buf.lstrip()
        if s.startswith(opener):
            self.buf, self.mode, self.thought = s[len(opener):], "think", True
            return True
        if opener.startswith(s) and not final:
            return False
        self.mode = "content"
        return True

    def _think(self, out: Parsed, final: bool) -> bool:
        close = self.spec.markers["think_close"]
        i = self.buf.find(close)
        if i >= 0:
            out.reasoning += self.buf[:i]
            self.buf, self.mode, self.strip = self.buf[i + len(close):], "content", True
            return True
        keep = 0 if final else _partial(self.buf, close)
        cut = len(self.buf) - keep
        out.reasoning += self.buf[:cut]
        self.buf = self.buf[cut:]
        return False

    # -- content --------------------------------------------------------------------------------
    def _content(self, out: Parsed, final: bool) -> bool:
        if self.strip:
            self.buf = self.buf.lstrip()
            if not self.buf and not final:
                return False
            self.strip = False
        fmt = self.spec.tool_format if len(self.calls) < self.spec.max_calls else None
        if fmt == LLAMA3_JSON and not self.text_begun:
            return self._llama_start(final)
        trigger = self.spec.markers[TRIGGERS[fmt]] if fmt in TRIGGERS else None
        if trigger is None:
            return self._plain(out, final)
        i = self.buf.find(trigger)
        if i >= 0:
            before = self.ws + self.buf[:i]
            kept = before.rstrip()  # the whitespace before a call is dropped, unless it is no call
            out.content += kept
            self.raw, self.ws, self.buf = before[len(kept):] + trigger, "", self.buf[i + len(trigger):]
            self.text_begun = self.text_begun or bool(kept)
            self.mode, self.phase = "calls", "open"
            return True
        cut = len(self.buf) - (0 if final else _partial(self.buf, trigger))
        self._text(out, self.buf[:cut])
        self.buf = self.buf[cut:]
        return False

    def _llama_start(self, final: bool) -> bool:
        """Llama 3's call is the whole answer: it opens with "{" or <|python_tag|>."""
        tag, s = self.spec.markers["python_tag"], self.buf.lstrip()
        if s.startswith("{") or s.startswith(tag):
            self.raw = self.buf[:len(self.buf) - len(s)] + (tag if s.startswith(tag) else "")
            self.buf = s[len(tag):] if s.startswith(tag) else s
            self.mode, self.phase = "calls", "item"
            return True
        if (not s or tag.startswith(s)) and not final:
            return False
        self.text_begun = True
        return True

    def _text(self, out: Parsed, text: str) -> None:
        """Content, its trailing whitespace held until more text shows it is not the last."""
        text = self.ws + text
        kept = text.rstrip()
        self.ws = text[len(kept):]
        out.content += kept
        if kept:
            self.text_begun = True

    # -- calls ----------------------------------------------------------------------------------
    def _calls(self, out: Parsed, final: bool) -> bool:
        """Between the objects of calls: hermes' blocks end in </tool_call>, mistral's array
        separates by commas, llama3_json's calls by semicolons."""
        if self.phase == "object":
            return self._object(out)
        if self.spec.tool_format in (QWEN3_XML, GEMMA4):
            return self._block(out, final)
        s = self.buf.lstrip()
        self.raw += self.buf[:len(self.buf) - len(s)]
        self.buf = s
        if not s:
            return False
        fmt, c = self.spec.tool_format, s[0]
        if self.phase == "sep":
            if fmt == HERMES:
                close = self.spec.markers["call_close"]
                if s.startswith(close):
                    self.buf, self.mode, self.strip = s[len(close):], "content", True
                    return True
                return False if close.startswith(s) and not final else self._unreadable(out)
            if (fmt, c) in ((MISTRAL, ","), (LLAMA3_JSON, ";")):
                return self._step(c, "item")
            if fmt == MISTRAL and c != "]":
                return self._unreadable(out)
            self.buf = s[1:] if fmt == MISTRAL else s  # the calls are over; what follows is content
            self.mode, self.strip, self.text_begun = "content", True, True
            return True
        if self.phase == "open" and fmt == MISTRAL:
            return self._step(c, "item") if c == "[" else self._unreadable(out)
        if c != "{":
            return self._unreadable(out)
        self.obj, self.phase = _CallObject(), "object"
        return True

    def _block(self, out: Parsed, final: bool) -> bool:
        """A Qwen3.5 or Gemma 4 call after its open marker, up to its close marker: read by its reader
        (chat_text.py) into JSON arguments as they come."""
        if self.phase == "open":
            fmt = self.spec.tool_format
            self.obj = XmlCall(self.spec.text_params) if fmt == QWEN3_XML else GemmaCall(self.spec.markers["g_quote"])
            self.phase = "block"
        obj, close = self.obj, self.spec.markers["g_call_close" if self.spec.tool_format == GEMMA4 else "call_close"]
        if obj is not None:
            n = obj.feed(self.buf, final)
            self.raw += self.buf[:n]
            self.buf = self.buf[n:]
            self._give(out, obj)
            if obj.bad or (obj.done and obj.name is None):
                return self._unreadable(out)
            if not obj.done:
                return False
            self.phase, self.obj, self.raw = "close", None, ""  # the call is whole: only its close marker is left
        s = self.buf.lstrip()
        if s.startswith(close):
            self.buf, self.mode, self.strip, self.phase = s[len(close):], "content", True, ""
            return True
        if close.startswith(s) and not final:
            return False
        return self._unreadable(out)

    def _step(self, c: str, phase: str) -> bool:
        self.raw += c
        self.buf, self.phase = self.buf[1:], phase
        return True

    def _object(self, out: Parsed) -> bool:
        obj, n = self.obj, 0
        for c in self.buf:
            n += 1
            obj.add(c)
            if obj.done or obj.bad:
                break
        self.raw += self.buf[:n]
        self.buf = self.buf[n:]
        self._give(out, obj)
        if obj.bad or (obj.done and obj.name is None):
            return self._unreadable(out)
        if obj.done:
            self.phase, self.obj, self.raw = "sep", None, ""
            return True
        return False

    def _give(self, out: Parsed, obj: _CallObject) -> None:
        """The call's pieces: its first once its name is read, then its arguments as they come."""
        if obj.name is None:
            return
        if not self.calls or self.calls[-1]["_obj"] is not obj:
            call = {"index": len(self.calls), "id": self.spec.new_id(), "name": obj.name, "arguments": "", "_obj": obj}
            self.calls.append(call)
            out.piece(call["index"], "", id=call["id"], name=call["name"])
        call = self.calls[-1]
        if args := obj.new_arguments():
            call["arguments"] += args
            out.piece(call["index"], args)

    def _unreadable(self, out: Parsed) -> bool:
        """Calls framed otherwise than the format says: what was not given out as a call is content."""
        started = self.calls and self.obj is not None and self.calls[-1]["_obj"] is self.obj
        if not started:
            self._text(out, self.raw)
        self.raw, self.obj, self.mode, self.text_begun = "", None, "plain", True
        return True

    def _plain(self, out: Parsed, final: bool) -> bool:
        """No more calls to read: the rest is content."""
        self._text(out, self.buf)
        self.buf = ""
        return False

    def _finish(self, out: Parsed, cut: bool) -> None:
        started = self.mode == "calls" and self.obj is not None and self.calls and self.calls[-1]["_obj"] is self.obj
        if cut:
            # max_tokens ended the output midway through a marker or a call: what was held back (a
            # marker's start, `<tool_c`, `</think`; a call's unread framing) is no answer's text, and
            # a call's cut arguments are no call's (a prefix would run the tool with half its input).
            # The calls finished before it stand; the finish reason, length, says one was cut.
            if started:
                self.calls.pop()
            self.buf, self.raw, self.obj, self.mode = "", "", None, "plain"
        elif self.mode == "calls":
            # The end came otherwise (a stop string): a call cut short stays a call; what never got
            # a name is content, as it was written.
            if not started and not (self.calls and self.phase in ("item", "sep", "close")):
                self._text(out, self.raw + self.buf)
            self.buf, self.mode = "", "plain"
        elif self.buf:
            self._text(out, self.buf)
            self.buf = ""
        if not self.calls:
            out.content += self.ws
        self.ws = ""

    def tool_calls(self) -> list[dict]:
        return [{k: v for k, v in c.items() if k != "_obj"} for c in self.calls]
