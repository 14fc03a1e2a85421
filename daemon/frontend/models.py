"""Many models, one daemon (issue 28): a model per engine, loaded when a request names it,
unloaded when it has been idle for its keep_alive, or evicted (the least recently used idle
one first) when another needs the room. Runs on the socket thread; each engine is built,
stepped and closed on its own EngineLoop thread (engine_loop.py).

One load at a time: no engine sizes its KV pool while another is being built or torn down, and
each is given its share of the KV budget explicitly (docs/architecture.md, "Many models")."""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

from ridge.durations import FOREVER, parse_duration, wire_duration
from ridge.request import GENERATE

from .. import protocol as P
from ..protocol import ProtocolError, message
from .memory import release_memory
from .model_files import Facts, ModelFiles, stat_key
from .registry import Entry, Registry

log = logging.getLogger("ridge.daemon.models")

PROGRESS_S = 1.0  # a loading event to each waiting request this often
LOAD_WINDOW_S = 60.0  # loads_per_minute counts a principal's loads over this window


class Waiting:
    """A generate or embed that named a model not loaded yet: admitted once it is."""
    __slots__ = ("peer", "env", "kind", "size", "keep", "aborted")

    def __init__(self, peer, env, kind: str, size: int, keep: float | None):
        self.peer, self.env, self.kind, self.size, self.keep = peer, env, kind, size, keep
        self.aborted = False


class Slot:
    """One model the daemon holds or is loading, and the requests it has in flight."""

    def __init__(self, entry: Entry, keep_alive: float):
        self.entry, self.name = entry, entry.name
        self.state = "queued"  # queued (for room, or for another load) | loading | ready | unloading
        self.loop = self.engine = self.validator = self.info = None
        self.waiting: list[Waiting] = []
        self.active = 0  # requests waiting, being admitted or in the engine
        self.keep_alive = keep_alive  # the latest request's, else the entry's, else the daemon's
        self.owner: str | None = None  # the principal whose request loaded it; None: the daemon's (the default)
        self.last_used = time.monotonic()
        self.expires_at: float | None = None  # monotonic; None while it has requests, or pinned
        self.load_started = self.load_seconds = None
        self.load_from: str | None = None  # host (parked weights) | cache (converted on disk) | convert
        self.parked = None  # the parked LoadedModel a load in progress was given
        self.weight_bytes = self.kv_bytes = 0
        self.queued_at = time.monotonic()
        self._progress_at = 0.0

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def idle(self) -> bool:
        return self.state == "ready" and self.active == 0

    def describe(self, unix_now: float, mono_now: float) -> dict:
        out = {"state": self.state, "loaded": self.state == "ready", "bytes": self.bytes,
               "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes, "requests": self.active,
               "keep_alive": wire_duration(self.keep_alive), "load_seconds": self.load_seconds,
               "load_from": self.load_from, "expires_at": None}
        if self.expires_at is not None:
            out["expires_at"] = unix_now + max(self.expires_at - mono_now, 0.0)
        if self.state == "loading":
            out["elapsed"] = mono_now - self.load_started
        if self.info is not None:
            from ridge.engine.pooling import kind_of  # the engine's modules load torch: on first use

            out["kind"] = kind_of(self.info.get("pooling"))
            out["device"], out["max_model_len"] = self.info["device"], self.info["max_model_len"]
            out["model"] = self.info  # hello's map for it (§7.1): what Ollama's /api/show tells
        return out


