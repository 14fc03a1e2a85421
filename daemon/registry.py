"""The models a daemon can serve, by name (issue 28): the files and directories of its models
directory, the `[models.NAME]` tables of config.toml, and the model it started with (the
embedded SmolLM2 or `--model`), which a request naming no model gets.

Plain data: names, paths, per-model options and durations. Loading them is daemon/models.py's."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ridge.engine.config import engine_options

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


def scan(models_dir: Path) -> dict[str, Entry]:
    """The models in the models directory, by name; a missing directory holds none."""
    out: dict[str, Entry] = {}
    try:
        items = sorted(models_dir.iterdir())
    except OSError:
        return out
    for p in items:
        name = _model_name(p)
        if name is not None and name not in out:
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
