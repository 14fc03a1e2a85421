"""The disk tier: one checksummed file per KV block, under

    $XDG_CACHE_HOME/ridge/kv/<key>/<first two hex digits>/<block hash, 32 hex>.kvb

where the key names everything the bytes depend on (the model's identity, its
quantizer version, the KV dtype, the block size; Tiers.disk_key), so no model
ever reads another's blocks. A file is

    header (magic, version, block hash, parent hash, token count, payload bytes)
    | the block's token ids (int32) | payload (one block row, block_io.py) | crc32 of all before

Written to a temporary name and renamed, so a reader sees a whole file or none.
Read back only if the header names the block asked for (its hash, its parent's
hash and its very tokens) and the checksum matches; anything else (truncated,
bit-flipped, another block) is deleted with a warning and is a miss.

The files hold every prompt's token ids: the tier's folders are 0700 and its
files 0600 whatever the umask, so only the daemon's user reads them. Beside the
blocks, `hash.key` (0600) keeps the key their hashes are made with
(block_hash.py), so that a restart finds them again. A full disk (ENOSPC,
EDQUOT) pauses the writes until there is room again, checked every `retry_s`;
any other I/O error turns the tier off with a warning; serving goes on.

The index (hash -> file size, least recently used first) is rebuilt at start from
the directory listing, ordered by modification time (a hit touches its file), so
it survives kill -9 and is never more than a list of files to try."""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .block_hash import DIGEST_BYTES, KEY_BYTES
from .private_files import DIR_MODE, FILE_MODE, load_key, make_dir, make_dirs, private, remove_quietly, write_private

log = logging.getLogger("ridge.cache")

MAGIC, VERSION = b"RKVB", 2
HEADER = struct.Struct(f"<4sI{DIGEST_BYTES}s{DIGEST_BYTES}sII")  # magic, version, hash, parent, tokens, payload bytes
CRC = struct.Struct("<I")
SUFFIX = ".kvb"
NAME_CHARS = 2 * DIGEST_BYTES
KEY_FILE = "hash.key"
FULL = (errno.ENOSPC, errno.EDQUOT)
RETRY_S = 30.0  # a paused tier looks for free space again after this long
RESUME_BLOCKS, RESUME_MIN_BYTES = 16, 64 << 20  # free space that resumes writes: the larger of the two
TURN_OFF = "--no-kv-disk (RIDGE_NO_KV_DISK=1, no_kv_disk = true)"


def kv_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ridge" / "kv"


def _name(block_hash: bytes) -> str:
    return block_hash.hex()


def _hash(name: str) -> bytes | None:
    try:
        return bytes.fromhex(name)
    except ValueError:  # not a block's file
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's
    return True


