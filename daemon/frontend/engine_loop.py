"""The engine thread: the only thread that touches the EngineCore.

It takes add/abort commands from a queue, steps the engine, and hands outputs
back through a queue plus a pipe the socket thread polls. It never touches a
socket and never encodes a frame. torch releases the GIL inside its kernels,
so the socket thread keeps answering while a step runs.

The engine is also *built* on this thread, and no other thread runs torch
work: libgomp gives every thread that opens an OpenMP region its own team of
workers, and once more OpenMP threads exist than cores it throttles their
spinning, so each parallel region pays a futex wake-up. Built on the main
thread and stepped here, SmolLM2 at batch 32 took 106-120 ms a step on 1.45
cores; built and stepped here, 82-90 ms on 2.0 cores (docs/benchmarks.md)."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ridge.errors import InvalidRequest
from ridge.errors import internal_error

from ..transport.wake import drain, poke, wake_pipe

log = logging.getLogger("ridge.daemon.engine")

# Steps of outputs the engine may run ahead of the socket thread, which takes them all at every turn
# of its loop. Past that (the socket thread is held up), outputs are merged per sample until it
# catches up: the outbox stays bounded and the engine never waits for it.
OUTBOX_STEPS = 64


class HeldOutputs:
    """Outputs the socket thread has not taken, one per sample: token ids, text and logprobs
    appended, the rest (counts, finish, timings) the latest. The daemon's core outputs carry no
    text (the socket thread's TextState reads the merged ids as it would have read each step's);
    an LLMEngine's carry theirs, merged too."""

    def __init__(self):
        self.outs: dict = {}  # (request id, sample) -> its merged output
        self.texts: dict = {}  # the same key -> text pieces, joined when taken

    def add(self, outs) -> None:
        for o in outs:
            key = (o.request_id, o.index)
            held = self.outs.get(key)
            if held is None:  # our own lists from here on, extended in place
                o.new_token_ids = list(o.new_token_ids)
                o.logprobs = None if o.logprobs is None else list(o.logprobs)
                self.texts[key] = [o.new_text]
            else:
                held.new_token_ids += o.new_token_ids
                o.new_token_ids = held.new_token_ids
                if held.logprobs is not None:
                    held.logprobs += o.logprobs or []
                    o.logprobs = held.logprobs
                self.texts[key].append(o.new_text)
            self.outs[key] = o

    def take(self) -> list:
        for key, o in self.outs.items():
            o.new_text = "".join(self.texts[key])
        return list(self.outs.values())


