"""One chat request to the daemon for the APIs that answer with one sample
(`/v1/messages`, `/v1/responses`): the same `generate` with `messages` that
/v1/chat/completions sends (openai_api.Generation), whole or streamed, with
generation.py's rules (a refusal is an HTTP error, not a broken stream; a
client that goes away is aborted). Each API turns the final or the deltas
into its own shapes."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..client import RidgeError
from .generation import DEFAULT_BODY_LIMIT, read_json, until_disconnect
from .images import attach
from .openai_api import ApiError, Generation, cache_salt, parsed


async def checked(request, model):
    """-> (link, client, the body, the body as `model`): the daemon is reached first, so that the
    body's limit is the daemon's frame size."""
    link = request.app.state.link
    client = await link.connect()
    body = await read_json(request, 2 * link.limits.get("max_frame_bytes", DEFAULT_BODY_LIMIT // 2))
    return link, client, body, parsed(model, body)


def salt(request, link, body: dict, gen: Generation, key_header: str | None = None) -> None:
    """The cache_salt (openai_api.cache_salt). key_header: where else the API key may come
    (Anthropic's clients send `x-api-key`); the same key shares the same prefixes either way."""
    authorization = request.headers.get("authorization")
    if authorization is None and key_header and (key := request.headers.get(key_header)):
        authorization = f"Bearer {key}"
    if s := cache_salt(body, authorization, link.hello.get("prefix_sharing"), getattr(request.app.state, "keyed", False)):
        gen.params["cache_salt"] = s


def settled(f) -> None:
    """A final the API cannot answer as a finished sample is an error."""
    if f.finish_reason == "error":
        raise ApiError(500, f"the engine failed: {f.error}", "server_error", code="internal")
    if f.finish_reason == "abort":
        raise ApiError(503, f"the daemon ended the request ({f.detail or 'aborted'})", "service_unavailable_error",
                       code="shutting_down" if f.detail == "shutdown" else "aborted", retry_after=1.0)


def ended(reply: dict, what: str) -> dict:
    """An embed's or rerank's reply (docs/protocol.md §3.9, §3.11), settled: anything but `stop` is
    an error (an abort by the daemon, a 503: it is draining)."""
    if reply["finish_reason"] != "stop":
        raise ApiError(500 if reply["finish_reason"] == "error" else 503,
                       f"the {what} request ended: {reply.get('error') or reply.get('detail') or 'aborted'}",
                       "server_error", code="internal")
    return reply


async def whole(request, link, client, gen: Generation):
    """The request's final (daemon/client.Completion), settled."""
    await attach(request, gen)
    try:
        f = await until_disconnect(request, client.generate(**gen.prompts[0], **gen.params))
    except RidgeError as e:
        raise link.failed(e) from None
    settled(f)
    return f


async def opened(request, link, client, gen: Generation):
    """-> (the stream, its first delta or None): started before the HTTP status is sent."""
    await attach(request, gen)
    stream = client.stream(**gen.prompts[0], **gen.params)
    try:
        first = await until_disconnect(request, anext(stream, None))
    except RidgeError as e:
        await stream.aclose()
        raise link.failed(e) from None
    return stream, first


async def deltas(stream, first):
    if first is not None:
        yield first
        async for d in stream:
            yield d


async def stop_string(link, stops: list[str], f) -> str | None:
    """The stop string that ended a sample whose finish_reason is `stop` (None: the end of sequence
    or a stop token). The daemon cuts the text before the first match, and the tokens still hold
    it: they are decoded once, for requests that have stop strings."""
    if not stops or f.finish_reason != "stop" or not f.token_ids:
        return None
    full = (await link.call("detokenize", token_ids=f.token_ids))["text"]
    found = [(i, s) for s in stops if (i := full.find(s)) >= 0]
    return min(found)[1] if found else None


def named_event(name: str, obj: dict) -> bytes:
    """A server-sent event with its type named (Anthropic's and the Responses API's streams)."""
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n".encode()


# -- a sample's output as segments -------------------------------------------------------------------------
THINKING, TEXT, CALL = "thinking", "text", "call"


@dataclass
class Segment:
    """One part of a sample's output, in order: its thinking, its text, or one tool call (whose
    `text` is the arguments' JSON text). Anthropic's content blocks and the Responses API's output
    items are one per segment."""
    kind: str
    position: int  # among the sample's segments
    text: str = ""
    id: str | None = None  # a call's
    name: str | None = None  # a call's


class Segments:
    """A sample's deltas -> its segments, opened and grown as the pieces come (docs/protocol.md
    §3.2.3: thinking, then text, then calls, each call's first piece naming it)."""

    def __init__(self):
        self.all: list[Segment] = []
        self._key = None

    def feed(self, d) -> list[tuple[Segment, bool, str]]:
        """-> (segment, whether it opens here, the piece) for each piece of the delta."""
        out = []
        for kind, piece in _pieces(d):
            key = (kind, piece["index"]) if kind == CALL else kind
            opens = key != self._key
            if opens:
                self._key = key
                self.all.append(Segment(kind, len(self.all), id=piece.get("id") if kind == CALL else None,
                                        name=piece.get("name") if kind == CALL else None))
            text = piece["arguments"] if kind == CALL else piece
            self.all[-1].text += text
            out.append((self.all[-1], opens, text))
        return out


def _pieces(d):
    if d.reasoning:
        yield THINKING, d.reasoning
    if d.text:
        yield TEXT, d.text
    for call in d.tool_calls or ():
        yield CALL, call


def segments_of(f) -> list[Segment]:
    """A whole sample's segments, from its final (daemon/client.Completion, sample 0)."""
    out = []
    if f.reasoning:
        out.append(Segment(THINKING, 0, f.reasoning))
    if f.text:
        out.append(Segment(TEXT, len(out), f.text))
    for c in f.tool_calls:
        out.append(Segment(CALL, len(out), c["arguments"], c["id"], c["name"]))
    return out
