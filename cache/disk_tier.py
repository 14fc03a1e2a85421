"""The disk tier: one checksummed file per KV block, under

    $XDG_CACHE_HOME/ridge/kv/<key>/<first two hex digits>/<block hash, 16 hex>.kvb

where the key names everything the bytes depend on (the model's identity, its
quantizer version, the KV dtype, the block size; Tiers.disk_key), so no model
ever reads another's blocks. A file is

    header (magic, version, block hash, parent hash, token count, payload bytes)
    | the block's token ids (int32) | payload (one block row, block_io.py) | crc32 of all before

Written to a temporary name and renamed, so a reader sees a whole file or none.
Read back only if the header names the block asked for (its hash, its parent's
hash and its very tokens) and the checksum matches; anything else (truncated,
bit-flipped, another block) is deleted with a warning and is a miss. A full disk or
any other I/O error turns the tier off with a warning; serving goes on.

The index (hash -> file size, least recently used first) is rebuilt at start from
the directory listing, ordered by modification time (a hit touches its file), so
it survives kill -9 and is never more than a list of files to try."""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

log = logging.getLogger("ridge.cache")

MAGIC, VERSION = b"RKVB", 1
HEADER = struct.Struct("<4sIqqII")  # magic, version, block hash, parent hash, tokens, payload bytes
CRC = struct.Struct("<I")
SUFFIX = ".kvb"
MASK = (1 << 64) - 1


def kv_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ridge" / "kv"


def _name(block_hash: int) -> str:
    return f"{block_hash & MASK:016x}"


def _hash(name: str) -> int:
    h = int(name, 16)
    return h - (1 << 64) if h >= 1 << 63 else h


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's
    return True


class DiskTier:
    def __init__(self, root: Path, key: str, describe: dict, cap_bytes: int, block_bytes: int):
        self.dir = Path(root) / key
        self.cap_bytes, self.block_bytes = cap_bytes, block_bytes
        self.index: OrderedDict[int, int] = OrderedDict()
        self.used_bytes = 0
        self.lock = threading.Lock()
        self.enabled, self.off_reason = True, ""
        self.bytes_read = self.bytes_written = self.corrupt = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            about = self.dir / "key.json"
            if not about.exists():
                about.write_text(json.dumps(describe, indent=1, sort_keys=True))
            self._scan()
        except OSError as e:
            self._off(f"cannot use {self.dir}: {e}")

    # -- the index --------------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        for sub in os.scandir(self.dir):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(SUFFIX) and len(e.name) == 16 + len(SUFFIX):
                    st = e.stat()
                    found.append((st.st_mtime_ns, _hash(e.name[:16]), st.st_size))
                elif e.name.startswith(".tmp-"):  # a writer killed mid-way, unless it still runs
                    pid = e.name.split("-")[1]
                    if not pid.isdigit() or not _pid_alive(int(pid)):
                        _remove(Path(e.path))
        for _, h, size in sorted(found):
            self.index[h] = size
            self.used_bytes += size
        self._unlink(self._over_cap())
        log.info("disk KV tier %s: %d blocks, %.1f MiB (cap %.1f MiB)", self.dir, len(self.index),
                 self.used_bytes / 2**20, self.cap_bytes / 2**20)

    def _over_cap(self) -> list[int]:
        """Drop least recently used entries down to the cap; -> their hashes (files to delete)."""
        out = []
        with self.lock:
            while self.used_bytes > self.cap_bytes and self.index:
                h, size = self.index.popitem(last=False)
                self.used_bytes -= size
                out.append(h)
        return out

    def _drop(self, block_hash: int) -> None:
        with self.lock:
            size = self.index.pop(block_hash, None)
            if size is not None:
                self.used_bytes -= size

    def _unlink(self, hashes: list[int]) -> None:
        for h in hashes:
            _remove(self.path(h))

    def _off(self, reason: str) -> None:
        if self.enabled:
            log.warning("disk KV tier off: %s", reason)
        self.enabled, self.off_reason = False, reason

    def path(self, block_hash: int) -> Path:
        n = _name(block_hash)
        return self.dir / n[:2] / (n + SUFFIX)

    def __contains__(self, block_hash: int) -> bool:
        return self.enabled and block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    # -- files ------------------------------------------------------------------------
    def _header(self, block_hash: int, parent: int, tokens) -> bytes:
        return (HEADER.pack(MAGIC, VERSION, block_hash, parent, len(tokens), self.block_bytes)
                + np.asarray(tokens, dtype="<i4").tobytes())

    def write(self, block_hash: int, parent: int, tokens, payload) -> bool:
        """payload: one block row (a C-contiguous buffer of block_bytes)."""
        if not self.enabled or block_hash in self.index:
            return False
        final = self.path(block_hash)
        tmp = final.parent / f".tmp-{os.getpid()}-{threading.get_ident()}-{_name(block_hash)}"
        head = self._header(block_hash, parent, tokens)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
                f.write(CRC.pack(zlib.crc32(payload, zlib.crc32(head))))
            os.replace(tmp, final)
        except OSError as e:
            _remove(tmp)
            self._off(f"writing {final}: {e}")
            return False
        size = len(head) + self.block_bytes + CRC.size
        with self.lock:
            self.index[block_hash] = size
            self.used_bytes += size
        self.bytes_written += size
        self._unlink(self._over_cap())
        return True

    def read(self, block_hash: int, parent: int, tokens, out: np.ndarray) -> bool:
        """Fill out (one block row) from the block's file; False on a miss. Only a file that
        names this very block and whose checksum matches is used."""
        if block_hash not in self:
            return False
        p = self.path(block_hash)
        head = self._header(block_hash, parent, tokens)
        try:
            with open(p, "rb") as f:
                ok = f.read(len(head)) == head and f.readinto(out) == self.block_bytes
                tail = f.read(CRC.size + 1)
        except FileNotFoundError:
            self._drop(block_hash)
            return False
        except OSError as e:
            self._off(f"reading {p}: {e}")
            return False
        if not (ok and len(tail) == CRC.size and CRC.unpack(tail)[0] == zlib.crc32(out, zlib.crc32(head))):
            log.warning("disk KV tier: %s is corrupt or truncated; deleted", p)
            self.corrupt += 1
            self._drop(block_hash)
            self._unlink([block_hash])
            return False
        with self.lock:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
        try:
            os.utime(p)  # the LRU order a restart rebuilds
        except OSError:
            pass
        self.bytes_read += len(head) + self.block_bytes + CRC.size
        return True
