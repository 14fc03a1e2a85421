"""A Python client for the ridge daemon (docs/protocol.md): synchronous here,
asyncio in daemon/aio_client.py. No torch: it imports only zmq and msgpack.

    from ridge.daemon.client import Client
    with Client() as c:
        for delta in c.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=64):
            print(delta.text, end="", flush=True)
"""
from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass, field

import msgpack
import zmq

from ridge.request import GENERATE

from .transport.endpoint import find_daemon, ipc_path, probe

VERSION = 5  # docs/protocol.md; 2: tool calls and reasoning (§3.2.3); 3: embed (§3.9); 4: rerank (§3.11);
#             5: images as frames (§3.2.5)
# Frames the socket holds unread, as many as the daemon's send high-water mark: past them the daemon
# sees a slow reader and merges its deltas (docs/protocol.md §4.4) instead of this process buffering
# without bound. What a reader has not taken yet is merged per request here too (Inbox).
RCVHWM = 1000


class RidgeError(Exception):
    def __init__(self, code: str, message: str, request_id: str | None = None, reply: dict | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id, self.reply = code, message, request_id, reply or {}


class DaemonUnavailable(RidgeError):
    def __init__(self, message: str):
        super().__init__("unavailable", message)


@dataclass
class Delta:
    id: str
    index: int
    token_ids: list[int]
    text: str  # the content
    logprobs: list | None = None
    reasoning: str = ""  # thinking text (version 2, §3.2.3)
    tool_calls: list[dict] | None = None  # call pieces: {index, id, name, arguments} first, then {index, arguments}

    @classmethod
    def from_frame(cls, rid: str, msg: dict) -> "Delta":
        return cls(rid, msg["index"], msg["token_ids"], msg["text"], msg.get("logprobs"), msg.get("reasoning", ""),
                   msg.get("tool_calls"))


def merge_pieces(held: list, new: list) -> None:
    """Append call pieces to held ones, each call's consecutive pieces joined: its first piece keeps
    the id and name, and its arguments grow."""
    for p in new:
        last = held[-1] if held else None
        if last is not None and last["index"] == p["index"] and "id" not in p:
            last["arguments"] += p["arguments"]
        else:
            held.append(dict(p))


class Joined:
    """Sample 0's streamed output, joined, for the Completion that the final makes."""
    __slots__ = ("text", "token_ids", "reasoning", "tool_calls")

    def __init__(self):
        self.text, self.token_ids, self.reasoning, self.tool_calls = "", [], "", []

    def add(self, d: Delta) -> None:
        if d.index == 0:
            self.text += d.text
            self.token_ids += d.token_ids
            self.reasoning += d.reasoning
            merge_pieces(self.tool_calls, d.tool_calls or ())


@dataclass
class Completion:
    """A request's `final` frame, with the streamed pieces joined when the client streamed."""
    id: str
    finish_reason: str
    usage: dict
    timings: dict
    choices: list[dict]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    detail: str | None = None
    logprobs: list | None = None
    reasoning: str = ""  # sample 0's (version 2); each choice has its own when not streamed
    tool_calls: list[dict] = field(default_factory=list)  # sample 0's calls: {index, id, name, arguments}

    @classmethod
    def from_final(cls, f: dict, joined: Joined | None = None) -> "Completion":
        """joined: what a stream's deltas gave (a non-streaming final carries sample 0's output)."""
        j = joined or Joined()
        first = (f.get("choices") or [{}])[0]
        return cls(f["id"], f["finish_reason"], f.get("usage", {}), f.get("timings", {}), f.get("choices", []),
                   f.get("text", j.text), f.get("token_ids", j.token_ids), f.get("error"), f.get("detail"),
                   f.get("logprobs"), first.get("reasoning", j.reasoning), first.get("tool_calls", j.tool_calls))


class Inbox:
    """One request's frames that its reader has not taken yet. Consecutive deltas of a sample are
    merged into one (text joined, token ids and logprobs appended), as the daemon merges them for a
    slow reader (daemon/frontend/streams.py): a request nobody reads holds one delta per sample and its end,
    never a backlog of frames."""
    __slots__ = ("deltas", "texts", "end", "since", "sent", "waiter", "stuck", "loading")

    def __init__(self):
        self.deltas: dict[int, dict] = {}  # sample index -> its pending delta
        self.texts: dict[int, list[str]] = {}  # text merged into a pending delta, joined when taken
        self.end: dict | None = None  # the terminal frame: final, error, or a reply
        self.since: float | None = None  # when the oldest frame not yet taken arrived
        self.sent = time.monotonic()  # when the request went out: silence is counted from here too
        self.waiter = None  # aio_client: the future its reader waits on
        self.stuck = False  # aio_client: aborted because nobody took its frames for client_timeout
        self.loading: dict | None = None  # the latest `loading` event: its model is being loaded (§3.10)

    def put(self, msg: dict, now: float) -> None:
        if msg["type"] == "loading":  # progress, not output: the request's frames follow once it loaded
            self.loading = msg
            return
        if self.since is None:
            self.since = now
        if msg["type"] != "delta":
            self.end = self.end or msg
            return
        i, ids, text = msg["index"], msg["token_ids"], msg["text"]
        if not (isinstance(i, int) and isinstance(ids, list) and isinstance(text, str)):
            raise ValueError(f"a delta whose index, token_ids or text has the wrong type: {msg!r:.200}")
        held = self.deltas.get(i)
        if held is None:
            self.deltas[i] = msg
            return
        held["token_ids"] += ids
        if "logprobs" in msg:
            held.setdefault("logprobs", []).extend(msg["logprobs"])
        if "reasoning" in msg:
            held["reasoning"] = held.get("reasoning", "") + msg["reasoning"]
        if "tool_calls" in msg:
            merge_pieces(held.setdefault("tool_calls", []), msg["tool_calls"])
        self.texts.setdefault(i, []).append(text)

    def take(self) -> dict | None:
        """The next frame: a sample's merged delta, then (once none is pending) the end."""
        if self.deltas:
            i = next(iter(self.deltas))
            msg = self.deltas.pop(i)
            if self.texts and (more := self.texts.pop(i, None)):
                msg["text"] = msg["text"] + "".join(more)
        else:
            msg, self.end = self.end, None
        self.since = time.monotonic() if self.deltas or self.end else None
        return msg

    def held_bytes(self) -> int:
        """What the pending frames hold, counted as Python objects."""
        return _size([self.deltas, self.texts, self.end])


def _size(obj) -> int:
    n = sys.getsizeof(obj)
    if isinstance(obj, dict):
        return n + sum(_size(k) + _size(v) for k, v in obj.items())
    if isinstance(obj, list):
        return n + sum(_size(x) for x in obj)
    return n


def pack(msg: dict) -> bytes:
    return msgpack.packb({"v": VERSION, **msg}, use_bin_type=True)


def unpack(frame: bytes) -> dict:
    return msgpack.unpackb(frame, raw=False)


def resolve_endpoint(endpoint: str | None = None, environ=os.environ) -> str:
    """The endpoint to use, or DaemonUnavailable saying where it looked."""
    if endpoint is not None:
        path = ipc_path(endpoint)
        if path is not None and (state := probe(path)) != "alive":
            raise DaemonUnavailable(f"no ridge daemon is listening on {endpoint} ({state})")
        return endpoint
    found, notes = find_daemon(environ)
    if found is None:
        denied = any(n.endswith("permission denied") for n in notes)
        hint = "; to use the system daemon, join group ridge" if denied else ""
        raise DaemonUnavailable(f"no ridge daemon is running (looked at {'; '.join(notes)}{hint})")
    return found


# The generate fields beside params, as the request declares them (ridge/request.GENERATE).
BESIDE_PARAMS = tuple(k for k in GENERATE if k != "stream")


def message_frames(msg: dict) -> list[bytes]:
    """A message as the frames it travels in: its map, then a generate's image bytes, each a frame
    of its own (docs/protocol.md §3.2.5), the map saying how many follow."""
    images = msg.get("images")
    if not isinstance(images, (list, tuple)):
        return [pack(msg)]
    if not all(isinstance(x, (bytes, bytearray, memoryview)) for x in images):
        raise TypeError("images: give each image's encoded bytes (PNG, JPEG, WebP, GIF or BMP)")
    return [pack({**msg, "images": len(images)}), *(bytes(x) for x in images)]


def generate_message(rid: str, prompt=None, messages=None, token_ids=None, stream=True, params=None) -> dict:
    given = [x is not None for x in (prompt, messages, token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, messages or token_ids")
    m = {"type": "generate", "id": rid, "stream": stream}
    if prompt is not None:
        m["prompt"] = prompt
    elif messages is not None:
        m["messages"] = list(messages)
    else:
        m["prompt_token_ids"] = list(token_ids)
    params = dict(params or {})
    for key in BESIDE_PARAMS:  # fields of the message, not sampling parameters (§3.2.2, §3.2.3)
        if (value := params.pop(key, None)) is not None:
            m[key] = value
    if params:
        m["params"] = {k: v for k, v in params.items() if v is not None}
    return m


def make_socket(ctx, endpoint: str, curve_server_key: bytes | None = None, curve_keyfile: str | None = None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 500)  # let a last abort out on close
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    if curve_server_key is not None:  # TCP with CURVE: our certificate, and the daemon's public key
        from zmq.auth import load_certificate
        public, secret = load_certificate(curve_keyfile)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, curve_server_key
    sock.connect(endpoint)
    return sock


class Client:
    """One DEALER connection; any number of requests multiplexed on it by id."""

    def __init__(self, endpoint: str | None = None, timeout: float = 30.0, **curve):
        self.endpoint = resolve_endpoint(endpoint)
        self.timeout = timeout  # seconds of silence from the daemon before giving up
        self.sock = make_socket(zmq.Context.instance(), self.endpoint, **curve)
        self.heartbeat_interval = 1.0
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-{id(self) & 0xffff:x}-"
        self._inbox: dict[str, Inbox] = {}  # frames for requests in flight, read while waiting for others
        self._last_send = time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for rid in list(self._inbox):
            self._send({"type": "abort", "id": rid})
        self._inbox.clear()
        self.sock.close()

    # -- frames ----------------------------------------------------------------------
    def new_id(self) -> str:
        return self._prefix + str(next(self._ids))

    def _send(self, msg: dict) -> None:
        self.sock.send_multipart(message_frames(msg))
        self._last_send = time.monotonic()

    def _next_for(self, rid: str, timeout: float | None = None) -> dict:
        """The next frame for request `rid`, keeping the others' frames and our heartbeats going."""
        box = self._inbox.setdefault(rid, Inbox())
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while (msg := box.take()) is None:
            now = time.monotonic()
            if now >= deadline:
                raise RidgeError("timeout", f"no reply from the daemon at {self.endpoint} in {timeout:.0f} s", rid)
            if now - self._last_send >= self.heartbeat_interval:
                self._send({"type": "heartbeat"})
            if self.sock.poll(int(1000 * min(deadline - now, self.heartbeat_interval)) + 1):
                frame = unpack(self.sock.recv())
                deadline = time.monotonic() + timeout  # any frame (heartbeats too) shows the daemon alive
                mid = frame.get("id")
                if mid in self._inbox:
                    self._inbox[mid].put(frame, time.monotonic())
        return msg

    def call(self, type_: str, **fields) -> dict:
        rid = self.new_id()
        self._send({"type": type_, "id": rid, **fields})
        try:
            reply = self._next_for(rid)
        finally:
            self._inbox.pop(rid, None)
        if reply["type"] == "error":
            raise RidgeError(reply["code"], reply["message"], rid, reply)
        return reply

    # -- operations --------------------------------------------------------------------
    def hello(self) -> dict:
        reply = self.call("hello", versions=[VERSION], client="ridge-python")
        self.heartbeat_interval = float(reply["heartbeat"]["interval"])
        return reply

    def health(self) -> dict:
        return self.call("health")

    def stats(self) -> dict:
        return self.call("stats")

    def tokenize(self, text: str | None = None, messages: list | None = None) -> list[int]:
        fields = {"text": text} if messages is None else {"messages": messages}
        return self.call("tokenize", **fields)["token_ids"]

    def detokenize(self, token_ids: list[int]) -> str:
        return self.call("detokenize", token_ids=list(token_ids))["text"]

    def embed(self, inputs: list, dimensions: int | None = None, **fields) -> dict:
        """An embedding model's vectors (docs/protocol.md §3.9): inputs are strings or token id
        lists; fields: model, keep_alive (§3.10); -> the reply: finish_reason, data (one unit vector
        per input), usage."""
        fields = {"input": list(inputs), **{k: v for k, v in fields.items() if v is not None}}
        if dimensions is not None:
            fields["dimensions"] = dimensions
        return self.call("embed", **fields)

    def rerank(self, query: str, documents: list[str], top_n: int | None = None, **fields) -> dict:
        """A reranker's judgement of each document against the query (docs/protocol.md §3.11);
        fields: instruction, model, keep_alive; -> the reply: finish_reason, results (index and
        relevance_score, the best first), usage."""
        fields = {"query": query, "documents": list(documents), **{k: v for k, v in fields.items() if v is not None}}
        if top_n is not None:
            fields["top_n"] = top_n
        return self.call("rerank", **fields)

    def models(self) -> dict:
        """The models the daemon can serve, loaded or not (docs/protocol.md §3.10)."""
        return self.call("models")

    def abort(self, rid: str) -> None:
        self._send({"type": "abort", "id": rid})

    def stream(self, prompt: str | None = None, *, messages=None, token_ids=None, request_id: str | None = None,
               **params) -> "Stream":
        """Deltas as they come; the Completion is `.final` once the iterator ends. Closing the
        stream early (or leaving its `with` block) aborts the request."""
        rid = request_id or self.new_id()
        self._inbox[rid] = Inbox()
        self._send(generate_message(rid, prompt, messages, token_ids, True, params))
        return Stream(self, rid)

    def generate(self, prompt: str | None = None, *, messages=None, token_ids=None, request_id: str | None = None,
                 **params) -> Completion:
        rid = request_id or self.new_id()
        self._inbox[rid] = Inbox()
        self._send(generate_message(rid, prompt, messages, token_ids, False, params))
        try:
            f = self._next_for(rid)
        finally:
            self._inbox.pop(rid, None)
        if f["type"] == "error":
            raise RidgeError(f["code"], f["message"], rid, f)
        return Completion.from_final(f)


class JoinedStream:
    """A stream's sample 0 so far: its text (the content), token ids, reasoning and calls."""
    joined: Joined

    @property
    def text(self) -> str:
        return self.joined.text

    @property
    def token_ids(self) -> list[int]:
        return self.joined.token_ids


class Stream(JoinedStream):
    def __init__(self, client: Client, rid: str):
        self.client, self.id = client, rid
        self.final: Completion | None = None
        self.joined = Joined()

    def __iter__(self):
        return self

    def __next__(self) -> Delta:
        if self.final is not None or self.id not in self.client._inbox:
            raise StopIteration
        msg = self.client._next_for(self.id)
        if msg["type"] == "delta":
            d = Delta.from_frame(self.id, msg)
            self.joined.add(d)
            return d
        self.client._inbox.pop(self.id, None)
        if msg["type"] == "error":
            raise RidgeError(msg["code"], msg["message"], self.id, msg)
        self.final = Completion.from_final(msg, self.joined)
        raise StopIteration

    def close(self) -> None:
        """Abort the request if it is still running."""
        if self.final is None and self.client._inbox.pop(self.id, None) is not None:
            self.client.abort(self.id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