class EngineLoop(threading.Thread):
    """outbox items: ("out", [RequestOutput]), ("reject", engine_id, message, error code), ("dead", message),
    and once the engine is built ("ready",) or ("failed", message)."""

    def __init__(self, make_engine, stats_interval: float):  # the option's value (daemon/cli/config.py)
        super().__init__(name="ridge-engine", daemon=True)
        self._make_engine = make_engine
        self.engine = None
        self.ready = threading.Event()  # set once the engine is built, or failed to be (then .error)
        self.error: BaseException | None = None
        self.stats_interval = stats_interval
        self.inbox: deque = deque()
        self.outbox: deque = deque()
        self.max_outbox = OUTBOX_STEPS
        self._held: HeldOutputs | None = None  # outputs merged while the outbox is full
        self._out_lock = threading.Lock()  # the outbox and _held change together, so their order holds
        self._wake = threading.Event()
        self._stopping = False
        self.wake_r, self._wake_w = wake_pipe()
        self.tick = time.monotonic()  # last completed loop iteration: health's engine_lag
        self.snapshot: tuple[int, float, dict] = (0, time.time(), {})  # (seq, unix time, engine.stats())
        self._last_stats = time.monotonic()
        self._stats_failing = False  # logged once per spell of failed reads
        self.park = None  # engine -> what of it outlives the loop (frontend/memory.py park: its weights), run on exit
        self.parked = None

    def start_engine(self, timeout: float | None = None):
        """Start the thread, build the engine on it, and return the engine (or raise what building raised)."""
        self.start()
        self.ready.wait(timeout)
        if self.error is not None:
            raise self.error
        self.drain_outbox()  # the ("ready",) its caller is waiting for here
        return self.engine

    # -- called from the socket thread ---------------------------------------------
    def add(self, engine_id: str, prompt, params=None, cache_salt: str = "") -> None:
        """prompt: what the daemon's Validator admitted (engine/admit.Admitted), which the engine takes
        as it is; or token ids and their params, which the engine admits (engine.add_request)."""
        self.inbox.append(("add", engine_id, prompt, params, cache_salt))
        self._wake.set()

    def embed(self, engine_id: str, inputs: list, dimensions: int | None) -> None:
        """An embed request whose inputs the Validator admitted (engine/admit.Admitted each)."""
        self.inbox.append(("embed", engine_id, inputs, dimensions))
        self._wake.set()

    def abort(self, engine_id: str) -> None:
        self.inbox.append(("abort", engine_id))
        self._wake.set()

    def finish(self, engine_id: str, index: int) -> None:
        """One sample's stop string was found (streams.py): the engine ends it with reason stop."""
        self.inbox.append(("finish", engine_id, index))
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def drain_outbox(self) -> list:
        drain(self.wake_r)
        with self._out_lock:
            items = list(self.outbox)
            self.outbox.clear()
            if self._held is not None:  # newer than every item in the outbox
                items.append(("out", self._held.take()))
                self._held = None
        return items

    # -- the engine thread ---------------------------------------------------------
    def _emit_outputs(self, outs: list) -> None:
        with self._out_lock:
            if self._held is None and len(self.outbox) < self.max_outbox:
                self.outbox.append(("out", outs))
            else:
                self._held = self._held or HeldOutputs()
                self._held.add(outs)
        self._poke()

    def _emit(self, item) -> None:
        """A reject, or the engine's end: after every output held before it."""
        with self._out_lock:
            if self._held is not None:
                self.outbox.append(("out", self._held.take()))
                self._held = None
            self.outbox.append(item)
        self._poke()

    def _poke(self) -> None:
        poke(self._wake_w)

    def _apply_commands(self) -> None:
        while self.inbox:
            cmd = self.inbox.popleft()
            if cmd[0] in ("add", "embed"):
                eid = cmd[1]
                try:
                    if cmd[0] == "add":
                        self.engine.add_request(eid, cmd[2], cmd[3], cmd[4])
                    else:
                        self.engine.add_embedding(eid, cmd[2], cmd[3])
                except InvalidRequest as e:
                    self._emit(("reject", eid, str(e), "invalid_request"))
                except Exception as e:  # an engine bug on one request must not end the loop
                    self._emit(("reject", eid, internal_error(log, "add_request failed", e), "internal"))
            elif cmd[0] == "finish":
                self.engine.finish_sample(cmd[1], cmd[2])
            else:
                self.engine.abort_request(cmd[1])

    def _maybe_snapshot(self, now: float) -> None:
        if now - self._last_stats >= self.stats_interval:
            self._last_stats = now
            try:
                stats = self.engine.stats()
            except OSError as e:  # a figure the system would not give (EMFILE): the last snapshot stands
                if not self._stats_failing:
                    log.warning("the engine's stats could not be read (%s); the last ones stand until they can", e)
                self._stats_failing = True
                return
            self._stats_failing = False
            self.snapshot = (self.snapshot[0] + 1, time.time(), stats)

    def run(self) -> None:
        try:
            self.engine = self._make_engine()
            self.snapshot = (0, time.time(), self.engine.stats())
            self._emit(("ready",))  # before `ready` is set: start_engine() takes it back out
        except BaseException as e:
            self.error = e
            self._emit(("failed", internal_error(log, "building the engine failed", e)
                        if not isinstance(e, (ValueError, OSError, MemoryError)) else f"{type(e).__name__}: {e}"))
            return
        finally:
            self.ready.set()
        try:
            while not self._stopping:
                self._wake.clear()
                self._apply_commands()
                if self.engine.has_unfinished():
                    t0 = time.monotonic()
                    outs = self.engine.step()
                    if outs:
                        self._emit_outputs(outs)
                    elif time.monotonic() - t0 < 1e-3:  # nothing schedulable: don't spin
                        self._wake.wait(1e-3)
                else:
                    self._wake.wait(self.stats_interval)
                now = time.monotonic()
                self._maybe_snapshot(now)
                self.tick = now
        except BaseException as e:  # the socket thread tells every client, then the daemon exits
            self._emit(("dead", internal_error(log, "the engine loop failed", e)))
        finally:
            self.engine.close()  # queued writes of the disk KV tier land before the process exits
            if self.park is not None:
                try:
                    self.parked = self.park(self.engine)
                except Exception as e:
                    log.warning("the weights could not be parked: %s", e)
