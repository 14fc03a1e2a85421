"""On-disk cache of converted models, so a second start skips parsing and quantization.

The key is the source's path, size and modification time plus the quantizer's
version and options: hashing a many-GB file on every start would defeat it.

So every new file, and every change of one, is a new entry of the size of its
weights: each save prunes the cache (prune): entries whose source file is gone,
then the least recently used (a hit touches its folder) while the cache holds
more than RIDGE_MODEL_CACHE_GIB (64 GiB; 0: no cap). The entry just written is
kept whatever its size."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import time

import torch

from ridge.options import Option

from .fp8 import QUANT_VERSION

CACHE_GIB = Option("model_cache_gib", float, 64.0,
                   "the converted-weights cache's size cap in GiB ($XDG_CACHE_HOME/ridge/models), least recently "
                   "used entries removed past it; 0: no cap")
STALE_TMP_S = 3600  # a save's temporary folder this old is a crashed save's
FORMAT = 3  # 2: ModelConfig gained the per-family fields (issue 25); 3: the weights in shards (Entry)
SHARD = "weights-{:05d}.safetensors"
MAPPED_MIN_BYTES = 1 << 20  # a cached tensor this large is read by memory map, a smaller one copied


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ridge" / "models"


def _fingerprint(src: Path) -> list:
    files = _files(src) if src.is_file() else sorted(p for p in src.iterdir() if p.is_file())
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _files(src: Path) -> list[Path]:
    """A file and, for the first part of a split GGUF, its other parts: a change to any is a new model."""
    if src.suffix.lower() != ".gguf":
        return [src]
    from .gguf_header import HeaderError, split_parts
    try:
        return [p for p in split_parts(src) if p.exists()]  # a missing part: the loader names it
    except (OSError, HeaderError):
        return [src]  # the loader refuses it, with the reason


def cache_key(src: Path, options: dict) -> str:
    blob = json.dumps({"src": _fingerprint(src), "quant": QUANT_VERSION, "format": FORMAT, "options": options},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def load(key: str, copy_below: int = MAPPED_MIN_BYTES) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """-> (meta, tensors) or None on a miss or an unreadable entry. The tensors of copy_below bytes
    or more are the shards' memory maps (copy-on-write): nothing is read until used, and a page once
    used is the page cache's, so loading holds no second copy of the weights."""
    from safetensors import safe_open

    d = cache_root() / key
    try:
        meta = json.loads((d / "meta.json").read_text())
        tensors: dict[str, torch.Tensor] = {}
        for n in range(meta["shards"]):
            with safe_open(str(d / SHARD.format(n)), framework="pt") as st:
                for name in st.keys():
                    t = st.get_tensor(name)
                    # Every tensor of a shard is a view of its one mapping, and a norm or a scale the
                    # model keeps as it is would keep the whole shard mapped (its pages counted as
                    # the process's): the small ones are copied out, the weights stay views.
                    tensors[name] = t.clone() if t.nbytes < copy_below else t
        out = meta, tensors
    except Exception:  # OSError, bad JSON, a truncated or foreign shard: a miss
        return None
    try:
        os.utime(d)  # used now: the last to be pruned
    except OSError:
        pass
    return out


class Entry:
    """An entry written a shard at a time (add: one layer's tensors, say), so that a conversion
    never holds the whole converted model to save it; commit() makes it visible by a rename,
    so a crash never leaves half an entry."""

    def __init__(self, key: str):
        self.key, self.root = key, cache_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".tmp-"))
        self.shards = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        seen: set[int] = set()
        flat = {}
        for name, t in tensors.items():  # safetensors refuses shared storage
            ptr = t.untyped_storage().data_ptr()
            flat[name] = t.contiguous().clone() if ptr in seen else t.contiguous()
            seen.add(ptr)
        save_file(flat, str(self.tmp / SHARD.format(self.shards)))
        self.shards += 1

    def commit(self, meta: dict) -> Path:
        try:
            (self.tmp / "meta.json").write_text(json.dumps({**meta, "shards": self.shards}))
            (self.tmp / "source").write_text(str(meta.get("source", "")))  # what prune() checks, without meta.json
            final = self.root / self.key
            shutil.rmtree(final, ignore_errors=True)
            os.replace(self.tmp, final)
        finally:
            self.abort()
        prune(keep=self.key)
        return final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def save(key: str, meta: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """The whole entry at once: one shard."""
    entry = Entry(key)
    try:
        entry.add(tensors)
    except BaseException:
        entry.abort()
        raise
    return entry.commit(meta)


def cap_bytes() -> int | None:
    gib = CACHE_GIB.convert(os.environ.get(CACHE_GIB.env), CACHE_GIB.env)
    gib = CACHE_GIB.default if gib is None else gib
    return None if gib <= 0 else int(gib * (1 << 30))


def _source(d: Path) -> str | None:
    try:
        return (d / "source").read_text()
    except OSError:  # an entry from before the source file: its meta.json says
        try:
            return json.loads((d / "meta.json").read_text()).get("source")
        except (OSError, ValueError):
            return None


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def prune(keep: str | None = None, cap: int | None = -1) -> list[str]:
    """Remove the entries whose source is gone, then the least recently used while the cache holds
    more than cap bytes (-1: cap_bytes(); None: no cap); never `keep`. -> the keys removed."""
    cap = cap_bytes() if cap == -1 else cap
    root = cache_root()
    removed, live = [], []
    try:
        items = list(root.iterdir())
    except OSError:
        return removed
    now = time.time()
    for d in items:
        try:
            st = d.stat()
            if d.name.startswith(".tmp-"):
                if now - st.st_mtime > STALE_TMP_S:
                    shutil.rmtree(d, ignore_errors=True)
                continue
            if not d.is_dir() or d.name == keep:
                continue
            src = _source(d)
            if src is None or not os.path.exists(src):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
                continue
            live.append((st.st_mtime, d, _size(d)))
        except OSError:
            continue
    if cap is not None:
        total = sum(n for _, _, n in live) + (_size(root / keep) if keep and (root / keep).is_dir() else 0)
        for _, d, n in sorted(live, key=lambda x: x[0]):
            if total <= cap:
                break
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
            total -= n
    return removed
