"""The daemon's frames -> OpenAI response objects and streamed chunks, for
chat (`chat.completion`, `chat.completion.chunk`) and completions
(`text_completion`). Plain data in, plain data out.

A request with several prompts (completions) or samples (`n`) has one choice
per (prompt, sample): choice index = prompt * n + sample. Finish reasons pass
through from the daemon: `stop`, `length`, and `abort` for a request the
daemon ended while draining, and `tool_calls` for a sample that called tools.
The daemon splits reasoning and tool calls from the content (docs/protocol.md
§3.2.3); here they take OpenAI's shapes (and vLLM's reasoning_content)."""
from __future__ import annotations

import json
import uuid

CHAT, COMPLETION = "chat", "completion"
DONE = b"data: [DONE]\n\n"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage(prompt: int, completion: int, cached: int, reasoning: int | None = None) -> dict:
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
         "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return u


def sum_usage(finals: list) -> dict:
    """Usage over the daemon finals of one request (one per prompt)."""
    u = [f.usage for f in finals]
    reasoning = [x["reasoning_tokens"] for x in u if "reasoning_tokens" in x]
    return usage(sum(x.get("prompt_tokens", 0) for x in u), sum(x.get("completion_tokens", 0) for x in u),
                 sum(x.get("cached_tokens", 0) for x in u), sum(reasoning) if reasoning else None)


# -- tool calls and reasoning (docs/protocol.md §3.2.3) ------------------------------------------------
def tool_call(call: dict) -> dict:
    """A daemon call {index, id, name, arguments} -> OpenAI's message.tool_calls entry."""
    return {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}


def tool_call_piece(piece: dict) -> dict:
    """A daemon call piece -> OpenAI's delta.tool_calls entry: the first names the call, the rest
    carry its arguments."""
    if "id" in piece:
        return {"index": piece["index"], "id": piece["id"], "type": "function",
                "function": {"name": piece["name"], "arguments": piece["arguments"]}}
    return {"index": piece["index"], "function": {"arguments": piece["arguments"]}}


def _reasoning(into: dict, reasoning: str | None) -> None:
    if reasoning:  # vLLM's two names: reasoning_content, and reasoning, its newer
        into["reasoning_content"] = into["reasoning"] = reasoning


# -- logprobs ------------------------------------------------------------------------------------
def _lp(x: float | None) -> float | None:
    """JSON has no -inf: a token the sampler ruled out gets vLLM's -9999.0."""
    return None if x is None else (x if x > -9999.0 else -9999.0)


def _token(strings: dict, t: int, lp: float | None) -> dict:
    lp = _lp(lp)
    s = strings.get(t, "")
    # A token that is part of a UTF-8 character decodes to U+FFFD alone: its bytes are unknown here.
    return {"token": s, "logprob": lp, "bytes": None if "\ufffd" in s else list(s.encode())}


def chat_logprobs(entries: list, token_ids: list[int], strings: dict, top: int) -> dict:
    """Daemon entries ([logprob, [[id, logprob], ...]] per token) -> chat's {"content": [...]}."""
    content = []
    for t, e in zip(token_ids, entries):
        lp, alts = (e[0], e[1]) if e else (None, [])
        item = _token(strings, t, lp)
        item["top_logprobs"] = [_token(strings, a, alp) for a, alp in alts[:top]]
        content.append(item)
    return {"content": content}


def completion_logprobs(entries: list, token_ids: list[int], strings: dict, top: int, offset: int = 0) -> dict:
    """-> completions' {tokens, token_logprobs, top_logprobs, text_offset}."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, e in zip(token_ids, entries):
        lp, alts = (e[0], e[1]) if e else (None, [])
        s = strings.get(t, "")
        out["tokens"].append(s)
        out["token_logprobs"].append(_lp(lp))
        out["top_logprobs"].append({strings.get(a, ""): _lp(alp) for a, alp in alts[:top]} if top else None)
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def logprob_ids(entries: list, token_ids: list[int], top: int) -> set[int]:
    """The token ids whose text a logprobs block shows."""
    ids = set(token_ids)
    for e in entries:
        if e:
            ids.update(a for a, _ in e[1][:top])
    return ids


# -- whole responses ---------------------------------------------------------------------------------
def choice(kind: str, index: int, text: str, finish_reason: str | None, logprobs: dict | None,
           reasoning: str | None = None, calls: list | None = None) -> dict:
    if kind == CHAT:
        message = {"role": "assistant", "content": text or (None if calls else text)}
        _reasoning(message, reasoning)
        if calls:
            message["tool_calls"] = [tool_call(c) for c in calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def response(kind: str, rid: str, model: str, created: int, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if kind == CHAT else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": use}


# -- streamed chunks ----------------------------------------------------------------------------------
class Chunks:
    """Builds the SSE events of one streamed request."""

    def __init__(self, kind: str, model: str, include_usage: bool):
        self.kind, self.model, self.include_usage = kind, model, include_usage
        self.id, self.created = new_id(kind), 0
        self.object = "chat.completion.chunk" if kind == CHAT else "text_completion"

    def event(self, choices: list[dict], use: dict | None = None) -> bytes:
        obj = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "choices": choices}
        if self.include_usage:
            obj["usage"] = use
        return sse(obj)

    def piece(self, index: int, text: str | None, logprobs: dict | None = None, finish_reason: str | None = None,
              role: bool = False, reasoning: str | None = None, calls: list | None = None) -> dict:
        if self.kind == CHAT:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            if reasoning or calls:
                if not text:
                    delta.pop("content", None)
                _reasoning(delta, reasoning)
                if calls:
                    delta["tool_calls"] = [tool_call_piece(c) for c in calls]
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    def usage_event(self, use: dict) -> bytes:
        return self.event([], use)


def error_event(message: str, type_: str = "server_error", code: str | None = None) -> bytes:
    """What vLLM sends when a stream fails after its 200: an error object, then [DONE]."""
    return sse({"error": {"message": message, "type": type_, "param": None, "code": code}})