class DiskTier:
    def __init__(self, root: Path, key: str, describe: dict, cap_bytes: int, block_bytes: int,
                 retry_s: float = RETRY_S):
        self.dir = Path(root) / key
        self.cap_bytes, self.block_bytes, self.retry_s = cap_bytes, block_bytes, retry_s
        self.index: OrderedDict[bytes, int] = OrderedDict()
        self.used_bytes = 0
        self.lock = threading.Lock()
        self.enabled, self.off_reason = True, ""
        self.paused, self._retry_at = False, 0.0  # writes paused by a full disk, until _retry_at at least
        self.corrupt = 0
        self.hash_key: bytes | None = None
        try:
            make_dirs(self.dir)
            write_private(self.dir / "key.json", json.dumps(describe, indent=1, sort_keys=True).encode(),
                          exist_ok=True)
            self.hash_key, fresh = load_key(self.dir / KEY_FILE, KEY_BYTES)
            self._scan()
            if fresh and self.index:  # named under a key that is gone: never found again
                log.warning("disk KV tier: %s had no valid %s; its %d blocks are deleted", self.dir, KEY_FILE,
                            len(self.index))
                self._unlink(list(self.index))
                self.index.clear()
                self.used_bytes = 0
        except OSError as e:
            self._off(f"cannot use {self.dir}: {e}")
            return
        log.info("disk KV tier at %s: %d blocks, %.1f MiB (cap %.1f MiB); turn it off with %s", self.dir,
                 len(self.index), self.used_bytes / 2**20, self.cap_bytes / 2**20, TURN_OFF)

    # -- the index --------------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        for sub in os.scandir(self.dir):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            private(sub, DIR_MODE)
            for e in os.scandir(sub.path):
                h = _hash(e.name[:NAME_CHARS])
                if e.name.endswith(SUFFIX) and len(e.name) == NAME_CHARS + len(SUFFIX) and h is not None:
                    st = private(e, FILE_MODE)
                    found.append((st.st_mtime_ns, h, st.st_size))
                elif e.name.startswith(".tmp-"):  # a writer killed mid-way, unless it still runs
                    pid = e.name.split("-")[1]
                    if not pid.isdigit() or not _pid_alive(int(pid)):
                        remove_quietly(Path(e.path))
        for _, h, size in sorted(found):
            self.index[h] = size
            self.used_bytes += size
        self._unlink(self._over_cap())

    def _over_cap(self) -> list[bytes]:
        """Drop least recently used entries down to the cap; -> their hashes (files to delete)."""
        out = []
        with self.lock:
            while self.used_bytes > self.cap_bytes and self.index:
                h, size = self.index.popitem(last=False)
                self.used_bytes -= size
                out.append(h)
        return out

    def _drop(self, block_hash: bytes) -> None:
        with self.lock:
            size = self.index.pop(block_hash, None)
            if size is not None:
                self.used_bytes -= size

    def _unlink(self, hashes: list[bytes]) -> None:
        for h in hashes:
            remove_quietly(self.path(h))

    def _off(self, reason: str) -> None:
        if self.enabled:
            log.warning("disk KV tier off: %s", reason)
        self.enabled, self.off_reason = False, reason

    def path(self, block_hash: bytes) -> Path:
        n = _name(block_hash)
        return self.dir / n[:2] / (n + SUFFIX)

    def __contains__(self, block_hash: bytes) -> bool:
        return self.enabled and block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    # -- a full disk --------------------------------------------------------------------
    def _pause(self, what: str, e: OSError) -> None:
        self._retry_at = time.monotonic() + self.retry_s
        if not self.paused:
            log.warning("disk KV tier: %s: %s; writes paused until there is room (checked every %.0f s)",
                        what, e.strerror or e, self.retry_s)
        self.paused = True

    def _writable(self) -> bool:
        """False while a full disk pauses the writes; every retry_s, whether it has room again."""
        if not self.paused:
            return True
        now = time.monotonic()
        if now < self._retry_at:
            return False
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            free = 0
        if free < max(RESUME_MIN_BYTES, RESUME_BLOCKS * self.block_bytes):
            self._retry_at = now + self.retry_s
            return False
        log.info("disk KV tier: writes resumed (%.0f MiB free)", free / 2**20)
        self.paused = False
        return True

    # -- files ------------------------------------------------------------------------
    def _header(self, block_hash: bytes, parent: bytes, tokens) -> bytes:
        return (HEADER.pack(MAGIC, VERSION, block_hash, parent, len(tokens), self.block_bytes)
                # An image's placeholders stand as 62-bit ids of its content (engine/request.py
                # image_token_ids): their low 32 bits here, the keyed hash above names all of them.
                + (np.asarray(tokens, dtype=np.int64) & 0xFFFFFFFF).astype("<u4").tobytes())

    def write(self, block_hash: bytes, parent: bytes, tokens, payload) -> bool:
        """payload: one block row (a C-contiguous buffer of block_bytes)."""
        if not self.enabled or block_hash in self.index or not self._writable():
            return False
        final = self.path(block_hash)
        tmp = final.parent / f".tmp-{os.getpid()}-{threading.get_ident()}-{_name(block_hash)}"
        head = self._header(block_hash, parent, tokens)
        try:
            make_dir(final.parent)
            write_private(tmp, head, payload, CRC.pack(zlib.crc32(payload, zlib.crc32(head))))
            os.replace(tmp, final)
        except OSError as e:
            remove_quietly(tmp)
            if e.errno in FULL:
                self._pause(f"writing {final}", e)
            else:
                self._off(f"writing {final}: {e}")
            return False
        size = len(head) + self.block_bytes + CRC.size
        with self.lock:
            self.index[block_hash] = size
            self.used_bytes += size
        self._unlink(self._over_cap())
        return True

    def read(self, block_hash: bytes, parent: bytes, tokens, out: np.ndarray) -> bool:
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
            log.warning("disk KV tier: %s is corrupt, truncated or another block's; deleted", p)
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
        return True
