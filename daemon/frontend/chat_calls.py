"""The call formats that are not JSON, read into the JSON arguments every route gives out
(docs/protocol.md §3.2.3): Qwen3.5's (and Qwen3-Coder's) XML parameters (XmlCall) and Gemma 4's
call:NAME{key:value} syntax (GemmaCall), each a character at a time, its arguments streamed as
valid JSON pieces; and the text helpers chat_output.py's reader shares with them."""
from __future__ import annotations

import json
import string

WS = " \t\r\n"


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker (0 if none): held back."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _refuse(constant: str):
    raise ValueError(constant)


def _as_json(text: str) -> str:
    """text as JSON when it is JSON (NaN and Infinity are not), else as a JSON string of itself."""
    try:
        return json.dumps(json.loads(text, parse_constant=_refuse), ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)


def text_params(tools) -> dict:
    """tool name -> the names of its parameters whose values Qwen3.5's calls write as raw text: those
    whose schema's type is string (alone, or beside null), or whose enum or const holds only strings.
    The others are written as JSON (the template's tojson)."""
    def is_text(p) -> bool:
        if not isinstance(p, dict):
            return False
        t = p.get("type")
        if t is not None:
            return t == "string" or (isinstance(t, list) and "string" in t and set(t) <= {"string", "null"})
        values = p["enum"] if isinstance(p.get("enum"), list) else [p["const"]] if "const" in p else None
        return bool(values) and all(isinstance(v, str) for v in values)

    return {t.name: frozenset(k for k, p in (t.parameters.get("properties") or {}).items() if is_text(p))
            for t in tools}


class _Converted:
    """A call read into JSON arguments (args) that are given out as they grow."""
    __slots__ = ()

    def new_arguments(self) -> str:
        text = self.args[self.args_sent:]
        self.args_sent = len(self.args)
        return text


class XmlCall(_Converted):
    """One Qwen3.5 / Qwen3-Coder call after <tool_call>: <function=NAME>, then each argument as
    <parameter=KEY>\nVALUE\n</parameter>, then </function>; read into the JSON object
    {"KEY": VALUE, ...} as it comes. A string parameter's VALUE is its text, given out as it is
    written; any other's is JSON, given out once whole (its text, as a string, when it is not JSON)."""
    __slots__ = ("text_params", "state", "name", "key", "value", "args", "args_sent", "count", "done", "bad")
    END = "\n</parameter>"

    def __init__(self, text_params: dict):
        self.text_params, self.state = text_params, "head"
        self.name = self.key = None
        self.value = self.args = ""
        self.args_sent = self.count = 0
        self.done = self.bad = False

    def feed(self, buf: str, final: bool) -> int:
        """Reads what it can of buf -> how many characters it took (the rest: wait for more)."""
        i = 0
        while not (self.done or self.bad):
            n = getattr(self, "_" + self.state)(buf[i:], final)
            if n is None:
                return i
            i += n
        return i

    def _skip(self, s: str) -> int:
        return len(s) - len(s.lstrip())

    def _tag(self, s: str, opener: str, final: bool):
        """<opener NAME> at s -> (its length, NAME); None: more text is needed; bad: not one."""
        if not s.startswith(opener):
            self.bad = not (opener.startswith(s) and not final)
            return None
        j = s.find(">")
        if j < 0:
            self.bad = final or "\n" in s or "<" in s[1:]
            return None
        return j + 1, s[len(opener):j]

    def _head(self, s: str, final: bool):
        w = self._skip(s)
        got = self._tag(s[w:], "<function=", final)
        if got is None:
            return None
        self.name, self.state, self.args = got[1], "params", "{"
        return w + got[0]

    def _params(self, s: str, final: bool):
        w = self._skip(s)
        t = s[w:]
        if t.startswith("</function>"):
            self.args += "}"
            self.done = True
            return w + len("</function>")
        if "</function>".startswith(t) and t and not final:
            return None
        got = self._tag(t, "<parameter=", final)
        if got is None:
            return None
        n, self.key = got
        if n == len(t) and not final:
            return None  # the newline after the tag, if one comes, is no part of the value
        n += t[n:n + 1] == "\n"
        self.args += (", " if self.count else "") + json.dumps(self.key, ensure_ascii=False) + ": "
        self.count += 1
        if self._is_text():
            self.args += '"'
        self.state, self.value = "value", ""
        return w + n

    def _is_text(self) -> bool:
        return self.key in self.text_params.get(self.name, ())

    def _value(self, s: str, final: bool):
        j = s.find(self.END)
        taken = s[:j] if j >= 0 else s[:len(s) - (0 if final else _partial(s, self.END))]
        if self._is_text():
            self.args += json.dumps(taken, ensure_ascii=False)[1:-1]
        else:
            self.value += taken
        if j < 0:
            return len(taken) or None
        if self._is_text():
            self.args += '"'
        else:
            self.args += _as_json(self.value)
        self.state = "params"
        return j + len(self.END)


