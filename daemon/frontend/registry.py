"""The models a daemon can serve, by name (issue 28): the files and directories of its models
directory, the `[models.NAME]` tables of config.toml, and the model it started with (the
embedded SmolLM2 or `--model`), which a request naming no model gets.

Plain data, and torch-free: names, paths, durations (ridge/durations.py) and the engine options a
[models.NAME] table may set, those declared per_model (ridge/engine/config.py). Loading them is
models.py's."""
from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ridge.durations import parse_duration
from ridge.engine.config import engine_options
from ridge.quant.gguf_header import SPLIT_NAME

from ..pull import default_models_dir  # noqa: F401  where `ridge pull` puts models too: declared there, torch-free

log = logging.getLogger("ridge.daemon.models")

# The engine options a [models.NAME] table may set (declared per_model on the options themselves,
# ridge/engine/config.py): what one engine is built with. The daemon-wide ones (threads, devices,
# the KV tiers' places) stay the daemon's.
PER_MODEL = {o.name: o for o in engine_options() if o.per_model}
ENTRY_KEYS = ("path", "keep_alive", *PER_MODEL)
_QUANT_TAG = re.compile(r"[.\-_](?:I?Q\d\w*|B?F16|F32|FP8)$", re.IGNORECASE)


def served_name(model: dict) -> str:
    """A GGUF's file name is the name people know it by (SmolLM2-135M-Instruct.Q4_1.gguf ->
    SmolLM2-135M-Instruct); its general.name is often a converter's rendering of it ("Smollm2
    135M 8k Lc100K Mix1 Ep2"). Other models keep the name the engine read."""
    path = Path(model.get("path") or "")
    if path.suffix.lower() == ".gguf":
        stem = m[1] if (m := SPLIT_NAME.match(path.name)) else path.stem  # a split GGUF: its parts' prefix
        return _QUANT_TAG.sub("", stem) or model["name"]
    return model["name"]


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
            if SPLIT_NAME.match(p.name):  # a split GGUF's first part: its parts' size together
                from ridge.quant.gguf_header import HeaderError, split_parts
                try:
                    return sum(q.stat().st_size for q in split_parts(p) if q.is_file()), st.st_mtime, "gguf"
                except HeaderError:
                    pass
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
        if (m := SPLIT_NAME.match(p.name)) and int(m[2]) != 1:
            return None  # a later part of a split GGUF: served as its first part
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
        opts = {k: PER_MODEL[k].convert(v, at) for k, v in spec.items() if k in PER_MODEL}
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
