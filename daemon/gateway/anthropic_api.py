"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages
API over the one internal chat request (turn.py): the system prompt and the
messages become the chat the model's template renders, `stop_sequences` the
daemon's stop strings; the final or the deltas become Anthropic's message or
its stream events. Errors on these routes have Anthropic's shape (app.py).

Anthropic counts a prompt's tokens apart by where they came from:
`input_tokens` are those computed, `cache_read_input_tokens` those served from
the prefix cache (ridge writes no cache on request: `cache_creation_input_tokens`
is 0)."""
from __future__ import annotations

import asyncio
import json
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..client import RidgeError
from . import images, turn
from .anthropic_schemas import (CountTokensRequest, ImageBlock, MessagesRequest, Prompted, RedactedThinkingBlock,
                                TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock, UrlSource)
from .generation import SSEResponse, model_fields, served, until_disconnect
from .dialects import ANTHROPIC
from .openai_api import ApiError, Generation, bad, ceiling, dialect_params

KEY_HEADER = "x-api-key"  # where Anthropic's clients send the API key
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

# Anthropic's error types by HTTP status, for ApiErrors raised in OpenAI's words
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(e: ApiError) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "invalid_request_error"),
                                       "message": e.message}}


# -- the request -------------------------------------------------------------------------------------------
def _text(blocks) -> str:
    if isinstance(blocks, str):
        return blocks
    return "\n".join(b.text for b in blocks)


def _assistant(i: int, blocks) -> dict:
    texts, thinking, calls = [], [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ThinkingBlock):
            thinking.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif not isinstance(b, RedactedThinkingBlock):  # opaque by design: nothing to render
            raise bad(f"messages[{i}].content[{j}]: an assistant message holds no {b.type} block", "messages")
    m: dict = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        m["tool_calls"] = calls
    if thinking:
        m["reasoning_content"] = "\n".join(thinking)
    return m


def _image(where: str, b: ImageBlock) -> dict:
    if isinstance(b.source, UrlSource):
        return images.from_url(b.source.url, where)
    return images.from_base64(b.source.data, where, media_type=b.source.media_type)


def _user(i: int, blocks) -> list[dict]:
    """A user turn: its tool results each a `tool` message, its text and images between them user
    messages."""
    out, parts = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            parts.append(_image(f"messages[{i}].content[{j}]", b))
        elif isinstance(b, ToolResultBlock):
            if parts:
                out.append({"role": "user", "content": images.joined(parts)})
                parts = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content or "")})
        else:
            raise bad(f"messages[{i}].content[{j}]: a user message holds no {b.type} block", "messages")
    if parts or not out:
        out.append({"role": "user", "content": images.joined(parts)})
    return out


def _system(i: int, blocks) -> str:
    if isinstance(blocks, str):
        return blocks
    if bad_blocks := [j for j, b in enumerate(blocks) if not isinstance(b, TextBlock)]:
        raise bad(f"messages[{i}].content[{bad_blocks[0]}]: a system message holds only text blocks", "messages")
    return _text(blocks)


def chat_of(req: Prompted) -> list[dict]:
    """The system prompt and the messages -> the daemon's chat messages (docs/protocol.md §3.2.3).
    System messages among the messages (Claude Code sends them) before the first turn join the
    system prompt, since templates take one system message at the head; a later one stands where it
    is, as /v1/chat/completions passes it, for the template to render (or refuse: a 400)."""
    out, head = [], [_text(req.system)] if req.system else []
    for i, m in enumerate(req.messages):
        if m.role == "system":
            text = _system(i, m.content)
            if not out:
                head.append(text)
            else:
                out.append({"role": "system", "content": text})
        elif isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(i, m.content))
        else:
            out.extend(_user(i, m.content))
    if req.messages[-1].role == "assistant":
        raise bad("a last assistant message (a prefill to continue) is not supported by ridge: the chat "
                  "template closes the assistant's turn", "messages")
    if not out:
        raise bad("messages holds only system messages: a turn needs a user message", "messages")
    return ([{"role": "system", "content": "\n\n".join(head)}] if head else []) + out


TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_fields(req: Prompted) -> dict:
    """tools, tool_choice and thinking -> the generate's fields beside `messages` (§3.2.3)."""
    out: dict = {}
    if req.tools:
        out["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                          **({"description": t.description} if t.description else {})}}
                        for t in req.tools]
    if (c := req.tool_choice) is not None:
        if c.type == "tool":
            if not c.name:
                raise bad("tool_choice: type tool needs the tool's name", "tool_choice")
            out["tool_choice"] = {"type": "function", "function": {"name": c.name}}
        else:
            out["tool_choice"] = TOOL_CHOICES[c.type]
        if c.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    kwargs = {}
    if req.thinking is not None and req.thinking.type in ("enabled", "disabled"):  # else: the model's default
        kwargs["enable_thinking"] = req.thinking.type == "enabled"
    if req.output_config is not None and req.output_config.effort is not None:
        kwargs["reasoning_effort"] = req.output_config.effort
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out


def messages_request(req: MessagesRequest, limit: int | None = None) -> Generation:
    """limit: the daemon's limits.max_tokens, up to which max_tokens is a ceiling (openai_api.ceiling)."""
    params = {"max_tokens": ceiling(req.max_tokens, limit), **dialect_params(ANTHROPIC, req)}
    if req.thinking is not None and req.thinking.type == "enabled" and req.thinking.budget_tokens is not None:
        params["max_reasoning_tokens"] = req.thinking.budget_tokens
    if req.output_config is not None and req.output_config.format is not None:
        params["response_format"] = {"type": "json_schema", "json_schema": {"schema": req.output_config.format.schema_}}
    return Generation([{"messages": chat_of(req), **chat_fields(req)}], params, bool(req.stream))


