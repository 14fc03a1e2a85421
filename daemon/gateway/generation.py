"""`POST /v1/chat/completions` and `POST /v1/completions`: one daemon
`generate` per prompt, whole or streamed as server-sent events.

A request's fate is settled before its HTTP status is: a streamed one waits
for each prompt's first frame, so that a refusal (400, 429 busy, 503
draining) is an HTTP error and not a broken stream. A client that goes away
has its daemon requests aborted, whether it is still waiting (the wait races
the disconnect) or already streaming (the response's end aborts whatever is
left), so their KV blocks are freed at once. One that stays connected but stops
reading holds one merged delta per sample, and its requests are aborted once it
has taken nothing for the daemon's client_timeout (daemon/aio_client.py)."""
from __future__ import annotations

import asyncio
import json
import re
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..client import RidgeError
from . import responses as R
from .images import attach
from .openai_api import ApiError, Generation, bad, cache_salt, chat_request, completion_request

DEFAULT_BODY_LIMIT = 2 << 20


class ClientGone(Exception):
    """The HTTP client disconnected before its response began."""


async def read_json(request: Request, limit: int) -> dict:
    size, parts = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        parts.append(chunk)
    too_deep = bad(f"the body nests deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(raw := b"".join(parts), parse_int=_int)
    except ValueError as e:
        raise bad(f"the body is not JSON: {e}") from None
    except RecursionError:
        raise too_deep from None
    if _depth(body) > MAX_DEPTH:  # msgpack refuses to pack past 511 levels; no client means this
        raise too_deep
    if _SURROGATE.search(raw) and not _encodes(body):  # checked only where the bytes may hold one
        raise bad("the body holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair), which is no "
                  "character")
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


MAX_DEPTH = 100  # arrays and objects within each other
INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what msgpack carries to the daemon


# a surrogate escaped (\udXXX) or as CESU-8 bytes, both of which json.loads lets through
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _encodes(body) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def _int(literal: str) -> int:
    value = int(literal)
    if not INT_RANGE[0] <= value <= INT_RANGE[1]:
        raise ValueError(f"the integer {literal[:40]} is outside [-2^63, 2^64)")
    return value


def _depth(value) -> int:
    """How deeply value's arrays and objects nest (walked without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        todo.extend((x, d + 1) for x in v)
    return deepest


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, aw):
    """Await `aw`, unless the client disconnects first: then cancel it (which aborts its daemon
    requests: daemon/aio_client.py) and raise ClientGone."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise ClientGone()
    return work.result()


async def _all_or_none(coros: list):
    """Run them together; if one fails, cancel (abort) the rest and raise its error."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def model_fields(body: dict) -> dict:
    """The request's model, which the daemon loads if it must (docs/protocol.md §3.10), and
    keep_alive, an extension (Ollama's) that OpenAI's clients send through extra_body."""
    out = {}
    if isinstance(body.get("model"), str) and body["model"]:
        out["model"] = body["model"]
    if isinstance(body.get("keep_alive"), (int, float, str)) and not isinstance(body["keep_alive"], bool):
        out["keep_alive"] = body["keep_alive"]
    return out


def served(link, fields: dict) -> str:
    """The model's name in an answer: the one the request named, else the default's."""
    return fields.get("model") or link.model["name"]


LOADING_PEEK_S = 0.25  # how long a stream's first frame may take before the gateway looks for a model load
LOADING_EVERY_S = 1.0  # an SSE comment this often while it loads


async def generate(request: Request, kind: str) -> Response:
    link = request.app.state.link
    client = await link.connect()
    body = await read_json(request, 2 * link.limits.get("max_frame_bytes", DEFAULT_BODY_LIMIT // 2))
    limit = link.limits.get("max_tokens")
    gen = chat_request(body, limit) if kind == R.CHAT else completion_request(body, limit)
    await attach(request, gen)
    if salt := cache_salt(body, request.headers.get("authorization"), link.hello.get("prefix_sharing"),
                       getattr(request.app.state, "keyed", False)):
        gen.params["cache_salt"] = salt
    gen.params.update(model_fields(body))
    if gen.stream:
        return await _streamed(request, link, client, kind, gen)
    try:
        finals = await until_disconnect(request, _all_or_none(
            [client.generate(**p, **gen.params) for p in gen.prompts]))
    except RidgeError as e:
        raise link.failed(e) from None
    choices = []
    for pi, f in enumerate(finals):
        for ch in f.choices:
            if ch["finish_reason"] == "error":
                raise ApiError(500, f"the engine failed: {ch.get('error')}", "server_error", code="internal")
            lp = None
            if gen.top_logprobs is not None:
                lp = await _logprobs(link, kind, gen.top_logprobs, ch.get("logprobs") or [], ch["token_ids"])
            choices.append(R.choice(kind, pi * gen.n + ch["index"], ch["text"], ch["finish_reason"], lp,
                                    ch.get("reasoning"), ch.get("tool_calls")))
    out = R.response(kind, R.new_id(kind), served(link, gen.params), int(time.time()), choices, R.sum_usage(finals))
    return JSONResponse(out)


async def _logprobs(link, kind: str, top: int, entries: list, token_ids: list[int], offset: int = 0) -> dict:
    strings = await link.token_text(R.logprob_ids(entries, token_ids, top))
    if kind == R.CHAT:
        return R.chat_logprobs(entries, token_ids, strings, top)
    return R.completion_logprobs(entries, token_ids, strings, top, offset)


# -- streaming ------------------------------------------------------------------------------------
async def _next_delta(stream):
    """A stream's next delta, or None when it has ended (its final is then set)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _streamed(request: Request, link, client, kind: str, gen: Generation) -> Response:
    streams = [client.stream(**p, **gen.params) for p in gen.prompts]
    first = asyncio.ensure_future(until_disconnect(request, _all_or_none([_next_delta(s) for s in streams])))
    chunks = R.Chunks(kind, served(link, gen.params), gen.include_usage)
    while not (await asyncio.wait({first}, timeout=LOADING_PEEK_S))[0]:
        if any(client.loading(s.id) for s in streams):  # its model loads: the 200 now, then progress
            chunks.created = int(time.time())
            return SSEResponse(_loading(link, kind, gen, chunks, streams, client, first), streams)
    try:
        firsts = first.result()
    except RidgeError as e:
        for s in streams:
            await s.aclose()
        raise link.failed(e) from None
    chunks.created = int(time.time())
    return SSEResponse(_events(link, kind, gen, chunks, streams, firsts), streams)


async def _loading(link, kind: str, gen: Generation, chunks: R.Chunks, streams: list, client, first):
    """SSE comments (which clients skip) while the request's model loads (docs/protocol.md §3.10),
    then the stream; an error past the 200 is an error event, as mid-stream."""
    while not first.done():
        ev = next((e for s in streams if (e := client.loading(s.id))), None)
        if ev is not None:
            yield f": loading {ev['model']}: {ev['stage']} {ev['elapsed']:.1f} s\n\n".encode()
        await asyncio.wait({first}, timeout=LOADING_EVERY_S)
    try:
        firsts = first.result()
    except RidgeError as e:
        err = link.failed(e)
        yield R.error_event(err.message, err.type, err.code)
        yield R.DONE
        return
    async for event in _events(link, kind, gen, chunks, streams, firsts):
        yield event


class SSEResponse(StreamingResponse):
    """Server-sent events; however the response ends (done, or the client gone), the daemon
    requests still running are aborted."""

    def __init__(self, content, streams: list, media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            for s in self.streams:
                await s.aclose()


async def _merged(streams: list, firsts: list):
    """(prompt index, delta) from every stream, as they come. At most one delta per stream is taken
    ahead of the HTTP client; the rest wait merged in the stream's inbox, so that a client that stops
    reading holds no backlog, and is aborted past client_timeout (daemon/aio_client.py)."""
    if len(streams) == 1:
        if firsts[0] is not None:
            yield 0, firsts[0]
            async for d in streams[0]:
                yield 0, d
        return
    ahead: dict[asyncio.Future, int] = {}
    try:
        for i, first in enumerate(firsts):
            if first is not None:
                yield i, first
                ahead[asyncio.ensure_future(_next_delta(streams[i]))] = i
        while ahead:
            done, _ = await asyncio.wait(ahead, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                i = ahead.pop(t)
                if (d := t.result()) is not None:  # a RidgeError is raised to the consumer here
                    yield i, d
                    ahead[asyncio.ensure_future(_next_delta(streams[i]))] = i
    finally:
        for t in ahead:
            t.cancel()


async def _events(link, kind: str, gen: Generation, chunks: R.Chunks, streams: list, firsts: list):
    n = gen.n
    if kind == R.CHAT:
        yield chunks.event([chunks.piece(i, None, role=True) for i in range(len(streams) * n)])
    offsets: dict[int, int] = {}
    try:
        async for pi, d in _merged(streams, firsts):
            index = pi * n + d.index
            lp = None
            if gen.top_logprobs is not None and d.logprobs:
                lp = await _logprobs(link, kind, gen.top_logprobs, d.logprobs, d.token_ids, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(d.text)
            yield chunks.event([chunks.piece(index, d.text, lp, reasoning=d.reasoning, calls=d.tool_calls)])
    except (RidgeError, ApiError) as e:
        err = link.failed(e) if isinstance(e, RidgeError) else e
        yield R.error_event(err.message, err.type, err.code)
        yield R.DONE
        return
    finals = [s.final for s in streams]
    pieces, failed = [], None
    for pi, f in enumerate(finals):
        for ch in f.choices:
            pieces.append(chunks.piece(pi * n + ch["index"], None, finish_reason=ch["finish_reason"]))
            failed = failed or ch.get("error")
    if failed:
        yield R.error_event(f"the engine failed: {failed}", "server_error", "internal")
    yield chunks.event(pieces)
    if gen.include_usage:
        yield chunks.usage_event(R.sum_usage(finals))
    yield R.DONE
