"""The asyncio client: one DEALER, a reader task that routes frames to
requests by id, and a heartbeat task (docs/protocol.md §4.4).

    async with AsyncClient() as c:
        async for delta in c.stream("Once upon a time", max_tokens=32):
            print(delta.text, end="")

Cancelling the task that iterates a stream, `await stream.aclose()`, or
leaving an `async with client.stream(...) as s:` block early sends `abort`."""
from __future__ import annotations

import asyncio
import itertools
import os
import time

import zmq
import zmq.asyncio

from .client import (VERSION, Completion, Delta, RidgeError, generate_message, make_socket, pack, resolve_endpoint,
                     unpack)


class AsyncClient:
    def __init__(self, endpoint: str | None = None, timeout: float = 30.0, **curve):
        self.endpoint = resolve_endpoint(endpoint)
        self.timeout = timeout
        self.sock = make_socket(zmq.asyncio.Context.instance(), self.endpoint, **curve)
        self.heartbeat_interval = 1.0
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-a{id(self) & 0xffff:x}-"
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self._last_frame = time.monotonic()
        self._closed = False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def _start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._heartbeats())]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in list(self._queues):
            await self._send({"type": "abort", "id": rid})
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close()

    def new_id(self) -> str:
        return self._prefix + str(next(self._ids))

    async def _send(self, msg: dict) -> None:
        await self.sock.send(pack(msg))

    async def _reader(self) -> None:
        # One await per wake-up, then every frame already there through a plain socket on the same
        # connection: a future per frame costs more than the frame (the gateway reads one per token).
        now_or_never = zmq.Socket.shadow(self.sock.underlying)
        while True:
            frame = await self.sock.recv()
            while frame is not None:
                msg = unpack(frame)
                q = self._queues.get(msg.get("id"))
                if q is not None:
                    q.put_nowait(msg)
                try:
                    frame = now_or_never.recv(zmq.NOBLOCK)
                except zmq.Again:
                    frame = None
            self._last_frame = time.monotonic()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            if self._queues:
                await self._send({"type": "heartbeat"})

    async def _next(self, rid: str) -> dict:
        q = self._queues[rid]
        if not q.empty():  # the common case while streaming: no timer
            return q.get_nowait()
        while True:
            try:
                return await asyncio.wait_for(q.get(), self.heartbeat_interval)
            except asyncio.TimeoutError:
                if time.monotonic() - self._last_frame > self.timeout:
                    raise RidgeError("timeout", f"no frame from the daemon at {self.endpoint} in "
                                     f"{self.timeout:.0f} s", rid) from None

    async def call(self, type_: str, **fields) -> dict:
        self._start()
        rid = self.new_id()
        self._queues[rid] = asyncio.Queue()
        try:
            await self._send({"type": type_, "id": rid, **fields})
            reply = await self._next(rid)
        finally:
            self._queues.pop(rid, None)
        if reply["type"] == "error":
            raise RidgeError(reply["code"], reply["message"], rid, reply)
        return reply

    async def hello(self) -> dict:
        reply = await self.call("hello", versions=[VERSION], client="ridge-python-asyncio")
        self.heartbeat_interval = float(reply["heartbeat"]["interval"])
        return reply

    async def health(self) -> dict:
        return await self.call("health")

    async def stats(self) -> dict:
        return await self.call("stats")

    async def tokenize(self, text: str | None = None, messages: list | None = None) -> list[int]:
        fields = {"text": text} if messages is None else {"messages": messages}
        return (await self.call("tokenize", **fields))["token_ids"]

    async def detokenize(self, token_ids: list[int]) -> str:
        return (await self.call("detokenize", token_ids=list(token_ids)))["text"]

    async def abort(self, rid: str) -> None:
        await self._send({"type": "abort", "id": rid})

    def stream(self, prompt: str | None = None, *, messages=None, token_ids=None, request_id: str | None = None,
               **params) -> "AsyncStream":
        rid = request_id or self.new_id()
        msg = generate_message(rid, prompt, messages, token_ids, True, params)
        return AsyncStream(self, rid, msg)

    async def generate(self, prompt: str | None = None, *, messages=None, token_ids=None,
                       request_id: str | None = None, **params) -> Completion:
        self._start()
        rid = request_id or self.new_id()
        self._queues[rid] = asyncio.Queue()
        try:
            await self._send(generate_message(rid, prompt, messages, token_ids, False, params))
            f = await self._next(rid)
        except asyncio.CancelledError:
            await self.abort(rid)
            raise
        finally:
            self._queues.pop(rid, None)
        if f["type"] == "error":
            raise RidgeError(f["code"], f["message"], rid, f)
        return Completion.from_final(f)


class AsyncStream:
    def __init__(self, client: AsyncClient, rid: str, msg: dict):
        self.client, self.id, self._msg = client, rid, msg
        self.final: Completion | None = None
        self.text, self.token_ids = "", []
        self._sent = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        c = self.client
        if not self._sent:
            c._start()
            c._queues[self.id] = asyncio.Queue()
            self._sent = True
            await c._send(self._msg)
        if self.final is not None or self.id not in c._queues:
            raise StopAsyncIteration
        try:
            msg = await c._next(self.id)
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if msg["type"] == "delta":
            d = Delta(self.id, msg["index"], msg["token_ids"], msg["text"], msg.get("logprobs"))
            if d.index == 0:
                self.text += d.text
                self.token_ids += d.token_ids
            return d
        c._queues.pop(self.id, None)
        if msg["type"] == "error":
            raise RidgeError(msg["code"], msg["message"], self.id, msg)
        self.final = Completion.from_final(msg, self.text, self.token_ids)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Abort the request if it is still running."""
        if self.final is None and self.client._queues.pop(self.id, None) is not None:
            await self.client.abort(self.id)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def __del__(self):  # dropped unfinished, outside `async with`: abort, best effort
        c = self.client
        if self._sent and self.final is None and not c._closed and c._queues.pop(self.id, None) is not None:
            try:
                c.sock.send(pack({"type": "abort", "id": self.id}), zmq.NOBLOCK)
            except Exception:
                pass
