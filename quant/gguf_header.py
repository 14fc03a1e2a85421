"""A GGUF header read within bounds, before anything believes it.

The `gguf` package's reader maps the file and turns every key, array element and
tensor record it declares into numpy views: a header that declares a 2^40-element
array, or a 152K-token vocabulary, costs what it declares (gigabytes, tens of
seconds) before anything can say no. So a GGUF is first walked here: its counts
and lengths checked against the bounds below before each is read, nothing read
but the small scalar values, the whole walk limited in bytes and in time. A file
that fails is refused with the bound it broke; one that passes is what real
models look like (Gemma 3's 262K-token vocabulary is the largest array known).

Only a regular file is read: a FIFO, a device or a socket named *.gguf would
block the reader (or never end), so the file is opened without blocking and
checked with fstat before a byte is read."""
from __future__ import annotations

import os
import re
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

MAX_KV = 4096  # metadata keys; real models hold 20-60
MAX_TENSORS = 1 << 16  # a 671B MoE holds ~1,100 (its experts are stacked)
MAX_ARRAY = 1 << 21  # elements of one array: vocabularies and merges, 262K the largest seen
MAX_KEY = 1 << 16  # bytes of a key (GGUF's own limit)
MAX_STRING = 1 << 24  # bytes of one string value (chat templates run to ~100 KB)
MAX_HEADER_BYTES = 256 << 20  # the whole header: metadata and tensor records
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_SECONDS = 10.0  # the walk's wall time; a header within the bounds above takes well under a second
KEEP_STRING = 4096  # scalar strings longer than this are skipped, not kept
MAX_SPLITS = 1024  # parts of a split GGUF; the largest models ship in tens
# llama.cpp's gguf-split names: PREFIX-00001-of-00003.gguf (llama_split_path's "%s-%05d-of-%05d.gguf")
SPLIT_NAME = re.compile(r"^(.+)-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)

_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class HeaderError(ValueError):
    """The file is not a GGUF this reader accepts; the message names the bound or the fault."""


@dataclass
class Header:
    version: int
    tensor_count: int
    kv_count: int
    header_bytes: int  # where the tensor records end
    values: dict = field(default_factory=dict)  # key -> scalar value (numbers, bools, short strings)


def open_regular(path, flags: int = 0) -> tuple[int, os.stat_result]:
    """-> (fd, its fstat) of a regular file, opened without blocking; else OSError or HeaderError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HeaderError(f"{path}: not a regular file")
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def read_header(path, deadline_s: float = MAX_SECONDS) -> Header:
    fd, st = open_regular(path)
    try:
        return _Walk(fd, st.st_size, str(path), time.monotonic() + deadline_s).header()
    finally:
        os.close(fd)


class _Walk:
    """Read with pread through a window, not mmap: a file cut short while mapped would kill the
    process with SIGBUS, where a short read here is only a truncated header."""
    WINDOW = 1 << 20

    def __init__(self, fd: int, size: int, path: str, deadline: float):
        self.fd, self.path, self.deadline = fd, path, deadline
        self.size = size
        self.end = min(size, MAX_HEADER_BYTES)
        self.at = 0
        self.steps = 0
        self.buf, self.buf_at = b"", 0

    def fail(self, why: str):
        raise HeaderError(f"{self.path}: {why}")

    def take(self, n: int) -> int:
        """Advance over n bytes; -> where they start."""
        at = self.at
        if n < 0 or at + n > self.end:
            self.fail("truncated header" if self.end == self.size else
                      f"header larger than {MAX_HEADER_BYTES >> 20} MiB")
        self.at = at + n
        return at

    def read(self, n: int) -> bytes:
        at = self.take(n)
        if not (self.buf_at <= at and at + n <= self.buf_at + len(self.buf)):
            self.buf, self.buf_at = os.pread(self.fd, max(n, self.WINDOW), at), at
            if len(self.buf) < n:
                self.fail("truncated header")
        return self.buf[at - self.buf_at:at - self.buf_at + n]

    def unpack(self, fmt: str, n: int):
        return struct.unpack(fmt, self.read(n))[0]

    def tick(self) -> None:
        self.steps += 1
        if self.steps & 0xFFF == 0 and time.monotonic() > self.deadline:
            self.fail(f"header took more than {MAX_SECONDS:.0f} s to read")

    def string(self, limit: int, what: str, keep: bool) -> str | None:
        n = self.unpack("<Q", 8)
        if n > limit:
            self.fail(f"{what}: a string of {n} bytes (the bound is {limit})")
        if keep and n <= KEEP_STRING:
            return self.read(n).decode("utf-8", "replace")
        self.take(n)
        return None

    def skip_strings(self, n: int, key: str) -> None:
        """n strings passed over: only their lengths are read (a vocabulary's 150K of them)."""
        pos, end, unpack = self.at, self.end, struct.unpack_from
        buf, base = self.buf, self.buf_at
        for i in range(n):
            if pos + 8 > base + len(buf):
                if pos + 8 > end:
                    self.at = pos
                    self.take(8)  # fails: past the end
                buf, base = os.pread(self.fd, self.WINDOW, pos), pos
                self.buf, self.buf_at = buf, base
            length = unpack("<Q", buf, pos - base)[0]
            if length > MAX_STRING:
                self.fail(f"{key}: a string of {length} bytes (the bound is {MAX_STRING})")
            pos += 8 + length
            if pos > end:
                self.at = pos - 8 - length
                self.take(8 + length)  # fails: past the end
            if i & 0xFFF == 0xFFF and time.monotonic() > self.deadline:
                self.fail(f"header took more than {MAX_SECONDS:.0f} s to read")
        self.at = pos

    def value(self, kind: int, key: str, keep: bool):
        if kind in _FIXED:
            return self.unpack(_FORMAT[kind], _FIXED[kind])
        if kind == STRING:
            return self.string(MAX_STRING, key, keep)
        if kind == ARRAY:
            elem = self.unpack("<I", 4)
            n = self.unpack("<Q", 8)
            if n > MAX_ARRAY:
                self.fail(f"{key}: an array of {n} elements (the bound is {MAX_ARRAY})")
            if elem in _FIXED:
                self.take(n * _FIXED[elem])
            elif elem == STRING:
                self.skip_strings(n, key)
            else:  # arrays of arrays: no model uses them, and they would multiply the bounds
                self.fail(f"{key}: an array of type {elem}")
            return None
        self.fail(f"{key}: unknown value type {kind}")

    def header(self) -> Header:
        if self.size < 24 or self.read(4) != b"GGUF":
            self.fail("not a GGUF file (no GGUF magic)")
        version = self.unpack("<I", 4)
        if version not in (2, 3):
            self.fail(f"GGUF version {version}; ridge reads versions 2 and 3")
        tensors, kvs = self.unpack("<Q", 8), self.unpack("<Q", 8)
        if kvs > MAX_KV:
            self.fail(f"{kvs} metadata keys (the bound is {MAX_KV})")
        if tensors > MAX_TENSORS:
            self.fail(f"{tensors} tensors (the bound is {MAX_TENSORS})")
        values = {}
        for _ in range(kvs):
            self.tick()
            key = self.string(MAX_KEY, "a key", True) or "?"
            kind = self.unpack("<I", 4)
            v = self.value(kind, key, True)
            if v is not None:
                values[key] = v
        for _ in range(tensors):
            self.tick()
            self.string(MAX_KEY, "a tensor name", False)
            dims = self.unpack("<I", 4)
            if dims > MAX_DIMS:
                self.fail(f"a tensor of {dims} dimensions (the bound is {MAX_DIMS})")
            self.take(8 * dims + 4 + 8)
        return Header(version, tensors, kvs, self.at, values)


def split_parts(path, header: Header | None = None) -> list[Path]:
    """The files of the model whose first part `path` is, in order: llama.cpp's gguf-split layout,
    split.count parts named PREFIX-0000k-of-0000n.gguf side by side, the metadata in the first and
    the tensors spread over all. [path] for a GGUF that is not split. A later part given alone, or
    a name that disagrees with the count, is a HeaderError that names the first part."""
    values = (header or read_header(path)).values
    count, no = values.get("split.count", 1), values.get("split.no", 0)
    if not isinstance(count, int) or count <= 1:
        return [Path(path)]
    if count > MAX_SPLITS:
        raise HeaderError(f"{path}: split in {count} parts (the bound is {MAX_SPLITS})")
    m = SPLIT_NAME.match(Path(path).name)
    if not m or int(m[3]) != count:
        raise HeaderError(f"{path}: part of a GGUF split in {count}, not named as llama.cpp names the parts "
                          f"(PREFIX-00001-of-{count:05d}.gguf)")
    if no != 0 or int(m[2]) != 1:
        raise HeaderError(f"{path}: part {no + 1} of a GGUF split in {count}; give its first part, "
                          f"{m[1]}-00001-of-{count:05d}.gguf")
    return [Path(path).with_name(f"{m[1]}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
