"""Ollama's API (its docs/api.md) on the `--ollama` listener: /api/chat and
/api/generate, whole or streamed as NDJSON (one JSON object a line, the last
with `done: true` and the counts), /api/embed, /api/tags, /api/ps, /api/show,
/api/version, and /api/pull (from the Hugging Face Hub, daemon/pull.py). The request bodies become the daemon's messages in ollama_api.py;
the daemon calls are turn.py's (a refusal is an HTTP error, not a broken
stream; a client that goes away is aborted). Errors are Ollama's shape,
{"error": message} (app.py)."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import datetime, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..client import RidgeError, merge_pieces
from . import turn
from .generation import SSEResponse, until_disconnect
from .ollama_api import (capabilities, card, chat_request, details, digest, generate_request, listing, model_fields,
                         model_info, parameters)
from .ollama_schemas import ChatRequest, EmbedRequest, GenerateRequest, LegacyEmbedRequest, PullRequest, ShowRequest
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


async def _loaded(request: Request, link, client, kind: str, name: str, model: dict, fields: dict) -> JSONResponse:
    """An empty prompt asks only that the model be loaded, and its keep_alive set (0: unloaded, as
    `ollama stop` asks): one token of prefill through it does both, and its answer is dropped."""
    if not model["entry"]["loaded"] or "keep_alive" in fields:
        one = [0]  # token 0 is in every vocabulary
        aw = link.call("embed", input=[one], **fields) if model.get("kind") == "embed" else \
            client.generate(token_ids=one, max_tokens=1, **fields)
        try:
            await until_disconnect(request, aw)
        except RidgeError as e:
            raise link.failed(e) from None
    body = _piece(kind, name, "")
    body.update(done=True, done_reason="unload" if fields.get("keep_alive") == 0 else "load")
    return JSONResponse(body)


async def _turn(request: Request, kind: str) -> Response:
    started = time.monotonic()
    link, client, _, req = await turn.checked(request, ChatRequest if kind == CHAT else GenerateRequest)
    model = await card(link, req.model)
    gen = chat_request(req, link, model) if kind == CHAT else generate_request(req, link, model)
    name = req.model
    if not (req.messages if kind == CHAT else req.prompt):
        return await _loaded(request, link, client, kind, name, model, model_fields(req, model))
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
async def _fitted(link, model: dict, inputs: list[str], truncate: bool) -> list:
    """Inputs the daemon admits: with truncate, one longer than the context is cut to its first
    max_prompt_tokens tokens. Only inputs that may be too long are tokenized here: a token is at
    least one byte of UTF-8, beside the few special tokens the tokenizer adds. The default's
    tokenizer and limits are the ones the gateway can ask for: another model's inputs go whole."""
    if not truncate or not model["entry"]["default"]:
        return list(inputs)
    limit = link.limits["max_prompt_tokens"]
    out = []
    for text in inputs:
        if len(text.encode()) + 8 <= limit:
            out.append(text)
        else:
            out.append((await link.call("tokenize", text=text))["token_ids"][:limit])
    return out


async def _embedded(request: Request, link, inputs: list, dimensions: int | None, fields: dict) -> dict:
    fields = {"input": inputs, **fields}
    if dimensions is not None:
        fields["dimensions"] = dimensions
    reply = await until_disconnect(request, link.call("embed", **fields))
    turn.ended(reply, "embedding")
    return reply


async def embed(request: Request) -> Response:
    started = time.monotonic()
    link, _, _, req = await turn.checked(request, EmbedRequest)
    model = await card(link, req.model)
    inputs = [req.input] if isinstance(req.input, str) else list(req.input)
    if any(x == "" for x in inputs):
        raise bad("input: an input is an empty string", "input")
    fitted = await _fitted(link, model, inputs, req.truncate is not False)
    reply = await _embedded(request, link, fitted, req.dimensions, model_fields(req, model))
    return JSONResponse({"model": req.model, "embeddings": reply["data"], "total_duration":
                         _ns(time.monotonic() - started), "load_duration": 0,
                         "prompt_eval_count": reply["usage"]["prompt_tokens"]})


async def embeddings(request: Request) -> Response:
    """The older /api/embeddings: one prompt, one `embedding`."""
    link, _, _, req = await turn.checked(request, LegacyEmbedRequest)
    model = await card(link, req.model)
    if not req.prompt:
        return JSONResponse({"embedding": []})
    fitted = await _fitted(link, model, [req.prompt], True)
    reply = await _embedded(request, link, fitted, None, model_fields(req, model))
    return JSONResponse({"embedding": reply["data"][0]})


# -- the models ----------------------------------------------------------------------------------------
def _time(unix: float | None) -> str:
    return datetime.fromtimestamp(unix or 0.0, timezone.utc).isoformat().replace("+00:00", "Z")


def _entry(link, m: dict) -> dict:
    """One of the daemon's models (§3.10) in /api/tags' shape."""
    model = {**(link.model if m["default"] else m.get("model") or {}), "entry": m}
    return {"name": m["name"], "model": m["name"], "modified_at": _time(None), "size": 0,  # not an HTTP client's
            "digest": digest(m), "details": details(model)}


