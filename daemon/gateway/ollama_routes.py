"""Ollama's API (its docs/api.md) on the `--ollama` listener: /api/chat and
/api/generate, whole or streamed as NDJSON (one JSON object a line, the last
with `done: true` and the counts), /api/embed, /api/tags, /api/ps, /api/show,
/api/version. The request bodies become the daemon's messages in ollama_api.py;
the daemon calls are turn.py's (a refusal is an HTTP error, not a broken
stream; a client that goes away is aborted). Errors are Ollama's shape,
{"error": message} (app.py)."""
from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..client import RidgeError, merge_pieces
from . import turn
from .generation import SSEResponse, until_disconnect
from .ollama_api import (capabilities, chat_request, details, digest, generate_request, keep_alive, model_info,
                         parameters, served)
from .ollama_schemas import ChatRequest, EmbedRequest, GenerateRequest, LegacyEmbedRequest, ShowRequest
from .openai_api import ApiError, bad

API_VERSION = "0.12.6"  # the Ollama release whose API these routes speak: clients gate features on it
NDJSON = "application/x-ndjson"
CHAT, GENERATE = "chat", "generate"
DONE_REASONS = {"tool_calls": "stop"}  # Ollama ends a turn of calls with "stop"
FOREVER = datetime(2318, 1, 1, tzinfo=timezone.utc)  # Ollama's expires_at for a model held forever


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds) -> int:
    return int((seconds or 0.0) * 1e9)


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _calls(calls: list[dict]) -> list[dict]:
    """The daemon's calls (arguments as JSON text) -> Ollama's (arguments as an object)."""
    out = []
    for c in calls:
        try:
            args = json.loads(c["arguments"])
        except ValueError:
            args = {}  # a call cut short by max_tokens
        out.append({"id": c["id"], "function": {"index": c["index"], "name": c["name"],
                                                "arguments": args if isinstance(args, dict) else {}}})
    return out


def _piece(kind: str, model: str, text: str, thinking: str = "", calls: list | None = None) -> dict:
    out: dict = {"model": model, "created_at": _now(), "done": False}
    if kind == CHAT:
        message: dict = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = _calls(calls)
        out["message"] = message
    else:
        out["response"] = text
        if thinking:
            out["thinking"] = thinking
    return out


def _counts(f, started: float) -> dict:
    """The done line's figures, in nanoseconds as Ollama gives them."""
    t, u = f.timings or {}, f.usage or {}
    ttft, e2e = t.get("ttft") or 0.0, t.get("e2e") or 0.0
    return {"done": True, "done_reason": DONE_REASONS.get(f.finish_reason, f.finish_reason),
            "total_duration": _ns(time.monotonic() - started), "load_duration": 0,
            "prompt_eval_count": u.get("prompt_tokens", 0), "prompt_eval_duration": _ns(ttft),
            "eval_count": u.get("completion_tokens", 0), "eval_duration": _ns(max(0.0, e2e - ttft))}


def _loaded(kind: str, model: str) -> JSONResponse:
    """An empty prompt asks only that the model be loaded: it is."""
    body = _piece(kind, model, "")
    body.update(done=True, done_reason="load")
    return JSONResponse(body)


async def _turn(request: Request, kind: str) -> Response:
    started = time.monotonic()
    link, client, _, req = await turn.checked(request, ChatRequest if kind == CHAT else GenerateRequest)
    gen = chat_request(req, link) if kind == CHAT else generate_request(req, link)
    name = req.model
    if not (req.messages if kind == CHAT else req.prompt):
        return _loaded(kind, name)
    if gen.stream:
        stream, first = await turn.opened(request, link, client, gen)
        return SSEResponse(_lines(link, kind, name, stream, first, started), [stream], NDJSON)
    f = await turn.whole(request, link, client, gen)
    body = _piece(kind, name, f.text, f.reasoning, f.tool_calls)
    body.update(_counts(f, started))
    return JSONResponse(body)


async def _lines(link, kind: str, name: str, stream, first, started: float):
    calls: list[dict] = []  # Ollama sends each call whole: the pieces are held until the sample ends
    try:
        async for d in turn.deltas(stream, first):
            if d.tool_calls:
                merge_pieces(calls, d.tool_calls)
            if d.text or d.reasoning:
                yield _line(_piece(kind, name, d.text, d.reasoning))
        f = stream.final
        turn.settled(f)
    except (RidgeError, ApiError) as e:
        yield _line({"error": (link.failed(e) if isinstance(e, RidgeError) else e).message})
        return
    if calls:
        yield _line(_piece(kind, name, "", calls=calls))
    last = _piece(kind, name, "")
    last.update(_counts(f, started))
    yield _line(last)


