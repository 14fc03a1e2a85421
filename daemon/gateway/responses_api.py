"""`POST /v1/responses` (and `GET`/`DELETE /v1/responses/{id}`): OpenAI's
Responses API over the one internal chat request (turn.py). `instructions`
and the input items become the chat the model's template renders; the final
or the deltas become a `response` object or its stream events.

`previous_response_id` continues a stored response: its conversation (the
turns before it, its input and its output, without its instructions, as
OpenAI does) comes first. Responses are kept in the gateway's memory for
`responses_ttl` seconds (store: false keeps none). The follow-up's prompt
starts with the stored turn's prompt, so its KV blocks are a prefix hit
while they are cached: every block the daemon computes is written through to
the host tier at once (docs/architecture.md, "KV tiers"), and is found there
after the device pool has evicted it, until the host tier's own LRU (and then
the disk tier's) drops it. That is what ridge guarantees: the conversation
for the whole ttl, and the prefix as long as the tiers hold it, never a stale
one (a hit compares the tokens). `usage.input_tokens_details.cached_tokens`
says how much of a prompt was a hit."""
from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..client import RidgeError
from . import images, turn
from .generation import SSEResponse, model_fields, served
from .dialects import RESPONSES
from .openai_api import ROLES, ApiError, Generation, bad, ceiling, dialect_params
from .responses_schemas import (FunctionCallItem, FunctionCallOutputItem, InputImage, MessageItem, ReasoningItem,
                                Refusal, ResponsesRequest)

# What the store keeps at most, oldest out first: a bound on the gateway's memory whatever clients
# send. The bytes are the entries' JSON (a conversation stored again with each turn counts each time).
MAX_STORED = 4096
MAX_STORED_BYTES = 64 << 20


# -- the store ------------------------------------------------------------------------------------------
@dataclass
class Stored:
    chat: list[dict]  # the conversation a follow-up continues: earlier turns, the input, the output
    response: dict  # the response object, for GET
    expires: float
    owner: str = ""  # who made it (owner_of): no one else can read, continue or delete it
    size: int = 0


def owner_of(request: Request) -> str:
    """A response's owner: the credential its request carried. Clients of a gateway without a key
    who send none are one owner; a gateway's one API key is one owner for all who hold it."""
    auth = request.headers.get("authorization") or ""
    return hashlib.sha256(auth.encode()).hexdigest() if auth else ""


class ResponseStore:
    """Responses by id for `ttl` seconds after they are made, each its owner's only. One ttl for
    all, so the oldest expires first: expired ones leave from the front, and so do the oldest
    when the store holds more than its count or its bytes."""

    def __init__(self, ttl: float, clock=time.monotonic, max_bytes: int = MAX_STORED_BYTES):
        self.ttl, self.clock, self.max_bytes = ttl, clock, max_bytes
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def put(self, rid: str, chat: list[dict], response: dict, owner: str = "") -> None:
        if self.ttl <= 0:
            return
        self._expire()
        size = len(json.dumps([chat, response], ensure_ascii=False, default=str).encode())
        if size > self.max_bytes:  # would push out everyone else's and still not fit
            return
        self.items[rid] = Stored(chat, response, self.clock() + self.ttl, owner, size)
        self.bytes += size
        while len(self.items) > MAX_STORED or self.bytes > self.max_bytes:
            self._drop_oldest()

    def get(self, rid: str, param: str | None = "previous_response_id", owner: str = "") -> Stored:
        """Another owner's response is as unknown as one never stored: 404, the same words."""
        self._expire()
        if (s := self.items.get(rid)) is None or s.owner != owner:
            raise ApiError(404, f"no response {rid!r}: it was never stored, or was deleted, or is older than "
                           f"responses_ttl ({self.ttl:g} s)", "not_found_error", param, "not_found")
        return s

    def delete(self, rid: str, owner: str = "") -> None:
        self.get(rid, None, owner)
        self.bytes -= self.items.pop(rid).size

    def _drop_oldest(self) -> None:
        self.bytes -= self.items.popitem(last=False)[1].size

    def _expire(self) -> None:
        now = self.clock()
        while self.items and next(iter(self.items.values())).expires <= now:
            self._drop_oldest()