# -- the answer --------------------------------------------------------------------------------------------
def usage(u: dict) -> dict:
    cached = u.get("cached_tokens", 0)
    return {"input_tokens": u.get("prompt_tokens", 0) - cached, "output_tokens": u.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex


def message(mid: str, model: str, content: list[dict], stop_reason: str | None, stop_sequence: str | None,
            use: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": use}


def _input(arguments: str) -> dict:
    """A call's arguments as tool_use's input: an object (a call cut short by max_tokens: {})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def block(seg: turn.Segment, whole: bool = True) -> dict:
    """A segment as a content block: whole, or as content_block_start opens it."""
    if seg.kind == turn.THINKING:
        return {"type": "thinking", "thinking": seg.text if whole else "", "signature": ""}
    if seg.kind == turn.TEXT:
        return {"type": "text", "text": seg.text if whole else ""}
    return {"type": "tool_use", "id": seg.id, "name": seg.name, "input": _input(seg.text) if whole else {}}


DELTAS = {turn.THINKING: ("thinking_delta", "thinking"), turn.TEXT: ("text_delta", "text"),
          turn.CALL: ("input_json_delta", "partial_json")}


async def stop_of(link, gen: Generation, f) -> tuple[str, str | None]:
    """-> (stop_reason, stop_sequence)."""
    hit = await turn.stop_string(link, gen.params.get("stop"), f)
    return ("stop_sequence", hit) if hit is not None else (STOP_REASONS.get(f.finish_reason, "end_turn"), None)


# -- routes ------------------------------------------------------------------------------------------------
async def messages(request: Request) -> Response:
    link, client, body, req = await turn.checked(request, MessagesRequest)
    gen = messages_request(req, link.limits.get("max_tokens"))
    turn.salt(request, link, body, gen, KEY_HEADER)
    gen.params.update(model_fields(body))
    model = served(link, gen.params)
    if gen.stream:
        return await _streamed(request, link, client, gen, model)
    f = await turn.whole(request, link, client, gen)
    reason, seq = await stop_of(link, gen, f)
    content = [block(s) for s in turn.segments_of(f)]
    return JSONResponse(message(new_id(), model, content, reason, seq, usage(f.usage)))


def _counted(prompt: dict) -> dict:
    """A generate's prompt fields -> a tokenize's: what renders the prompt. tokenize takes no images:
    their parts are left out (message_start's count is then the text's alone)."""
    out = {k: v for k, v in prompt.items() if k in ("messages", "tools", "chat_template_kwargs")}
    return {**out, "messages": images.text_only(out["messages"])}


async def count_tokens(request: Request) -> Response:
    link, client, body, req = await turn.checked(request, CountTokensRequest)
    prompt = {"messages": chat_of(req), **chat_fields(req)}
    if images.text_only(prompt["messages"]) != prompt["messages"]:
        raise bad("count_tokens does not count images (their tokens depend on the model's preprocessing); "
                  "count the text without them", "messages")
    reply = await until_disconnect(request, link.call("tokenize", **_counted(prompt)))
    return JSONResponse({"input_tokens": reply["count"]})


# -- streaming ---------------------------------------------------------------------------------------------
async def _streamed(request: Request, link, client, gen: Generation, model: str) -> Response:
    # message_start tells the prompt's size before the daemon's final does: counted beside the prefill
    counting = asyncio.ensure_future(client.call("tokenize", **_counted(gen.prompts[0])))
    try:
        stream, first = await turn.opened(request, link, client, gen)
    except BaseException:
        counting.cancel()
        raise
    try:
        count = (await counting)["count"]
    except RidgeError as e:
        await stream.aclose()
        raise link.failed(e) from None
    return SSEResponse(_events(link, gen, model, stream, first, count), [stream])


async def _events(link, gen: Generation, model: str, stream, first, prompt_tokens: int):
    ev = turn.named_event
    yield ev("message_start", {"type": "message_start", "message": message(
        new_id(), model, [], None, None, {"input_tokens": prompt_tokens, "output_tokens": 0})})
    yield ev("ping", {"type": "ping"})
    segments = turn.Segments()
    try:
        async for d in turn.deltas(stream, first):
            for seg, opens, piece in segments.feed(d):
                if opens:
                    if seg.position:
                        yield ev("content_block_stop", {"type": "content_block_stop", "index": seg.position - 1})
                    yield ev("content_block_start", {"type": "content_block_start", "index": seg.position,
                                                     "content_block": block(seg, whole=False)})
                if piece:
                    kind, key = DELTAS[seg.kind]
                    yield ev("content_block_delta", {"type": "content_block_delta", "index": seg.position,
                                                     "delta": {"type": kind, key: piece}})
        f = stream.final
        turn.settled(f)
        reason, seq = await stop_of(link, gen, f)
    except (RidgeError, ApiError) as e:
        err = link.failed(e) if isinstance(e, RidgeError) else e
        yield ev("error", error_body(err))
        return
    if segments.all:
        yield ev("content_block_stop", {"type": "content_block_stop", "index": len(segments.all) - 1})
    yield ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                               "usage": usage(f.usage)})
    yield ev("message_stop", {"type": "message_stop"})
