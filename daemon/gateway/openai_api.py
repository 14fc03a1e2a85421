"""OpenAI request bodies -> the daemon's `generate` messages (docs/protocol.md
§3.2), and errors in OpenAI's shape.

The gateway checks what it must to build a message (shapes, and the OpenAI
fields ridge does not have); the daemon checks the values (ranges, limits,
the vocabulary) and its error becomes the HTTP error. Fields ridge has no use
for (`user`, `metadata`, `store`, ...) are ignored, as vLLM and llama-server
do; fields that would change the output and that ridge cannot honour are a
400."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context's end
MAX_PROMPTS = 64  # prompts in one /v1/completions request


class ApiError(Exception):
    """An HTTP error with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict:
        h = {}
        if self.retry_after is not None:
            h["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h


# daemon error code -> (HTTP status, OpenAI error type)
_STATUS = {"busy": (429, "rate_limit_error"), "too_many_requests": (429, "rate_limit_error"),
           "shutting_down": (503, "service_unavailable_error"), "unavailable": (503, "service_unavailable_error"),
           "timeout": (503, "service_unavailable_error"), "internal": (500, "server_error"),
           "duplicate_id": (500, "server_error")}


def from_daemon(code: str, message: str, reply: dict | None = None) -> ApiError:
    """A daemon `error` (or the client's own `unavailable`/`timeout`) -> the HTTP error."""
    status, type_ = _STATUS.get(code, (400, "invalid_request_error"))
    param = None
    head = message.split(" ", 1)[0]
    if head.startswith("params.") or head in ("prompt", "messages", "prompt_token_ids"):
        param = head.removeprefix("params.")
    retry = (reply or {}).get("retry_after")
    if status == 503 and retry is None:
        retry = 5.0 if code == "shutting_down" else 1.0
    return ApiError(status, message, type_, param, code, retry)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_request")


# -- reading fields ----------------------------------------------------------------------------
_NUMBER = (int, float)


def _opt(body: dict, key: str, kinds, what: str):
    """body[key] if present and not null; a 400 if it is not of `kinds`."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise bad(f"{key} must be {what}", key)
    if not isinstance(v, kinds):
        raise bad(f"{key} must be {what}", key)
    return v


def _unsupported(body: dict, key: str, neutral) -> None:
    """A field ridge has no counterpart for: fine while it asks for nothing (null or `neutral`)."""
    if body.get(key) not in (None, neutral):
        raise bad(f"{key} is not supported by ridge", key)


@dataclass
class Generation:
    """One OpenAI request, as the daemon `generate`s it takes (one per prompt)."""
    prompts: list[dict]  # each one of {"prompt": str}, {"token_ids": [...]}, {"messages": [...]}: the clients' words
    params: dict  # the daemon's params (§3.2)
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs; else the alternatives to show per token
    n: int = 1


def _sampling(body: dict, max_tokens_default: int | None) -> tuple[dict, int]:
    """The sampling fields both endpoints share -> (daemon params, n)."""
    p: dict = {}
    max_tokens = _opt(body, "max_completion_tokens", int, "an integer")
    if max_tokens is None:
        max_tokens = _opt(body, "max_tokens", int, "an integer")
    if max_tokens is None:
        max_tokens = max_tokens_default
    if max_tokens is not None:
        p["max_tokens"] = max_tokens
    p["temperature"] = _opt(body, "temperature", _NUMBER, "a number")
    if p["temperature"] is None:
        p["temperature"] = 1.0  # OpenAI's default
    for key in ("top_p", "min_p", "repetition_penalty"):
        if (v := _opt(body, key, _NUMBER, "a number")) is not None:
            p[key] = v
    if (top_k := _opt(body, "top_k", int, "an integer")) is not None:
        p["top_k"] = 0 if top_k == -1 else top_k  # vLLM's -1 = off
    if (seed := _opt(body, "seed", int, "an integer")) is not None:
        p["seed"] = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("stop must be a string or an array of strings", "stop")
        p["stop"] = [s for s in stop if s]
    if (ids := _opt(body, "stop_token_ids", list, "an array of token ids")) is not None:
        p["stop_token_ids"] = ids
    if (ignore := _opt(body, "ignore_eos", bool, "a boolean")) is not None:
        p["ignore_eos"] = ignore
    min_tokens = _opt(body, "min_tokens", int, "an integer") or 0
    if min_tokens and not (p.get("ignore_eos") and not p.get("stop") and not p.get("stop_token_ids")):
        raise bad("min_tokens is supported only with ignore_eos and no stop strings or stop_token_ids "
                  "(then every request runs to max_tokens)", "min_tokens")
    n = _opt(body, "n", int, "an integer")
    n = 1 if n is None else n
    best_of = _opt(body, "best_of", int, "an integer")
    if best_of is not None and best_of != n:
        raise bad("best_of is not supported by ridge (only best_of = n)", "best_of")
    for key in ("presence_penalty", "frequency_penalty"):
        _unsupported(body, key, 0)
    _unsupported(body, "logit_bias", {})
    p["n"] = n
    return p, n


def _stream(body: dict) -> tuple[bool, bool]:
    stream = bool(_opt(body, "stream", bool, "a boolean"))
    opts = _opt(body, "stream_options", dict, "an object") or {}
    if opts and not stream:
        raise bad("stream_options needs stream: true", "stream_options")
    return stream, bool(opts.get("include_usage"))


def _response_format(body: dict, params: dict) -> None:
    """OpenAI's response_format (json_schema, json_object) and ridge's (regex, grammar) go to the
    daemon as they are (docs/protocol.md §3.2.1): it checks them and compiles them at admission,
    and its invalid_request comes back as a 400."""
    fmt = _opt(body, "response_format", dict, "an object")
    if fmt and fmt.get("type") not in (None, "text"):
        params["response_format"] = fmt


def cache_salt(body: dict, authorization: str | None, sharing: str | None) -> str | None:
    """The cache_salt sent to the daemon (docs/protocol.md §3.2.2). The gateway is one ipc peer for
    all its clients, so where the daemon keeps users apart (prefix_sharing "user") the API key the
    client sent is folded in: clients with another key, or none, never share its prefixes, and a
    cache_salt cannot name another key's (that needs the key). Else the body's own, as it is."""
    salt = _opt(body, "cache_salt", str, "a string")
    if sharing == "user" and authorization:
        return "key:" + hashlib.sha256(json.dumps([authorization, salt]).encode()).hexdigest()
    return salt or None


# -- /v1/chat/completions ------------------------------------------------------------------------
ROLES = {"developer": "system"}  # OpenAI's newer name for the system message


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: ridge takes text parts only", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"messages[{i}].content must be a string or an array of text parts", "messages")


def chat_messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a role", "messages")
        if m.get("tool_calls") or m.get("function_call"):
            raise bad("tool calls are not supported by ridge", "messages")
        out.append({"role": ROLES.get(m["role"], m["role"]), "content": _content(m, i)})
    return out


def chat_request(body: dict, max_tokens: int) -> Generation:
    messages = chat_messages(body.get("messages"))
    if body.get("tools") and body.get("tool_choice") != "none":
        raise bad("tools are not supported by ridge", "tools")
    params, n = _sampling(body, max_tokens)
    _response_format(body, params)
    stream, usage = _stream(body)
    top = None
    if _opt(body, "logprobs", bool, "a boolean"):
        top = _opt(body, "top_logprobs", int, "an integer") or 0
        params["logprobs"] = max(1, top)  # the daemon's entries carry the chosen token's too
    elif body.get("top_logprobs"):
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return Generation([{"messages": messages}], params, stream, usage, top, n)


# -- /v1/completions -------------------------------------------------------------------------------
def _prompts(raw) -> list[dict]:
    """A string, an array of strings, an array of token ids, or an array of those arrays."""
    if isinstance(raw, str):
        return [{"prompt": raw}]
    if isinstance(raw, list) and raw:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
            return [{"token_ids": raw}]
        if len(raw) <= MAX_PROMPTS:
            if all(isinstance(x, str) for x in raw):
                return [{"prompt": x} for x in raw]
            if all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in raw):
                return [{"token_ids": x} for x in raw]
    raise bad(f"prompt must be a string, an array of token ids, or an array of up to {MAX_PROMPTS} of those",
              "prompt")


def completion_request(body: dict) -> Generation:
    prompts = _prompts(body.get("prompt"))
    if body.get("echo"):
        raise bad("echo is not supported by ridge", "echo")
    if body.get("suffix"):
        raise bad("suffix is not supported by ridge", "suffix")
    params, n = _sampling(body, COMPLETION_DEFAULT_MAX_TOKENS)
    _response_format(body, params)  # not in OpenAI's completions; vLLM and llama-server take it there too
    stream, usage = _stream(body)
    top = _opt(body, "logprobs", int, "an integer")
    if top is not None:
        params["logprobs"] = max(1, top)
    return Generation(prompts, params, stream, usage, top, n)