# -- the request ---------------------------------------------------------------------------------------
def _known(value):
    """A request's option as its model read it, echoed without the keys ridge does not know (a
    client's unknown sub-keys are not kept, nor sent back)."""
    if isinstance(value, list):
        return [_known(v) for v in value]
    if hasattr(value, "model_dump"):
        return value.model_dump(by_alias=True, exclude_unset=True)
    return value


def _parts_text(content, where: str = "input") -> str | list[dict]:
    """Text parts joined; with input_image parts, the daemon's array of text and image parts."""
    if isinstance(content, str):
        return content
    return images.joined([_part(p, f"{where}[{j}]") for j, p in enumerate(content)])


def _part(p, where: str) -> dict:
    if not isinstance(p, InputImage):
        return {"type": "text", "text": p.refusal if isinstance(p, Refusal) else p.text}
    if p.image_url is None:
        raise bad(f"{where}: give the image as image_url (a data: URL); ridge keeps no files for file_id", "input")
    return images.from_url(p.image_url, where, "input")


def item_messages(items) -> list[dict]:
    """Input items -> the daemon's chat messages (docs/protocol.md §3.2.3): function calls join the
    assistant message before them, a reasoning item goes to the next assistant message."""
    out: list[dict] = []
    thinking: list[str] = []
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            thinking += [c.text for c in item.content or ()] or [t.text for t in item.summary]
            continue
        if isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _parts_text(item.output)})
            continue
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and not thinking:
                out[-1].setdefault("tool_calls", []).append(call)
                continue
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": ROLES.get(item.role, item.role),
                        "content": _parts_text(item.content, f"input[{i}].content")})
        if thinking and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = "\n".join(thinking)
            thinking = []
    return out


def _format(req: ResponsesRequest, body: dict) -> dict | None:
    """text.format (flat: name and schema beside type) -> chat's response_format."""
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    raw = body["text"]["format"]
    return {"type": "json_schema", "json_schema": {k: raw[k] for k in ("name", "schema", "strict", "description")
                                                   if raw.get(k) is not None}}


def chat_fields(req: ResponsesRequest) -> dict:
    """tools, tool_choice, parallel_tool_calls, reasoning -> the generate's fields beside `messages`."""
    out: dict = {}
    if req.tools:
        out["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True,
                                                                      by_alias=True)} for t in req.tools]
    if req.tool_choice is not None:
        out["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
            {"type": "function", "function": {"name": req.tool_choice.name}}
    if req.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = req.parallel_tool_calls
    if req.reasoning is not None and req.reasoning.effort is not None:  # an effort asks for thinking; none, for none
        effort = req.reasoning.effort
        out["chat_template_kwargs"] = {"enable_thinking": effort != "none", "reasoning_effort": effort}
    return out


def responses_request(req: ResponsesRequest, body: dict, history: list[dict], max_tokens: int | None):
    """-> (the Generation, this turn's input as chat messages)."""
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    new = item_messages(items)
    chat = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history + new
    if not chat:
        raise bad("input must hold at least one item", "input")
    params = dialect_params(RESPONSES, req)
    if req.max_output_tokens is not None:
        max_tokens = ceiling(req.max_output_tokens, max_tokens)
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if (fmt := _format(req, body)) is not None:
        params["response_format"] = fmt
    return Generation([{"messages": chat, **chat_fields(req)}], params, bool(req.stream)), new


# -- the answer ----------------------------------------------------------------------------------------
def usage(u: dict) -> dict:
    p, c = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": u.get("reasoning_tokens", 0)},
            "total_tokens": p + c}


