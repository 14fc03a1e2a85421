"""What a model's files say before it is loaded (its size, its newest file's time, whether it
embeds), read on a worker thread: never on the socket thread, where one slow or hostile file
(a FIFO named x.gguf, a header declaring a 2^40-element array, a 150K-token vocabulary on a
cold disk) would stall every client of the daemon.

The socket thread only stats a path and looks it up; a path not read yet, or changed since
(its device, inode, size or mtime), is queued for the worker and answered as unknown until it
has been. Each read is bounded in bytes, elements and time (quant/gguf_header.py), and only
regular files are opened."""
from __future__ import annotations

import json
import logging
import os
import queue
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ridge.daemon.models")

MAX_CACHED = 4096  # paths whose facts are kept
MAX_QUEUED = 1024  # paths waiting for the worker; past it a listing shows them unknown a while longer
MAX_TREE = 4096  # files of an HF directory counted for its size
MAX_JSON = 1 << 20  # bytes of a sentence-transformers JSON file


@dataclass(frozen=True)
class Facts:
    size: int  # bytes on disk
    mtime: float  # its newest file's
    format: str  # gguf | safetensors | missing | ...
    pooling: str | None  # its metadata's: last | mean | rank, or None (it generates)
    error: str | None = None  # why its metadata could not be read (it is found out again at load)


def stat_key(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class ModelFiles:
    """Facts by path, read by one worker thread (started on first use)."""

    def __init__(self):
        self._facts: dict[str, tuple[tuple, Facts]] = {}
        self._queued: set[str] = set()
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def facts(self, path: str | None) -> Facts | None:
        """The facts of a path as they are now, or None while they are being read. A stat only."""
        if path is None:
            return Facts(0, 0.0, "missing", None)
        try:
            key = stat_key(os.stat(path))
        except OSError:
            return Facts(0, 0.0, "missing", None)
        with self._lock:
            hit = self._facts.get(path)
            if hit is not None and hit[0] == key:
                return hit[1]
            if path in self._queued or len(self._queued) >= MAX_QUEUED:
                return None
            self._queued.add(path)
        self._start()
        self._q.put(path)
        return None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ridge-model-files", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            path = self._q.get()
            try:
                key, facts = read_facts(path)
            except Exception as e:  # never the worker's end: the next path is read
                try:
                    key = stat_key(os.stat(path))
                except OSError:
                    key = None
                facts = Facts(0, 0.0, "missing", None, f"{type(e).__name__}: {e}")
            with self._lock:
                self._queued.discard(path)
                if key is not None:
                    if len(self._facts) >= MAX_CACHED:
                        self._facts.pop(next(iter(self._facts)))  # the oldest read
                    self._facts.pop(path, None)
                    self._facts[path] = (key, facts)


def read_facts(path: str) -> tuple[tuple | None, Facts]:
    """On the worker: -> (the stat key the facts are for, the facts)."""
    st = os.stat(path)
    key = stat_key(st)
    if stat.S_ISDIR(st.st_mode):
        size, newest = _tree(Path(path))
        try:
            pooling, error = _sentence_transformers(Path(path)), None
        except Exception as e:  # malformed JSON of any shape: found out again at load
            pooling, error = None, f"{type(e).__name__}: {e}"
        return key, Facts(size, newest, "safetensors", pooling, error)
    if not stat.S_ISREG(st.st_mode):
        return key, Facts(0, st.st_mtime, "missing", None, "not a regular file")
    fmt = Path(path).suffix.lstrip(".").lower() or "file"
    if fmt != "gguf":
        return key, Facts(st.st_size, st.st_mtime, fmt, None)
    from ridge.engine.pooling import GGUF_POOLING
    from ridge.quant.gguf_header import HeaderError, read_header

    try:
        values = read_header(path).values
    except (OSError, HeaderError) as e:
        log.warning("cannot read the metadata of %s: %s", path, e)
        return key, Facts(st.st_size, st.st_mtime, fmt, None, str(e))
    arch = values.get("general.architecture")
    kind = values.get(f"{arch}.pooling_type")
    pooling = GGUF_POOLING.get(kind, "unknown") if isinstance(kind, int) else None
    return key, Facts(_parts_size(path, values, st.st_size), st.st_mtime, fmt, pooling)


def _parts_size(path: str, values: dict, size: int) -> int:
    """A split GGUF's size is its parts' together (the first part holds the metadata only)."""
    from ridge.quant.gguf_header import Header, HeaderError, split_parts

    try:
        parts = split_parts(path, Header(0, 0, 0, 0, values))
    except HeaderError:
        return size
    return sum(p.stat().st_size for p in parts if p.is_file())


def _tree(d: Path) -> tuple[int, float]:
    size, newest, seen = 0, 0.0, 0
    for top, _, files in os.walk(d):
        for name in files:
            seen += 1
            if seen > MAX_TREE:
                return size, newest
            try:
                st = os.stat(os.path.join(top, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                size, newest = size + st.st_size, max(newest, st.st_mtime)
    return size, newest


def _json(p: Path):
    from ridge.quant.gguf_header import open_regular

    fd, st = open_regular(p)
    try:
        if st.st_size > MAX_JSON:
            raise ValueError(f"{p.name}: {st.st_size} bytes (the bound is {MAX_JSON})")
        return json.loads(os.read(fd, MAX_JSON))
    finally:
        os.close(fd)


def _sentence_transformers(d: Path) -> str | None:
    """An HF directory's pooling as ridge.engine.pooling reads it at load, with bounded reads: a
    sentence-transformers Pooling module's one mode, or None."""
    from ridge.engine.pooling import ST_MODES

    if not (d / "modules.json").exists():
        return None
    mods = _json(d / "modules.json")
    pool = next((m for m in mods if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")), None)
    if pool is None:
        return None
    cfg = _json(d / str(pool.get("path", "1_Pooling")) / "config.json")
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(on) != 1 or on[0] not in ST_MODES:
        raise ValueError(f"pooling {', '.join(on) or 'none'}")
    return ST_MODES[on[0]]
