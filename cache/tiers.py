"""KV tiers: prefix blocks that leave the device pool live on in host RAM and on
disk, keyed by the pool's chained block hash, and come back as prefix hits;
each tier uses a block only if its parent's hash and tokens are the request's
(block_hash.py: the rule of a hit).

The block pool stays the only owner of device blocks, their hashes and the free
queue; the tiers are a store beside it. The manager (manager.py) calls in:

- store: a block the pool has just published (full and computed) is copied to
  a host slot at once, and queued for the disk writer thread (write-through, so
  a restart, even after kill -9, finds what was computed). The copy is a memcpy
  of what the step computed, on the engine thread.
- evict: a cached block the pool is about to hand out again (BlockPool.on_evict)
  is copied to the host first if no tier has it; on CUDA the next step waits for
  that copy on the device, never on the host.
- lookup / start_load / poll: admission walks device -> host -> disk along the
  hash chain; host and disk hits are copied into freshly allocated device
  blocks by the loader thread (CPU: numpy copies, disk reads; CUDA: a side
  stream). The request waits in the scheduler's `loading` list while other
  requests keep stepping, and is admitted with num_computed_tokens past the
  loaded blocks once poll() reports the load done.

`busy_s` counts the seconds the engine thread spends in here (a step's share of
tier work: the engine's stats report it per step). `counts` is written by the
engine thread and both tier threads: every update takes `_count_lock`."""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from .block_io import BlockLayout, block_io
from .disk_tier import DiskTier
from .host_tier import HostTier

log = logging.getLogger("ridge.cache")
WRITE_QUEUE_BYTES = 256 << 20  # disk writes waiting beyond this are dropped (the block stays in host RAM)


def _stop_at_exit(ref, threads: list[threading.Thread]) -> None:
    """Let the tier threads end before the interpreter tears down: a daemon thread still
    running then, even one on its way out, aborted the process at exit ("terminate called
    without an active exception"). A live engine's threads are stopped after a few seconds
    of queued writes, not a flush; a dropped engine's were told to stop by __del__ and only
    need joining."""
    if (tiers := ref()) is not None:
        tiers.close(timeout=5.0)
    for t in threads:
        t.join(5.0)


def _serve(q: queue.Queue, ref, fn) -> None:
    """A tier thread: fn(tiers, item) for each item, until None or the tiers are gone."""
    while (item := q.get()) is not None and (tiers := ref()) is not None:
        try:
            fn(tiers, item)
        except Exception:  # a tier failure is a miss, never a dead engine
            log.exception("KV tier thread")
        del tiers


@dataclass(slots=True)
class TierBlock:
    """One block of a chain, as the tiers name it."""
    block_hash: bytes
    parent: bytes
    tokens: tuple
    block_id: int = -1  # the device block, where there is one
    slot: int | None = None  # its host slot, for a host hit


@dataclass
class Load:
    req_id: str
    blocks: list[TierBlock]  # in chain order, with block_id the device block to fill
    done: threading.Event = field(default_factory=threading.Event)
    loaded: int = 0  # leading blocks that arrived; the rest are recomputed
    event: object = None  # CUDA: recorded after the copies in
    keep: object = None  # CUDA: the pinned rows the copies read, alive until they are done