ID_PREFIXES = {turn.THINKING: "rs_", turn.TEXT: "msg_", turn.CALL: "fc_"}


def new_item_id(seg: turn.Segment) -> str:
    return ID_PREFIXES[seg.kind] + uuid.uuid4().hex


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def item(seg: turn.Segment, item_id: str, status: str, whole: bool = True) -> dict:
    """A segment as an output item: whole, or as response.output_item.added opens it."""
    text = seg.text if whole else ""
    if seg.kind == turn.THINKING:
        return {"type": "reasoning", "id": item_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if whole else [], "status": status}
    if seg.kind == turn.TEXT:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [text_part(text)] if whole else []}
    return {"type": "function_call", "id": item_id, "call_id": seg.id, "name": seg.name, "arguments": text,
            "status": status}


def assistant_message(segments: list[turn.Segment]) -> dict:
    """The output as the chat message a follow-up's history holds."""
    texts = [s.text for s in segments if s.kind == turn.TEXT]
    calls = [{"id": s.id, "type": "function", "function": {"name": s.name, "arguments": s.text}}
             for s in segments if s.kind == turn.CALL]
    m: dict = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        m["tool_calls"] = calls
    if thinking := "".join(s.text for s in segments if s.kind == turn.THINKING):
        m["reasoning_content"] = thinking
    return m


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class Answer:
    """The response object of one request, in each of its states, and its keeping."""

    def __init__(self, req: ResponsesRequest, body: dict, gen: Generation, model: str, chat: list[dict]):
        self.id, self.created, self.model = "resp_" + uuid.uuid4().hex, int(time.time()), model
        self.chat, self.store = chat, req.store is not False  # the conversation so far, without instructions
        self.owner = ""  # owner_of its request: set by create
        self.echo = {  # what the request asked, as OpenAI's response object repeats it
            "instructions": req.instructions, "previous_response_id": req.previous_response_id,
            "max_output_tokens": req.max_output_tokens, "temperature": gen.params["temperature"],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": _known(req.tool_choice) or "auto", "tools": _known(req.tools) or [],
            "text": _known(req.text) or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": req.metadata or {}, "store": self.store,
            "reasoning": _known(req.reasoning) or {"effort": None, "summary": None}}

    def object(self, status: str, output: list[dict], use: dict | None = None, error: dict | None = None,
               incomplete: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": use, "error": error,
                "incomplete_details": incomplete, **self.echo}

    def finished(self, store: ResponseStore, f, segments: list[turn.Segment], ids: list[str]) -> dict:
        """The response object of a finished sample, kept for a follow-up unless store: false."""
        status = _status(f.finish_reason)
        output = [item(s, i, status) for s, i in zip(segments, ids)]
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        obj = self.object(status, output, usage(f.usage), incomplete=incomplete)
        if self.store:
            store.put(self.id, self.chat + [assistant_message(segments)], obj, self.owner)
        return obj


# -- routes ----------------------------------------------------------------------------------------------
async def create(request: Request) -> Response:
    link, client, body, req = await turn.checked(request, ResponsesRequest)
    store: ResponseStore = request.app.state.responses
    owner = owner_of(request)
    history = store.get(req.previous_response_id, owner=owner).chat if req.previous_response_id else []
    gen, new = responses_request(req, body, history, link.limits.get("max_tokens"))
    turn.salt(request, link, body, gen)
    gen.params.update(model_fields(body))
    answer = Answer(req, body, gen, served(link, gen.params), history + new)
    answer.owner = owner
    if gen.stream:
        stream, first = await turn.opened(request, link, client, gen)
        return SSEResponse(_events(link, store, answer, stream, first), [stream])
    f = await turn.whole(request, link, client, gen)
    segments = turn.segments_of(f) or [turn.Segment(turn.TEXT, 0)]  # an empty answer: a message
    return JSONResponse(answer.finished(store, f, segments, [new_item_id(s) for s in segments]))


