"""The asyncio client: one DEALER, a reader task that routes frames to
requests by id, and a heartbeat task (docs/protocol.md §4.4).

    async with AsyncClient() as c:
        async for delta in c.stream("Once upon a time", max_tokens=32):
            print(delta.text, end="")

Cancelling the task that iterates a stream, `await stream.aclose()`, or
leaving an `async with client.stream(...) as s:` block early sends `abort`.

The reader reads every frame at once, so the daemon never sees this client
as slow: what a request's consumer has not taken yet is merged per sample
here (client.Inbox), and a request whose frames nobody takes for the daemon's
`client_timeout` is aborted, the rule the daemon applies to a ZeroMQ client
that stops reading, applied to whoever reads through this one (an HTTP
client of the gateway)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

import zmq
import zmq.asyncio

from .client import (VERSION, Completion, Delta, Inbox, Joined, JoinedStream, RidgeError, generate_message,
                     make_socket, message_frames, pack, resolve_endpoint, unpack)

log = logging.getLogger("ridge.client")
READ_SLICE_S = 0.01  # the most the reader routes frames before it lets the loop's other tasks run


class AsyncClient:
    def __init__(self, endpoint: str | None = None, timeout: float = 30.0, **curve):
        self.endpoint = resolve_endpoint(endpoint)
        self.timeout = timeout  # seconds of silence from the daemon, while a request waits, before giving up
        self.sock = make_socket(zmq.asyncio.Context.instance(), self.endpoint, **curve)
        self.heartbeat_interval = 1.0
        self.client_timeout: float | None = None  # from hello: a request not read for this long is aborted
        self._rearm = asyncio.Event()  # hello changed heartbeat_interval: the heartbeats' wait starts over
        self.failure: RidgeError | None = None  # why the reader stopped: every request then fails with it
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-a{id(self) & 0xffff:x}-"
        self._inboxes: dict[str, Inbox] = {}
        self._tasks: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None  # the one that owns the socket, from the first request
        self._background: set[asyncio.Task] = set()  # aborts of streams dropped unfinished
        self._last_frame = time.monotonic()
        self._closed = False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def _open(self, rid: str) -> None:
        """A request's inbox, just before the request is sent."""
        if self.failure is not None:
            raise RidgeError(self.failure.code, self.failure.message, rid)
        if not self._tasks:
            self.loop = asyncio.get_running_loop()
            self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._heartbeats())]
        self._inboxes[rid] = Inbox()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in list(self._inboxes) if self.failure is None else ():
            await self._send({"type": "abort", "id": rid})
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        self.sock.close()

    def new_id(self) -> str:
        return self._prefix + str(next(self._ids))

    async def _send(self, msg: dict) -> None:
        await self.sock.send_multipart(message_frames(msg))

    # -- reading ---------------------------------------------------------------------
    async def _reader(self) -> None:
        # One await per wake-up, then the frames already there through a plain socket on the same
        # connection: a future per frame costs more than the frame (the gateway reads one per token).
        # The loop is handed back after READ_SLICE_S of them: a daemon that sends faster than this
        # client routes would otherwise keep it here, and its heartbeats unsent until the daemon
        # times it out (§4.4).
        now_or_never = zmq.Socket.shadow(self.sock.underlying)
        try:
            while True:
                frame = await self.sock.recv()
                now = time.monotonic()
                while frame is not None:
                    self._route(frame, now)
                    if time.monotonic() - now > READ_SLICE_S:
                        break
                    try:
                        frame = now_or_never.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        frame = None
                self._last_frame = now
                if frame is not None:
                    await asyncio.sleep(0)
        except BaseException as e:  # cancelled by aclose, or the socket failed under it
            if not self._closed:
                why = f"the connection to the daemon at {self.endpoint} failed: {type(e).__name__}: {e}"
                log.error("the client's reader stopped: %s", why, exc_info=not isinstance(e, asyncio.CancelledError))
                self._fail(why)
            if isinstance(e, asyncio.CancelledError):
                raise

    def _route(self, frame: bytes, now: float) -> None:
        """One frame to its request's inbox. A bad one is dropped and the reader goes on; if it names a
        request, that request ends with an error (and is aborted), since its output is now incomplete."""
        try:
            msg = unpack(frame)
            rid = msg.get("id")
            box = self._inboxes.get(rid)
        except Exception as e:
            log.warning("dropped a frame from the daemon that is not a message (%s: %s): %r", type(e).__name__, e,
                        frame[:80])
            return
        if box is None:
            return
        try:
            box.put(msg, now)
        except Exception as e:
            log.warning("dropped a malformed frame from the daemon for request %s (%s: %s)", rid, type(e).__name__, e)
            box.put({"type": "error", "id": rid, "code": "internal",
                     "message": f"the daemon sent a malformed frame for this request: {type(e).__name__}: {e}"}, now)
            self._in_background(self.abort(rid))
        if box.waiter is not None and not box.waiter.done():
            box.waiter.set_result(None)

    def _fail(self, message: str) -> None:
        self.failure = RidgeError("unavailable", message)
        for box in self._inboxes.values():
            if box.waiter is not None and not box.waiter.done():
                box.waiter.set_result(None)

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _next(self, rid: str) -> dict:
        box = self._inboxes[rid]
        while True:
            msg = box.take()
            if msg is not None:  # the common case while streaming: no timer
                return msg
            if self.failure is not None:
                raise RidgeError(self.failure.code, self.failure.message, rid)
            box.waiter = self.loop.create_future()
            try:
                await asyncio.wait_for(box.waiter, self.heartbeat_interval)
            except asyncio.TimeoutError:
                # Silence counts from the request's send too: an idle client's last frame is old.
                if time.monotonic() - max(self._last_frame, box.sent) > self.timeout:
                    raise RidgeError("timeout", f"no frame from the daemon at {self.endpoint} in "
                                     f"{self.timeout:.0f} s", rid) from None
            finally:
                box.waiter = None

    # -- liveness, and requests nobody reads --------------------------------------------
    async def _heartbeats(self) -> None:
        while True:
            # A wait begun before hello's reply used the default interval, which may be longer than
            # the daemon's client_timeout: the reply cuts it short (hello sets _rearm).
            try:
                await asyncio.wait_for(self._rearm.wait(), self.heartbeat_interval)
            except asyncio.TimeoutError:
                pass
            self._rearm.clear()
            if self._inboxes:
                await self._send({"type": "heartbeat"})
                await self._abort_stuck(time.monotonic())

    async def _abort_stuck(self, now: float) -> None:
        """Abort each running request whose oldest frame has waited for its reader past client_timeout
        (docs/protocol.md §4.4): its merged output stays for a reader that comes back."""
        limit = self.client_timeout
        if limit is None:
            return
        for rid, box in list(self._inboxes.items()):
            if box.end is None and not box.stuck and box.since is not None and now - box.since > limit:
                box.stuck = True
                log.info("request %s was not read for %.1f s: aborted", rid, now - box.since)
                await self._send({"type": "abort", "id": rid})

    def _abort_dropped(self, rid: str) -> None:
        """From a finalizer, on any thread: the abort is sent from the loop that owns the socket."""
        loop = self.loop
        if loop is None or self._closed:
            return
        try:
            loop.call_soon_threadsafe(self._send_abort_of_dropped, rid)
        except RuntimeError:  # the loop is closed: the daemon sees the connection go instead
            pass

    def _send_abort_of_dropped(self, rid: str) -> None:
        if self._inboxes.pop(rid, None) is not None and not self._closed:
            self._in_background(self.abort(rid))

    def held_bytes(self) -> int:
        """What the frames not yet taken by their readers hold, over every request."""
        return sum(box.held_bytes() for box in self._inboxes.values())

    # -- operations --------------------------------------------------------------------
    async def call(self, type_: str, **fields) -> dict:
        rid = self.new_id()
        self._open(rid)
        try:
            await self._send({"type": type_, "id": rid, **fields})
            reply = await self._next(rid)
        finally:
            self._inboxes.pop(rid, None)
        if reply["type"] == "error":
            raise RidgeError(reply["code"], reply["message"], rid, reply)
        return reply

    async def hello(self, principal: str | None = None) -> dict:
        """principal: whom this connection speaks for, for a gateway run as the daemon's own user."""
        extra = {"principal": principal} if principal is not None else {}
        reply = await self.call("hello", versions=[VERSION], client="ridge-python-asyncio", **extra)
        self.heartbeat_interval = float(reply["heartbeat"]["interval"])
        self.client_timeout = float(reply["heartbeat"]["client_timeout"])
        self._rearm.set()
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

    def loading(self, rid: str) -> dict | None:
        """The latest `loading` event of a request whose model is being loaded (docs/protocol.md
        §3.10), or None."""
        box = self._inboxes.get(rid)
        return None if box is None else box.loading

    async def abort(self, rid: str) -> None:
        await self._send({"type": "abort", "id": rid})

    def stream(self, prompt: str | None = None, *, messages=None, token_ids=None, request_id: str | None = None,
               **params) -> "AsyncStream":
        rid = request_id or self.new_id()
        msg = generate_message(rid, prompt, messages, token_ids, True, params)
        return AsyncStream(self, rid, msg)

    async def generate(self, prompt: str | None = None, *, messages=None, token_ids=None,
                       request_id: str | None = None, **params) -> Completion:
        rid = request_id or self.new_id()
        self._open(rid)
        try:
            await self._send(generate_message(rid, prompt, messages, token_ids, False, params))
            f = await self._next(rid)
        except asyncio.CancelledError:
            await self.abort(rid)
            raise
        finally:
            self._inboxes.pop(rid, None)
        if f["type"] == "error":
            raise RidgeError(f["code"], f["message"], rid, f)
        return Completion.from_final(f)


class AsyncStream(JoinedStream):
    def __init__(self, client: AsyncClient, rid: str, msg: dict):
        self.client, self.id, self._msg = client, rid, msg
        self.final: Completion | None = None
        self.joined = Joined()
        self._sent = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        c = self.client
        if not self._sent:
            c._open(self.id)
            self._sent = True
            await c._send(self._msg)
        if self.final is not None or self.id not in c._inboxes:
            raise StopAsyncIteration
        try:
            msg = await c._next(self.id)
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if msg["type"] == "delta":
            d = Delta.from_frame(self.id, msg)
            self.joined.add(d)
            return d
        c._inboxes.pop(self.id, None)
        if msg["type"] == "error":
            raise RidgeError(msg["code"], msg["message"], self.id, msg)
        self.final = Completion.from_final(msg, self.joined)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Abort the request if it is still running."""
        if self.final is None and self.client._inboxes.pop(self.id, None) is not None:
            await self.client.abort(self.id)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def __del__(self):  # dropped unfinished, outside `async with`: aborted from the client's loop
        if self._sent and self.final is None:
            self.client._abort_dropped(self.id)