async def chat(request: Request) -> Response:
    return await _turn(request, CHAT)


async def generate(request: Request) -> Response:
    return await _turn(request, GENERATE)


# -- embeddings ----------------------------------------------------------------------------------------
async def _fitted(link, inputs: list[str], truncate: bool) -> list:
    """Inputs the daemon admits: with truncate, one longer than the context is cut to its first
    max_prompt_tokens tokens. Only inputs that may be too long are tokenized here: a token is at
    least one byte of UTF-8, beside the few special tokens the tokenizer adds."""
    limit = link.limits.get("max_prompt_tokens", link.model["max_model_len"] - 1)
    if not truncate:
        return list(inputs)
    out = []
    for text in inputs:
        if len(text.encode()) + 8 <= limit:
            out.append(text)
        else:
            out.append((await link.call("tokenize", text=text))["token_ids"][:limit])
    return out


async def _embedded(request: Request, link, inputs: list, dimensions: int | None) -> dict:
    fields = {"input": inputs} if dimensions is None else {"input": inputs, "dimensions": dimensions}
    reply = await until_disconnect(request, link.call("embed", **fields))
    if reply["finish_reason"] != "stop":
        raise ApiError(500 if reply["finish_reason"] == "error" else 503,
                       f"the embedding request ended: {reply.get('error') or reply.get('detail') or 'aborted'}",
                       "server_error", code="internal")
    return reply


async def embed(request: Request) -> Response:
    started = time.monotonic()
    link, _, _, req = await turn.checked(request, EmbedRequest)
    served(link, req.model)
    keep_alive(req.keep_alive)
    inputs = [req.input] if isinstance(req.input, str) else list(req.input)
    if any(x == "" for x in inputs):
        raise bad("input: an input is an empty string", "input")
    reply = await _embedded(request, link, await _fitted(link, inputs, req.truncate is not False), req.dimensions)
    return JSONResponse({"model": req.model, "embeddings": reply["data"], "total_duration":
                         _ns(time.monotonic() - started), "load_duration": 0,
                         "prompt_eval_count": reply["usage"]["prompt_tokens"]})


async def embeddings(request: Request) -> Response:
    """The older /api/embeddings: one prompt, one `embedding`."""
    link, _, _, req = await turn.checked(request, LegacyEmbedRequest)
    served(link, req.model)
    keep_alive(req.keep_alive)
    if not req.prompt:
        return JSONResponse({"embedding": []})
    reply = await _embedded(request, link, await _fitted(link, [req.prompt], True), None)
    return JSONResponse({"embedding": reply["data"][0]})


# -- the models ----------------------------------------------------------------------------------------
def _size(model: dict) -> int:
    return int(model.get("bytes") or 0)


def _entry(model: dict, modified: str) -> dict:
    return {"name": model["name"], "model": model["name"], "modified_at": modified, "size": _size(model),
            "digest": digest(model), "details": details(model)}


def _modified(request: Request) -> str:
    return datetime.fromtimestamp(request.app.state.started, timezone.utc).isoformat().replace("+00:00", "Z")


async def tags(request: Request) -> Response:
    link = request.app.state.link
    await link.refresh()
    return JSONResponse({"models": [_entry(link.model, _modified(request))]})


async def ps(request: Request) -> Response:
    link = request.app.state.link
    await link.refresh()
    m = link.model
    entry = _entry(m, _modified(request))
    del entry["modified_at"]
    entry.update(expires_at=FOREVER.isoformat().replace("+00:00", "Z"),
                 size_vram=_size(m) if m.get("device", "cpu") != "cpu" else 0, context_length=m["max_model_len"])
    return JSONResponse({"models": [entry]})


async def show(request: Request) -> Response:
    link, _, _, req = await turn.checked(request, ShowRequest)
    model = served(link, req.model or req.name)
    return JSONResponse({"modelfile": f"FROM {model.get('path', '')}\n", "parameters": parameters(model),
                         "template": "", "details": details(model), "model_info": model_info(model),
                         "capabilities": capabilities(model), "modified_at": _modified(request)})


async def version(request: Request) -> Response:
    return JSONResponse({"version": API_VERSION})


async def root(request: Request) -> Response:
    return Response("Ollama is running", media_type="text/plain")  # what clients probe for


ROUTES = [Route("/", root, methods=["GET", "HEAD"]), Route("/api/version", version),
          Route("/api/chat", chat, methods=["POST"]), Route("/api/generate", generate, methods=["POST"]),
          Route("/api/embed", embed, methods=["POST"]), Route("/api/embeddings", embeddings, methods=["POST"]),
          Route("/api/tags", tags), Route("/api/ps", ps), Route("/api/show", show, methods=["POST"])]