async def retrieve(request: Request) -> Response:
    store: ResponseStore = request.app.state.responses
    return JSONResponse(store.get(request.path_params["response_id"], None, owner_of(request)).response)


async def delete(request: Request) -> Response:
    rid = request.path_params["response_id"]
    request.app.state.responses.delete(rid, owner_of(request))
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


# -- streaming -------------------------------------------------------------------------------------------
class Events:
    """Numbered events (sequence_number, as OpenAI's)."""

    def __init__(self):
        self.seq = 0

    def __call__(self, type_: str, **fields) -> bytes:
        obj = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return turn.named_event(type_, obj)


# per segment kind: the content part it opens (None: none), its delta and done events
_PART = {turn.THINKING: ("reasoning_text", "response.reasoning_text"), turn.TEXT: ("output_text",
                                                                                   "response.output_text")}


def _opening(ev: Events, seg: turn.Segment, item_id: str):
    yield ev("response.output_item.added", output_index=seg.position, item=item(seg, item_id, "in_progress", False))
    if seg.kind in _PART:
        part = text_part("") if seg.kind == turn.TEXT else {"type": "reasoning_text", "text": ""}
        yield ev("response.content_part.added", item_id=item_id, output_index=seg.position, content_index=0,
                 part=part)


def _piece(ev: Events, seg: turn.Segment, item_id: str, piece: str) -> bytes:
    at = {"item_id": item_id, "output_index": seg.position}
    if seg.kind == turn.CALL:
        return ev("response.function_call_arguments.delta", **at, delta=piece)
    extra = {"logprobs": []} if seg.kind == turn.TEXT else {}
    return ev(_PART[seg.kind][1] + ".delta", **at, content_index=0, delta=piece, **extra)


def _closing(ev: Events, seg: turn.Segment, item_id: str, status: str):
    at = {"item_id": item_id, "output_index": seg.position}
    done = item(seg, item_id, status)
    if seg.kind == turn.CALL:
        yield ev("response.function_call_arguments.done", **at, name=seg.name, arguments=seg.text)
    else:
        extra = {"logprobs": []} if seg.kind == turn.TEXT else {}
        yield ev(_PART[seg.kind][1] + ".done", **at, content_index=0, text=seg.text, **extra)
        yield ev("response.content_part.done", **at, content_index=0, part=done["content"][0])
    yield ev("response.output_item.done", output_index=seg.position, item=done)


async def _events(link, store: ResponseStore, answer: Answer, stream, first):
    ev = Events()
    started = answer.object("in_progress", [])
    yield ev("response.created", response=started)
    yield ev("response.in_progress", response=started)
    segments, ids = turn.Segments(), []
    try:
        async for d in turn.deltas(stream, first):
            for seg, opens, piece in segments.feed(d):
                if opens:
                    if seg.position:  # the one before it is done: its status is settled
                        for e in _closing(ev, segments.all[seg.position - 1], ids[-1], "completed"):
                            yield e
                    ids.append(new_item_id(seg))
                    for e in _opening(ev, seg, ids[-1]):
                        yield e
                if piece:
                    yield _piece(ev, seg, ids[-1], piece)
        f = stream.final
        turn.settled(f)
    except (RidgeError, ApiError) as e:
        err = link.failed(e) if isinstance(e, RidgeError) else e
        failed = answer.object("failed", [], error={"code": err.code or err.type, "message": err.message})
        yield ev("response.failed", response=failed)
        return
    if not segments.all:  # an empty answer is still a message
        segments.all.append(turn.Segment(turn.TEXT, 0))
        ids.append(new_item_id(segments.all[0]))
        for e in _opening(ev, segments.all[0], ids[0]):
            yield e
    for e in _closing(ev, segments.all[-1], ids[-1], _status(f.finish_reason)):
        yield e
    obj = answer.finished(store, f, segments.all, ids)
    yield ev("response.completed" if obj["status"] == "completed" else "response.incomplete", response=obj)