class Models:
    """build(entry, parked LoadedModel | None, kv_memory_gib | None) -> an EngineLoop, started:
    its thread builds the engine and emits ("ready",) or ("failed", message). ready(slot, engine)
    -> (validator, model info) for a built engine."""

    def __init__(self, registry: Registry, build, ready, *, max_loaded: int, keep_alive: float,
                 memory_bytes: int | None, park_bytes: int, kv_share_gib: float | None):
        self.registry, self._build, self._ready = registry, build, ready
        self.max_loaded, self.keep_alive = max_loaded, keep_alive
        self.memory_bytes, self.park_bytes, self.kv_share_gib = memory_bytes, park_bytes, kv_share_gib
        self.slots: dict[str, Slot] = {}
        self.parked: OrderedDict[str, tuple] = OrderedDict()  # name -> (LoadedModel, bytes), oldest first
        self.sizes: dict[str, int] = {}  # name -> the bytes it held when last loaded: the next load's estimate
        self.counts = {"loads": 0, "unloads": 0, "evictions": 0, "failed": 0}
        self.send = None  # the server's (peer, message); set by it
        self.admit = None  # the server's (Waiting, Slot) -> None: submit it for admission
        self.refuse = None  # the server's (peer, ProtocolError)
        self._last_snapshot = (0, time.time(), {})
        self.default_pooling = "auto"  # the daemon's --pooling, which [models.NAME] pooling overrides
        self.loads_per_minute = 30  # per principal (max_loads_per_minute): set by `ridge serve`
        self._loads: dict[str, list[float]] = {}  # principal -> when its recent loads started
        self.files = ModelFiles()  # what each model's files say, read off the socket thread
        # Entry name -> (its file as it was, the pooling its last load resolved; none: it generates).
        # By entry, not by file: two entries of one file (a chat model and its embedding entry) each
        # keep their own role.
        self.poolings: dict[str, tuple[tuple, str]] = {}
        for e in registry.entries().values():  # read now, so that the first listing knows them
            self.files.facts(e.path)

    # -- the default model, built by `ridge serve` before the sockets bind -----------
    def adopt(self, entry: Entry, loop, engine) -> Slot:
        slot = Slot(entry, self._keep(entry))
        slot.loop, slot.engine, slot.state = loop, engine, "ready"
        slot.load_from = "cache" if engine.loaded.from_cache else "convert"
        slot.load_seconds = engine.loaded.load_seconds
        self._measure(slot)
        slot.validator, slot.info = self._ready(slot, engine)
        self.slots[entry.name] = slot
        self._idle(slot, time.monotonic())
        return slot

    def _keep(self, entry: Entry) -> float:
        return self.keep_alive if entry.keep is None else entry.keep

    def _measure(self, slot: Slot) -> None:
        eng, e = slot.engine, slot.entry
        slot.weight_bytes, slot.kv_bytes = int(eng.memory.weight_bytes), int(eng.memory.kv_pool_bytes)
        self.sizes[slot.name] = slot.bytes
        # What its metadata said, kept: a GGUF's is read whole at load (SmolLM2's 49K-token
        # vocabulary took 10 s of a reload on this CPU), and it is the same file next time.
        if e.options.get("pooling", self.default_pooling) == "auto" and (file := _file(e.path)) is not None:
            self.poolings[e.name] = (file, eng.pooling or "none")

    # -- requests ------------------------------------------------------------------
    def request(self, peer, env, kind: str, size: int, max_waiting: int) -> None:
        """A generate or embed: its `model` picks the slot (loaded now if it is not), its
        `keep_alive` how long the model stays once it is done."""
        body = env.body
        if not P.speaks(env.v, "models") and (given := [k for k, f in GENERATE.items() if f.since == "models" and k in body]):
            raise ProtocolError(P.INVALID_FIELD, f"{given[0]} is a version {P.SINCE['models']} field; this message "
                                f"is version {env.v}", env.id)
        name, keep = body.pop("model", None), body.pop("keep_alive", None)
        if name is not None and not isinstance(name, str):
            raise P.fail("model", "a string (a name `models` lists)", env.id)
        if keep is not None:
            try:
                keep = parse_duration(keep)
            except ValueError as e:
                raise ProtocolError(P.INVALID_FIELD, str(e), env.id) from None
        entry = self.registry.find(name)
        if entry is None:
            raise ProtocolError(P.MODEL_NOT_FOUND, f"the model {name!r} does not exist; this daemon serves "
                                f"{', '.join(sorted(self.registry.entries()))}", env.id, model=name)
        who = getattr(peer, "identity", "") or ""
        slot = self.slots.get(entry.name)
        if keep is not None and keep < self._keep(entry):
            mine = slot is None or slot.owner == who  # a load this request starts is its principal's
            if entry is self.registry.default or not mine:
                keep = None  # another's model, or the daemon's default: the configured keep_alive stands
        w = Waiting(peer, env, kind, size, keep)
        if slot is None or slot.state == "unloading":
            if sum(len(s.waiting) for s in self.slots.values()) >= max_waiting:
                raise ProtocolError(P.BUSY, "too many requests wait for models to load; retry later", env.id,
                                    retry_after=1.0)
            self._count_load(who, env.id)
            if slot is None:
                slot = self.slots[entry.name] = Slot(entry, self._keep(entry))
                slot.owner = who
        slot.active += 1
        slot.expires_at = None
        if slot.state == "ready":
            slot.last_used = time.monotonic()
            self.admit(w, slot)
            return
        slot.waiting.append(w)
        self._tell(w, slot, time.monotonic())
        self.schedule()

    def _count_load(self, who: str, rid) -> None:
        """One principal may start loads_per_minute loads a minute: naming model after model, it
        would otherwise evict everyone else's as fast as they load."""
        now = time.monotonic()
        times = self._loads.setdefault(who, [])
        times[:] = [t for t in times if now - t < LOAD_WINDOW_S]
        if len(times) >= self.loads_per_minute:
            raise ProtocolError(P.TOO_MANY_REQUESTS, f"you started {len(times)} model loads in the last "
                                f"{LOAD_WINDOW_S:.0f} s, the limit (max_loads_per_minute); retry later", rid,
                                retry_after=round(LOAD_WINDOW_S - (now - times[0]), 1))
        times.append(now)
        if len(self._loads) > 4096:  # principals with no load in the window start afresh
            self._loads = {k: v for k, v in self._loads.items() if v and now - v[-1] < LOAD_WINDOW_S}

    def release(self, slot: Slot, keep: float | None) -> None:
        """A request of the slot's ended (answered, refused or its client gone)."""
        slot.active -= 1
        if keep is not None:
            slot.keep_alive = keep
        now = time.monotonic()
        slot.last_used = now
        if slot.active == 0 and slot.state == "ready":
            self._idle(slot, now)
            self.schedule()

    def _idle(self, slot: Slot, now: float) -> None:
        slot.expires_at = None if slot.keep_alive == FOREVER else now + slot.keep_alive

    def abort_waiting(self, peer, rid: str) -> bool:
        for slot in self.slots.values():
            for w in slot.waiting:
                if w.peer is peer and w.env.id == rid:
                    w.aborted = True
                    return True
        return False

    def fail_waiting(self, code: str, text: str) -> None:
        """Every request still waiting for a load ends with an error (the daemon is draining)."""
        for slot in self.slots.values():
            for w in slot.waiting:
                self.refuse(w.peer, ProtocolError(code, text, w.env.id))
                slot.active -= 1
            slot.waiting.clear()

    def _tell(self, w: Waiting, slot: Slot, now: float) -> None:
        """A loading event (docs/protocol.md §3.10) to a client of version 3 on; older ones only wait."""
        if not P.speaks(w.peer.version, "models") or w.peer.gone:
            return
        f = message("loading", w.env.id, model=slot.name, stage=slot.state,
                    elapsed=0.0 if slot.load_started is None else now - slot.load_started)
        if slot.load_from is not None:
            f["load_from"] = slot.load_from
        self.send(w.peer, f)

    # -- loading and unloading -------------------------------------------------------
    def schedule(self) -> None:
        """Start the next load when nothing else loads or unloads, evicting the least recently used
        idle models while the loaded ones are too many or hold too much memory."""
        if any(s.state in ("loading", "unloading") for s in self.slots.values()):
            return
        queued = sorted((s for s in self.slots.values() if s.state == "queued"), key=lambda s: s.queued_at)
        if not queued:
            return
        slot = queued[0]
        if not slot.waiting:  # every request that wanted it went away
            del self.slots[slot.name]
            return self.schedule()
        loaded = [s for s in self.slots.values() if s.state == "ready"]
        need = self.sizes.get(slot.name) or self._disk_size(slot.entry) * 2
        over_count = len(loaded) + 1 > self.max_loaded
        over_memory = self.memory_bytes is not None and loaded and \
            sum(s.bytes for s in loaded) + need > self.memory_bytes
        if over_count or over_memory:
            # The requester's own idle models go first, the default model last: one principal's
            # loads cost its own models before anyone else's.
            idle = sorted((s for s in loaded if s.idle()),
                          key=lambda s: (s.owner != slot.owner, s.entry is self.registry.default, s.last_used))
            if idle:
                self.counts["evictions"] += 1
                log.info("evicting %s (idle %.0f s) to load %s", idle[0].name, time.monotonic() - idle[0].last_used,
                         slot.name)
                self.unload(idle[0])
            return  # else: wait until a loaded model's requests are done
        self._start(slot)

    def _start(self, slot: Slot) -> None:
        parked = self.parked.pop(slot.name, None)
        slot.state, slot.load_started = "loading", time.monotonic()
        slot.load_from = "host" if parked is not None else None
        slot.parked = parked[0] if parked else None
        log.info("loading %s (%s)%s", slot.name, slot.entry.path,
                 " from the weights parked in host RAM" if parked else "")
        share = slot.entry.options.get("kv_memory_gib") or self.kv_share_gib
        entry = slot.entry
        learned = self.poolings.get(entry.name)
        if entry.options.get("pooling", self.default_pooling) == "auto" and learned and learned[0] == _file(entry.path):
            entry = replace(entry, options={**entry.options, "pooling": learned[1]})
        try:
            slot.loop = self._build(entry, parked[0] if parked else None, share)
        except Exception as e:
            self._failed(slot, f"{type(e).__name__}: {e}")
            return
        now = time.monotonic()
        for w in slot.waiting:
            self._tell(w, slot, now)

    def on_loop(self, slot: Slot, item) -> None:
        """("ready",) or ("failed", message) from a slot's engine thread."""
        if item[0] == "failed":
            self._failed(slot, item[1])
            return
        if slot.state != "loading":
            return
        engine = slot.engine = slot.loop.engine
        slot.load_seconds = time.monotonic() - slot.load_started
        if engine.loaded is not slot.parked:  # none was parked, or the copy failed (cli/serve.py new_engine)
            slot.load_from = "cache" if engine.loaded.from_cache else "convert"
        slot.parked = None
        self._measure(slot)
        try:
            slot.validator, slot.info = self._ready(slot, engine)
        except Exception as e:
            slot.loop.stop()
            self._failed(slot, f"{type(e).__name__}: {e}")
            return
        slot.state, slot.last_used = "ready", time.monotonic()
        self.counts["loads"] += 1
        log.info("loaded %s in %.2f s (%s): %.2f GiB", slot.name, slot.load_seconds, slot.load_from,
                 slot.bytes / (1 << 30))
        waiting, slot.waiting = slot.waiting, []
        for w in waiting:
            if w.peer.gone:
                slot.active -= 1
                continue
            self.admit(w, slot)
        if slot.active == 0:
            self._idle(slot, time.monotonic())
        self.schedule()

    def _failed(self, slot: Slot, why: str) -> None:
        log.error("loading %s failed: %s", slot.name, why)
        self.counts["failed"] += 1
        for w in slot.waiting:
            self.refuse(w.peer, ProtocolError(P.MODEL_LOAD_FAILED, f"loading the model {slot.name!r} failed: {why}",
                                              w.env.id, model=slot.name))
        slot.waiting.clear()
        self.slots.pop(slot.name, None)
        self.schedule()

    def unload(self, slot: Slot) -> None:
        slot.state = "unloading"
        slot.expires_at = None
        slot.loop.stop()  # its thread closes the engine, parks its weights, and ends

    def tick(self, now: float) -> None:
        """From the socket thread's timers: expiries, finished unloads, loading events."""
        for slot in list(self.slots.values()):
            if slot.idle() and slot.expires_at is not None and now >= slot.expires_at:
                log.info("unloading %s: idle for its keep_alive (%.0f s)", slot.name, slot.keep_alive)
                self.unload(slot)
            elif slot.state == "unloading" and not slot.loop.is_alive():
                self._unloaded(slot)
            elif slot.waiting and now - slot._progress_at >= PROGRESS_S:
                slot._progress_at = now
                for w in slot.waiting:
                    self._tell(w, slot, now)

    def _unloaded(self, slot: Slot) -> None:
        if self.slots.get(slot.name) is slot:
            del self.slots[slot.name]
        parked = slot.loop.parked
        self.counts["unloads"] += 1
        self._last_snapshot = slot.loop.snapshot
        slot.loop.engine = slot.engine = slot.validator = None
        if parked is not None and slot.weight_bytes <= self.park_bytes:
            while self.parked and sum(b for _, b in self.parked.values()) + slot.weight_bytes > self.park_bytes:
                self.parked.popitem(last=False)
            self.parked[slot.name] = (parked, slot.weight_bytes)
        slot.loop.parked = None
        log.info("unloaded %s%s", slot.name, " (weights parked in host RAM)" if slot.name in self.parked else "")
        release_memory()
        if slot.waiting:  # requests came for it while it unloaded: it loads again
            slot.state, slot.loop = "queued", None
            self.slots[slot.name] = slot
        self.schedule()

    # -- what the daemon reports ------------------------------------------------------
    def loops(self) -> list:
        return [s.loop for s in self.slots.values() if s.loop is not None]

    def slot_of(self, loop) -> Slot | None:
        return next((s for s in self.slots.values() if s.loop is loop), None)

    def primary(self) -> Slot | None:
        """The slot whose engine stats `stats` and `health` report: the default model's while it is
        loaded, else the most recently used loaded one."""
        d = self.slots.get(self.registry.default.name)
        if d is not None and d.state == "ready":
            return d
        ready = [s for s in self.slots.values() if s.state == "ready"]
        return max(ready, key=lambda s: s.last_used) if ready else None

    def snapshot(self) -> tuple:
        p = self.primary()
        if p is not None:
            self._last_snapshot = p.loop.snapshot
        return self._last_snapshot

    def listing(self, owner: bool = True) -> list[dict]:
        """Every model the daemon can serve (docs/protocol.md §3.10), the default first. Only the
        daemon's owner is shown where its files are, their sizes and times: the others see names."""
        unix, mono = time.time(), time.monotonic()
        out = []
        for name, e in self.registry.entries().items():
            f = self.files.facts(e.path)  # None: not read yet (model_files.py); known on a later listing
            m = {"name": name, "path": e.path, "default": e is self.registry.default,
                 "size": f.size if f else None, "modified_at": f.mtime if f else None,
                 "format": f.format if f else _format(e.path), "kind": self._kind(e, f), "loaded": False,
                 "state": "available", "bytes": 0, "keep_alive": wire_duration(self._keep(e)), "expires_at": None,
                 "parked": name in self.parked}
            if (slot := self.slots.get(name)) is not None:
                m.update(slot.describe(unix, mono))
            if not owner:
                m.update(path=None, size=None, modified_at=None)
                if "model" in m:
                    m["model"] = {k: v for k, v in m["model"].items() if k != "path"}
            out.append(m)
        return out

    def held(self) -> list[dict]:
        """The models loaded, loading or waiting to load: what stats carry for `ridge top`, to every
        client and the stats feed, so without the files' paths."""
        unix, mono = time.time(), time.monotonic()
        out = []
        for s in self.slots.values():
            m = {"name": s.name, "default": s.entry is self.registry.default, **s.describe(unix, mono)}
            if "model" in m:
                m["model"] = {k: v for k, v in m["model"].items() if k != "path"}
            out.append(m)
        return out

    def _kind(self, e: Entry, f: Facts | None) -> str:
        """generate | embed | rerank, from its engine once loaded, its pooling option, else its
        metadata; "unknown" while that is being read."""
        from ridge.engine.pooling import kind_of, resolve_pooling  # the engine's modules load torch: on first use

        slot = self.slots.get(e.name)
        if slot is not None and slot.info is not None:
            return kind_of(slot.info.get("pooling"))
        pooling = e.options.get("pooling", self.default_pooling)
        if pooling != "auto":
            return kind_of(resolve_pooling(pooling, None))
        return "unknown" if f is None else kind_of(f.pooling)

    def _disk_size(self, e: Entry) -> int:
        f = self.files.facts(e.path)
        if f is not None:
            return f.size
        try:
            return os.stat(e.path).st_size if e.path else 0
        except OSError:
            return 0


def _file(path: str | None) -> tuple | None:
    """The identity of a model's file as it is now (a stat): what was learned of it holds while
    this is the same."""
    try:
        return (path, *stat_key(os.stat(path))) if path else None
    except OSError:
        return None


def _format(path: str | None) -> str:
    return "missing" if not path else Path(path).suffix.lstrip(".").lower() or "safetensors"