class GemmaCall(_Converted):
    """One Gemma 4 call after <|tool_call>: call:NAME{key:value,...}, its strings between <|"|>
    markers and written raw, its keys bare, numbers, true, false, null, objects and arrays as in
    JSON; read into JSON arguments as they come. A bare value that is not JSON is its text."""
    __slots__ = ("quote", "name", "stack", "expect", "in_str", "args", "args_sent", "done", "bad")
    NAME = frozenset(string.ascii_letters + string.digits + "_.-")

    def __init__(self, quote: str):
        self.quote, self.name, self.stack = quote, None, []
        self.expect = "head"  # head, key, value, sep
        self.in_str = False
        self.args, self.args_sent = "", 0
        self.done = self.bad = False

    def feed(self, buf: str, final: bool) -> int:
        i = 0
        while i < len(buf) and not (self.done or self.bad):
            n = self._step(buf[i:], final)
            if n is None:
                break
            i += n
        return i

    def _step(self, s: str, final: bool):
        q = self.quote
        if self.in_str:
            if s.startswith(q):
                self.args += '"'
                self.in_str, self.expect = False, "sep"
                return len(q)
            if q.startswith(s) and not final:
                return None
            j = s.find(q[0], 1)
            text = s if j < 0 else s[:j]
            self.args += json.dumps(text, ensure_ascii=False)[1:-1]
            return len(text)
        if self.expect == "head":
            if not s.startswith("call:"):
                self.bad = not ("call:".startswith(s) and not final)
                return None
            j = s.find("{")
            name = s[5:] if j < 0 else s[5:j]
            if set(name) - self.NAME or (j < 0 and final) or j == 5:
                self.bad = True
            if j < 0 or self.bad:
                return None
            self.name, self.stack, self.expect, self.args = name, ["}"], "key", "{"
            return j + 1
        c = s[0]
        if c in WS:
            return 1
        if self.expect == "key":
            if c == "}" and self.args.endswith("{"):
                return self._close(c)
            j = s.find(":")
            if j < 0:
                self.bad = final or len(s) > 256
                return None
            key = s[:j]
            if key.startswith(q) and key.endswith(q) and len(key) >= 2 * len(q):
                key = key[len(q):-len(q)]
            elif set(key) - self.NAME or not key:
                self.bad = True
                return None
            self.args += json.dumps(key, ensure_ascii=False) + ": "
            self.expect = "value"
            return j + 1
        if self.expect == "value":
            if s.startswith(q):
                self.args += '"'
                self.in_str = True
                return len(q)
            if q.startswith(s) and not final:
                return None
            if c in "{[":
                self.stack.append("}" if c == "{" else "]")
                self.args += c
                self.expect = "key" if c == "{" else "value"
                return 1
            if c == "]" and self.args.endswith("["):
                return self._close(c)
            n = next((k for k, ch in enumerate(s) if ch in WS or ch in ",}]" or ch == q[0]), None)
            if n is None and not final:
                return None
            bare = s if n is None else s[:n]
            if not bare:
                self.bad = True
                return None
            self.args += _as_json(bare)
            self.expect = "sep"
            return len(bare)
        if c == ",":
            self.args += ", "
            self.expect = "key" if self.stack[-1] == "}" else "value"
            return 1
        if c == self.stack[-1]:
            return self._close(c)
        self.bad = True
        return None

    def _close(self, c: str) -> int:
        if c != self.stack.pop():
            self.bad = True
            return 1
        self.args += c
        self.expect = "sep"
        self.done = not self.stack
        return 1