class KVTiers:
    def __init__(self, caches: list, host_bytes: int, disk: DiskTier | None = None):
        self.layout = BlockLayout(caches)
        self.io = block_io(self.layout)
        self.block_bytes = self.layout.block_bytes
        self.cuda = self.layout.device.type == "cuda"
        slots = max(0, host_bytes) // self.block_bytes
        self.host = HostTier(slots, self.block_bytes, pin_memory=self.cuda) if slots else None
        self.disk = disk if disk is not None and disk.enabled else None
        self.loads: dict[str, Load] = {}
        self.busy_s = 0.0
        self.counts = {t: dict.fromkeys(("hits", "misses", "bytes_in", "bytes_out"), 0) for t in ("host", "disk")}
        self.dropped_writes = 0
        self._write_bytes = 0  # queued for the writer
        self._disk_rows: np.ndarray | None = None  # the loader thread's, on CPU
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._any_done = threading.Event()
        self._load_q: queue.Queue = queue.Queue()
        self._write_q: queue.Queue = queue.Queue()
        me = weakref.ref(self)  # the threads must not keep a dropped engine's tiers (and cache) alive
        self._threads = [threading.Thread(target=_serve, args=(q, me, fn), name=name, daemon=True)
                         for q, fn, name in ((self._load_q, KVTiers._load, "ridge-kv-load"),
                                             (self._write_q, KVTiers._write, "ridge-kv-write"))]
        for t in self._threads:
            t.start()
        atexit.register(_stop_at_exit, me, list(self._threads))

    def __del__(self):
        for q in (self._load_q, self._write_q):
            q.put(None)

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    @property
    def hash_key(self) -> bytes | None:
        """The key that block hashes must be made with for the disk tier's files to be found."""
        return self.disk.hash_key if self.disk is not None else None

    def _count(self, tier: str, **add: int) -> None:
        with self._count_lock:
            c = self.counts[tier]
            for k, v in add.items():
                c[k] += v

    def count_snapshot(self) -> dict:
        with self._count_lock:
            return {t: dict(c) for t, c in self.counts.items()}

    @contextmanager
    def _busy(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - t0

    # -- store (engine thread) --------------------------------------------------------
    def store(self, blocks: list[TierBlock], copy: bool = True) -> None:
        """Blocks the pool has just published. copy=False: they came from the tiers."""
        if copy:
            with self._busy():
                self._save([b for b in blocks if not self._has(b.block_hash)])

    def evict(self, evicted: list[tuple[int, bytes, bytes, tuple]]) -> None:
        """(block id, hash, parent, tokens) of cached blocks the pool hands out again: keep their bytes."""
        with self._busy():
            todo = []
            for block_id, h, parent, tokens in evicted:
                if self.host is not None and h in self.host:
                    self.host.get(h, parent, tokens)  # now the most recently used, if it is this block
                    continue  # else another block holds the hash: the first keeps it, as in the pool
                if self.host is not None or (self.disk is not None and h not in self.disk):
                    todo.append(TierBlock(h, parent, tokens, block_id))
            ev = self._save(todo)
            if ev is not None:  # the step that overwrites them runs after the copies
                torch.cuda.current_stream(self.layout.device).wait_event(ev)

    def _has(self, h: bytes) -> bool:
        return (self.host is not None and h in self.host) or (self.disk is not None and h in self.disk)

    def _save(self, blocks: list[TierBlock]):
        """Copy device blocks to host slots, or stage them, and queue their disk writes; -> the
        CUDA event after the copies (None on CPU, where they are done)."""
        if not blocks:
            return None
        slots = self.host.reserve(len(blocks)) if self.host is not None else []
        kept, rest = blocks[:len(slots)], blocks[len(slots):]
        ev = None
        if kept:
            ev = self.io.save([b.block_id for b in kept], self.host.buf if self.cuda else self.host.rows, slots)
            for b, s in zip(kept, slots):
                self.host.insert(b.block_hash, s, b.parent, b.tokens)
            self._count("host", bytes_out=len(kept) * self.block_bytes)
        if self.disk is None or not self.disk.enabled:
            return ev
        for b, s in zip(kept, slots):
            if b.block_hash not in self.disk:
                self._queue_write(b, self.host.rows[s], s, ev)
        if rest:  # no host slot: stage them for the writer
            rows, keep = self._scratch(len(rest))
            ev2 = self.io.save([b.block_id for b in rest], keep, range(len(rest)))
            for i, b in enumerate(rest):
                self._queue_write(b, rows[i], None, ev2)
            ev = ev2 if ev is None else ev
        return ev

    def _scratch(self, n: int):
        """-> (numpy rows, what block_io copies into: the same rows, or their pinned tensor)."""
        t = torch.empty((n, self.block_bytes), dtype=torch.uint8, pin_memory=self.cuda)
        return t.numpy(), (t if self.cuda else t.numpy())

    def _load_rows(self, n: int):
        """The loader's rows for disk reads. On CPU one array, kept and grown: fresh pages
        cost a fault per 4 KiB (0.2 s for SmolLM2's 2K-token prefix, as much as reading
        it); on CUDA a fresh pinned one per load, alive until its copies are done."""
        if self.cuda:
            return self._scratch(n)
        if self._disk_rows is None or len(self._disk_rows) < n:
            self._disk_rows = np.empty((n, self.block_bytes), dtype=np.uint8)
        return self._disk_rows, self._disk_rows

    def _queue_write(self, b: TierBlock, row, slot, ev) -> None:
        with self._lock:
            if self._write_bytes + self.block_bytes > WRITE_QUEUE_BYTES:
                self.dropped_writes += 1
                return
            self._write_bytes += self.block_bytes
        if slot is not None:
            self.host.pin([slot])
        self._write_q.put((b, row, slot, ev))

    # -- lookup and loads (engine thread) -----------------------------------------------
    def lookup(self, chain: list[TierBlock]) -> list[TierBlock]:
        """The leading blocks of chain that a tier holds. Host hits carry their slot, pinned
        until start_load's copies are done or abandon() gives them back."""
        with self._busy():
            out = []
            for b in chain:
                slot = self.host.get(b.block_hash, b.parent, b.tokens) if self.host is not None else None
                if slot is None and (self.disk is None or b.block_hash not in self.disk):
                    break
                b.slot = slot
                out.append(b)
            missed = len(out) < len(chain)
            self._count("host", misses=(self.host is not None) * (sum(b.slot is None for b in out) + missed))
            self._count("disk", misses=(self.disk is not None) * missed)
            if slots := [b.slot for b in out if b.slot is not None]:
                self.host.pin(slots)
            return out

    def abandon(self, blocks: list[TierBlock]) -> None:
        """A lookup whose request was not admitted."""
        if slots := [b.slot for b in blocks if b.slot is not None]:
            self.host.unpin(slots)

    def start_load(self, req_id: str, blocks: list[TierBlock], block_ids: list[int]) -> None:
        """Copy blocks (a lookup's, their host slots pinned) into the device blocks block_ids."""
        with self._busy():
            for b, i in zip(blocks, block_ids):
                b.block_id = i
            job = Load(req_id, blocks)
            self.loads[req_id] = job
            self._load_q.put(job)

    def poll(self) -> dict[str, int]:
        """Loads now complete: request id -> blocks loaded (the leading ones that arrived)."""
        with self._busy():
            self._any_done.clear()
            done = {r: j for r, j in self.loads.items() if j.done.is_set() and (j.event is None or j.event.query())}
            for r, j in done.items():
                del self.loads[r]
                if j.event is not None:  # done already; this orders the compute stream after it all the same
                    torch.cuda.current_stream(self.layout.device).wait_event(j.event)
            return {r: j.loaded for r, j in done.items()}

    def wait(self, timeout: float) -> None:
        """Block until a load completes (the engine has nothing else to run)."""
        if self.loads:
            self._any_done.wait(timeout)

    def cancel(self, req_id: str, blocks: list[TierBlock]) -> None:
        """A lookup whose request left, or was not admitted: wait for a load already started
        (its target blocks are about to be freed), or give its host slots back."""
        with self._busy():
            job = self.loads.pop(req_id, None)
            if job is None:
                self.abandon(blocks)
                return
            job.done.wait()
            if job.event is not None:
                job.event.synchronize()

    # -- tier threads -----------------------------------------------------------------
    def _load(self, job: Load) -> None:
        host = [b for b in job.blocks if b.slot is not None]
        try:
            disk = [b for b in job.blocks if b.slot is None]
            rows, keep = self._load_rows(len(disk)) if disk else (None, None)
            n, k = 0, 0
            for b in job.blocks:
                if b.slot is None:
                    if not self.disk.read(b.block_hash, b.parent, b.tokens, rows[k]):
                        break
                    k += 1
                n += 1
            host_now = [b for b in job.blocks[:n] if b.slot is not None]
            if host_now:
                self.io.load([b.block_id for b in host_now], self.host.buf if self.cuda else self.host.rows,
                             [b.slot for b in host_now])
            if k:
                self.io.load([b.block_id for b in disk[:k]], keep, range(k))
            job.event, job.keep = self.io.fence(), keep
            job.loaded = n
            self._count("host", hits=len(host_now), bytes_in=len(host_now) * self.block_bytes)
            self._count("disk", hits=k, misses=int(n < len(job.blocks)), bytes_in=k * self.block_bytes)
        finally:
            if host:
                self.host.unpin([b.slot for b in host])
            job.done.set()
            self._any_done.set()

    def _write(self, item) -> None:
        b, row, slot, ev = item
        try:
            if ev is not None:
                ev.synchronize()
            if self.disk is not None and self.disk.write(b.block_hash, b.parent, b.tokens, row):
                self._count("disk", bytes_out=self.block_bytes)
        finally:
            if slot is not None:
                self.host.unpin([slot])
            with self._lock:
                self._write_bytes -= self.block_bytes

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued disk writes; True when none is left."""
        end = time.monotonic() + timeout
        while self._write_bytes > 0 and time.monotonic() < end:
            time.sleep(0.005)
        return self._write_bytes <= 0

    def close(self, timeout: float = 30.0) -> None:
        """Stop the threads once they have served what is queued (idempotent)."""
        if not any(t.is_alive() for t in self._threads):
            return
        for q in (self._load_q, self._write_q):
            q.put(None)
        for t in self._threads:
            t.join(timeout)



ZERO = dict.fromkeys(("hits", "misses", "bytes_in", "bytes_out"), 0)


def tier_stats(tiers: KVTiers | None) -> dict:
    """The tiers' figures (docs/protocol.md §7.2 kv_tiers), all zero when there are none.
    (A tier with no blocks is falsy, hence the `is not None`.)"""
    host, disk = (tiers.host, tiers.disk) if tiers is not None else (None, None)
    counts = tiers.count_snapshot() if tiers is not None else {"host": ZERO, "disk": ZERO}
    bb = tiers.block_bytes if tiers is not None else 0
    h, d = host is not None, disk is not None
    return {
        "block_bytes": bb, "loading": len(tiers.loads) if tiers is not None else 0,
        "host": {"enabled": h, "capacity_bytes": host.num_slots * bb if h else 0,
                 "used_bytes": host.used_bytes if h else 0, "blocks": len(host) if h else 0, **counts["host"]},
        "disk": {"enabled": d and disk.enabled, "capacity_bytes": disk.cap_bytes if d else 0,
                 "used_bytes": disk.used_bytes if d else 0, "blocks": len(disk) if d else 0,
                 **counts["disk"], "corrupt": disk.corrupt if d else 0,
                 "dropped_writes": tiers.dropped_writes if tiers is not None else 0,
                 "path": str(disk.dir) if d else "", "off_reason": disk.off_reason if d else "",
                 "paused": d and disk.paused},
    }
