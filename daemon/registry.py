"""The models a daemon can serve, by name (issue 28): the files and directories of its models
directory, the `[models.NAME]` tables of config.toml, and the model it started with (the
embedded SmolLM2 or `--model`), which a request naming no model gets.

Plain data: names, paths, per-model options and durations. Loading them is daemon/models.py's."""
from __future__ import annotations

import logging
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ridge.engine.config import engine_options

log = logging.getLogger("ridge.daemon.models")

FOREVER = math.inf  # keep_alive -1 (or any negative): never unloaded for idleness
# The engine options a [models.NAME] table may set: what one engine is built with. The daemon-wide
# ones (threads, devices, the KV tiers' places) stay the daemon's.
PER_MODEL = ("max_model_len", "kv_dtype", "block_size", "max_num_seqs", "prefill_chunk", "num_kv_blocks",
             "kv_memory_gib", "weights", "speculative", "num_speculative_tokens", "pooling", "cpu_weight_format",
             "no_prefix_caching")
ENTRY_KEYS = ("path", "keep_alive", *PER_MODEL)
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d)")


def parse_duration(value, where: str = "keep_alive") -> float:
    """A keep_alive: seconds as a number, or a duration as Ollama writes them ("5m", "1h30m",
    "90s", "-1"); a negative one is FOREVER, 0 unloads the model once its requests are done."""
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a duration (seconds, or e.g. \"5m\"), got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        s = value.strip().lower()
        try:
            seconds = float(s)
        except ValueError:
            sign = -1.0 if s.startswith("-") else 1.0
            body = s.lstrip("+-")
            parts = _PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"{where} must be a duration (seconds, or e.g. \"5m\", \"1h30m\"), "
                                 f"got {value!r}") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise ValueError(f"{where} must be a duration (seconds, or e.g. \"5m\"), got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"{where} must be finite (a negative one keeps the model loaded), got {value!r}")
    return FOREVER if seconds < 0 else seconds


def wire_duration(seconds: float) -> float:
    """A keep_alive as the protocol carries it: seconds, -1 for forever."""
    return -1 if seconds == FOREVER else seconds


def default_models_dir(environ=os.environ) -> Path:
    base = environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "ridge" / "models"


@dataclass
class Entry:
    name: str
    path: str | None  # None: the embedded model
    options: dict = field(default_factory=dict)  # engine option name -> value, over the daemon's
    keep: float | None = None  # its keep_alive; None: the daemon's
    source: str = "dir"  # dir | config | default

    def disk(self) -> tuple[int, float, str]:
        """(bytes on disk, modification time, format) of its file or directory."""
        from ridge.quant.source import resolve_model_path

        try:
            p = resolve_model_path(self.path)
            if p.is_dir():
                files = [f for f in p.rglob("*") if f.is_file()]
                return sum(f.stat().st_size for f in files), max((f.stat().st_mtime for f in files), default=0.0), \
                    "safetensors"
            st = p.stat()
            return st.st_size, st.st_mtime, p.suffix.lstrip(".").lower() or "file"
        except (OSError, ValueError):
            return 0, 0.0, "missing"


def _model_name(p: Path) -> str | None:
    """A models directory's entry -> the name it is served by (None: not a model). A GGUF file
    keeps its stem without the quantization tag, as `ridge serve` names it."""
    if p.name.startswith("."):
        return None
    if p.is_dir():
        return p.name if (p / "config.json").is_file() else None
    if p.suffix.lower() == ".gguf":
        from .serve import served_name
        return served_name({"path": str(p), "name": p.stem})
    return None


# The models directory is read on every request (a model copied in is served at once): bounded,
# so that a directory of a million files costs the socket thread no more than these lookups.
MAX_SCAN = 1000  # entries of the models directory looked at
MAX_TREE = 4096  # files and folders of one HF directory checked


def _others_write(st: os.stat_result) -> str | None:
    """Why someone other than the daemon's user (and root) can change it, or None. Group write is
    trusted only for the daemon's own group: that is how a service shares its directory."""
    if st.st_mode & 0o002:
        return "writable by every user"
    if st.st_mode & 0o020 and st.st_gid != os.getegid():
        return f"writable by group {st.st_gid}, not the daemon's"
    return None


def dir_refusal(models_dir: Path) -> str | None:
    """Why the models directory itself is not trusted (then none of it is served), or None. Whoever
    can write it chooses what the daemon reads and serves to every client: only the daemon's user,
    root, and the daemon's group may."""
    st = os.stat(models_dir)
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, neither the daemon's user nor root"
    return _others_write(st)


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def entry_refusal(p: Path, root: str) -> str | None:
    """Why an entry of the models directory is not served, or None. root: the directory, resolved.
    A link may point within the directory only: one leaving it would have the daemon read (and
    serve) a file its writer cannot; anything but regular files and folders is refused, a FIFO
    named x.gguf would block whoever opened it."""
    real = os.path.realpath(p)
    if not _inside(real, root):
        return f"it leads outside the models directory (to {real})"
    st = os.stat(real)
    if stat.S_ISREG(st.st_mode):
        return _others_write(st)
    if not stat.S_ISDIR(st.st_mode):
        return "not a regular file"
    if why := _others_write(st):
        return why
    seen = 0
    for top, dirs, files in os.walk(real, followlinks=True):  # an HF directory: all the loader may open
        for name in dirs + files:
            seen += 1
            if seen > MAX_TREE:
                return f"more than {MAX_TREE} files"
            f = os.path.join(top, name)
            target = os.path.realpath(f)
            if not _inside(target, root):
                return f"{os.path.relpath(f, real)} leads outside the models directory (to {target})"
            try:
                fst = os.stat(target)
            except OSError:
                return f"{os.path.relpath(f, real)}: a dangling link"
            if not (stat.S_ISREG(fst.st_mode) or stat.S_ISDIR(fst.st_mode)):
                return f"{os.path.relpath(f, real)} is not a regular file"
            if why := _others_write(fst):
                return f"{os.path.relpath(f, real)} is {why}"
    return None


_told: set = set()


def _refuse(what, why: str) -> None:
    """Logged once per entry and reason: the directory is read again on every request."""
    if (str(what), why) not in _told:
        if len(_told) > 10000:
            _told.clear()
        _told.add((str(what), why))
        log.warning("not serving %s: %s", what, why)


def scan(models_dir: Path) -> dict[str, Entry]:
    """The models in the models directory, by name; a missing directory holds none, nor one others
    can write (dir_refusal), and an entry entry_refusal refuses is left out with its reason logged."""
    out: dict[str, Entry] = {}
    try:
        if why := dir_refusal(models_dir):
            _refuse(f"the models directory {models_dir}", why)
            return out
        root = os.path.realpath(models_dir)
        with os.scandir(models_dir) as it:
            items = []
            for i, d in enumerate(it):
                if i >= MAX_SCAN:
                    _refuse(f"the models directory {models_dir}", f"entries past the first {MAX_SCAN}")
                    break
                items.append(Path(d.path))
    except OSError:
        return out
    for p in sorted(items):
        try:
            name = _model_name(p)
            if name is None or name in out:
                continue
            if why := entry_refusal(p, root):
                _refuse(p, why)
                continue
        except OSError as e:
            _refuse(p, e.strerror or str(e))
            continue
        out[name] = Entry(name, str(p))
    return out


def config_entries(table, where: str, models_dir: Path) -> dict[str, Entry]:
    """config.toml's [models.NAME] tables: `path` (relative to the models directory, or
    absolute), keep_alive and the per-model engine options (PER_MODEL)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: models must be a table of [models.NAME] tables")
    options = {o.name: o for o in engine_options()}
    out = {}
    for name, spec in table.items():
        at = f"{where}: [models.{name}]"
        if not isinstance(spec, dict):
            raise ValueError(f"{at} must be a table with a path")
        if unknown := sorted(set(spec) - set(ENTRY_KEYS)):
            raise ValueError(f"{at}: unknown key(s) {', '.join(unknown)}; a model takes {', '.join(ENTRY_KEYS)}")
        if not isinstance(spec.get("path"), str) or not spec["path"]:
            raise ValueError(f"{at}: path (a GGUF file or an HF directory) is required")
        path = Path(os.path.expanduser(spec["path"]))
        opts = {k: options[k].convert(v, at) for k, v in spec.items() if k in PER_MODEL}
        keep = parse_duration(spec["keep_alive"], f"{at} keep_alive") if "keep_alive" in spec else None
        out[name] = Entry(name, str(path if path.is_absolute() else models_dir / path), opts, keep, "config")
    return out


class Registry:
    """Every model by name: the default first, then config.toml's, then the directory's (a
    config entry of the same name wins: it says how to run that file)."""

    def __init__(self, default: Entry, models_dir: Path, table: dict | None = None, where: str = "config.toml"):
        self.default, self.models_dir = default, models_dir
        self._table, self._where = table or {}, where
        self.configured = config_entries(self._table, where, models_dir)  # checked once, at start

    def entries(self) -> dict[str, Entry]:
        """Read again on each call: a model copied into the directory is served without a restart."""
        out = {self.default.name: self.default}
        for name, e in {**scan(self.models_dir), **self.configured}.items():
            out.setdefault(name, e)
        return out

    def find(self, name: str | None) -> Entry | None:
        """A request's `model` -> its entry; None or "" is the default. A daemon that knows no other
        model answers any name with the default, as it did before it had a registry: clients that
        send a fixed name (OpenAI's SDKs need one) keep working. Else an unknown name is None."""
        if not name or name == self.default.name:
            return self.default
        entries = self.entries()
        if name in entries:
            return entries[name]
        return self.default if len(entries) == 1 else None