async def tags(request: Request) -> Response:
    link = request.app.state.link
    return JSONResponse({"models": [_entry(link, m) for m in await listing(link)]})


def _expires(m: dict) -> str:
    """When it unloads: the daemon's time; while requests run, their end plus keep_alive is not
    known yet, so a keep_alive from now (Ollama shows one too); a kept model, Ollama's far date."""
    if m["keep_alive"] < 0:
        return _time(FOREVER.timestamp())
    return _time(m["expires_at"] if m["expires_at"] is not None else time.time() + m["keep_alive"])


async def ps(request: Request) -> Response:
    link = request.app.state.link
    running = []
    for m in await listing(link):
        if m["loaded"]:
            entry = _entry(link, m)
            del entry["modified_at"]
            entry.update(size=m["bytes"], size_vram=0 if m.get("device", "cpu") == "cpu" else m["bytes"],
                         expires_at=_expires(m), context_length=m.get("max_model_len"))
            running.append(entry)
    return JSONResponse({"models": running})


async def show(request: Request) -> Response:
    link, _, _, req = await turn.checked(request, ShowRequest)
    model = await card(link, req.model or req.name)
    return JSONResponse({"modelfile": f"FROM {model['name']}\n", "parameters": parameters(model),
                         "template": "", "details": details(model), "model_info": model_info(model),
                         "capabilities": capabilities(model), "modified_at": _time(None)})


async def version(request: Request) -> Response:
    return JSONResponse({"version": API_VERSION})


# -- /api/pull -------------------------------------------------------------------------------------------
PULL_EVERY_S = 0.25  # at most this often a progress line per file, as Ollama's


class _Gone(Exception):
    """The client of a pull went away: the download stops at its next chunk."""


def _pulling(settings, name: str, put, gone: threading.Event) -> None:
    """The pull, in a worker thread (the event loop keeps serving): Ollama's status lines to `put`."""
    from pathlib import Path

    from ..pull import PullError, default_models_dir, plan, pull

    last = [0.0]

    def report(event: str, f, done: int) -> None:
        if gone.is_set():
            raise _Gone()
        now = time.monotonic()
        if event == "bytes" and now - last[0] < PULL_EVERY_S and done < f.size:
            return
        last[0] = now
        key = f.sha256 or f.blob_id or ""
        if event == "verify":
            put({"status": "verifying sha256 digest"})
        elif event != "done":
            put({"status": f"pulling {key[:12]}", "digest": f"sha256:{key}", "total": f.size, "completed": done})

    try:
        put({"status": "pulling manifest"})
        p = plan(name)
        pull(p, Path(settings.models_dir) if settings.models_dir else default_models_dir(), report)
        put({"status": "writing manifest"})
        put({"status": "success"})
    except PullError as e:
        put({"error": str(e)})
    except _Gone:
        pass
    except Exception as e:  # the worker's end must reach the client whatever it is
        put({"error": f"pull failed: {e}"})
    finally:
        put(None)


async def pull_model(request: Request) -> Response:
    """Ollama's /api/pull: the model from the Hugging Face Hub into the daemon's models directory,
    where its registry finds it at the next listing. Only where the listener's `allow_pull` is on:
    every caller who may use the listener may then fill the daemon's disk."""
    settings = request.app.state.settings
    if not settings.allow_pull:  # before the body is read: a refusal needs neither it nor the daemon
        raise ApiError(403, "pulling models is off on this listener: set allow_pull = true in config.toml (or "
                       "RIDGE_ALLOW_PULL=1, or --allow-pull), or run `ridge pull` as the daemon's user",
                       "permission_error", code="pull_not_allowed")
    _, _, _, req = await turn.checked(request, PullRequest)
    name = req.model or req.name
    if not name:
        raise bad("model: the Hub repository to pull, e.g. hf.co/unsloth/Qwen3-8B-GGUF:Q8_0", "model")
    loop, lines = asyncio.get_running_loop(), asyncio.Queue()
    gone = threading.Event()
    threading.Thread(target=_pulling, args=(settings, name, lambda ev: loop.call_soon_threadsafe(lines.put_nowait, ev),
                                            gone), name="ridge-pull", daemon=True).start()
    if req.stream is False:
        last = None
        while (ev := await lines.get()) is not None:
            last = ev
        if "error" in last:
            raise ApiError(400, last["error"], code="pull_failed")
        return JSONResponse(last)

    async def stream():
        try:
            while (ev := await lines.get()) is not None:
                yield _line(ev)
        finally:
            gone.set()  # a client gone before the end stops the download (its files so far stay staged)

    return StreamingResponse(stream(), media_type=NDJSON)


async def root(request: Request) -> Response:
    return Response("Ollama is running", media_type="text/plain")  # what clients probe for


ROUTES = [Route("/", root, methods=["GET", "HEAD"]), Route("/api/version", version),
          Route("/api/chat", chat, methods=["POST"]), Route("/api/generate", generate, methods=["POST"]),
          Route("/api/embed", embed, methods=["POST"]), Route("/api/embeddings", embeddings, methods=["POST"]),
          Route("/api/tags", tags), Route("/api/ps", ps), Route("/api/show", show, methods=["POST"]),
          Route("/api/pull", pull_model, methods=["POST"])]
