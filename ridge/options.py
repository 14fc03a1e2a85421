"""One option, declared once, with all its spellings: the flag `--max-queue`, the
variable RIDGE_MAX_QUEUE and the config-file key `max_queue`.

The engine declares its options as EngineConfig fields (ridge/engine/config.py)
and `options_of` reads them from there; the daemon lists its own
(daemon/cli/config.py). Everything else, argparse flags, environment
variables, the config file, `--print-config` and the config built from parsed
values, is generated from these."""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
AUTO = "auto"  # a bool option's third value: leave the choice to the code (None)


@dataclass(frozen=True)
class Option:
    name: str  # the config-file key; the flag is --name-with-dashes, the variable RIDGE_NAME
    kind: type  # str, int, float, bool, or list (of strings: a TOML list, or comma-separated words)
    default: object
    help: str
    choices: tuple | None = None
    example: object = None  # shown in the default config file for an option that is unset by default
    field: str | None = None  # the config field it fills, where that is not `name` (threads -> num_threads)
    negate: bool = False  # a switch that turns its field off (--no-prefix-caching: enable_prefix_caching=False)
    per_model: bool = False  # a daemon's [models.NAME] table may set it for that model's engine (registry.py)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "RIDGE_" + self.name.upper()

    @property
    def auto(self) -> bool:
        """A bool whose default is None (decided by the code): on, off or auto."""
        return self.kind is bool and self.default is None

    def convert(self, raw, where: str):
        """A flag's, variable's or file's value -> this option's value; ValueError names `where`."""
        if raw is None:
            return None
        try:
            value = self._convert(raw)
        except (TypeError, ValueError):
            kind = "on, off or auto" if self.auto else _KIND_WORDS.get(self.kind, self.kind.__name__)
            raise ValueError(f"{where}: {self.name} must be {kind}, got {raw!r}") from None
        if self.choices and value not in self.choices:
            raise ValueError(f"{where}: {self.name} must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        return value

    def _convert(self, raw):
        if self.kind is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if self.auto and s == AUTO:
                return None
            if s in _TRUE | _FALSE:
                return s in _TRUE
            raise ValueError(raw)
        if self.kind is int and isinstance(raw, (bool, float)):
            raise ValueError(raw)
        if self.kind is list:
            return _words(raw)
        return self.kind(raw)

    def add_to(self, p, given_only: bool = False) -> None:
        """This option as an argparse flag. given_only: its default is None, so that a
        flag not given can fall through to the variable and the file (`ridge serve`)."""
        default = None if given_only else self.default
        if self.kind is bool and not self.auto:
            p.add_argument(self.flag, action="store_true", default=default, help=self.help)
        elif self.auto:  # kept as typed (on/off/auto); convert() reads it
            p.add_argument(self.flag, type=str.lower, choices=("on", "off", AUTO), default=default,
                           help=f"{self.help} (default: auto)")
        else:
            shown = "" if self.default is None else f" (default: {self.default})"
            kind = str if self.kind is list else self.kind  # a list's flag takes comma-separated words
            p.add_argument(self.flag, type=kind, choices=self.choices, default=default, help=self.help + shown)

    def argv(self, value) -> list[str]:
        """The command-line words that set `value` ([] for the default)."""
        value = self.convert(value, self.flag)
        if value is None or value == self.default:
            return []
        if self.kind is bool and not self.auto:
            return [self.flag] if value else []
        if self.auto:
            return [self.flag, "on" if value else "off"]
        return [self.flag, ",".join(value) if self.kind is list else str(value)]

    def toml(self, value) -> str:
        if value is None:
            return f'"{AUTO}"' if self.auto else '""'
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return repr(value)
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(map(self.toml, value)) + "]"
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


_KIND_WORDS = {list: "a list of strings (or one comma-separated string)"}

# How FP8 weights are made at conversion (quant/recipe.py). The engine's --fp8-recipe
# (EngineConfig.fp8_recipe: serve, generate, bench) takes its help from this; where none is
# given, quant/convert.py reads RIDGE_FP8_RECIPE, else this default.
FP8_RECIPE = Option("fp8_recipe", str, "device",
                    "FP8 weights: a recipe spec (channel | g128 | g64 | g32 | g16 | b128, then +gptq for "
                    "error-compensating rounding on ridge's calibration text or +act for the scale search weighted by "
                    "its inputs, +head for the LM head in FP8 too (as llama.cpp's Q8_0 files hold it), "
                    "+bf16:<layer>.<qkv|o|gate_up|down>,... for weights kept in bf16), auto: the fewest bytes within the KL budget on the "
                    "calibration text, or device: g16+act on CPU, channel on CUDA (docs/benchmarks.md)")


def _words(raw) -> tuple[str, ...]:
    """A list option's value: a TOML list of strings, or one string of comma-separated words."""
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)) or not all(isinstance(w, str) for w in items):
        raise ValueError(raw)
    return tuple(w.strip() for w in items if w.strip())


def options_of(cls) -> list[Option]:
    """The options a config dataclass declares: each field with a "help" in its
    metadata, optionally "flag" (where the flag is not --field-name), "choices",
    "example" and "per_model" (what one engine of a daemon's models may set). A bool field that defaults to True becomes a switch that turns it off,
    the only way a flag can change it."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue  # set by code, not by users
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        name = meta.get("flag", "--" + f.name).removeprefix("--").replace("-", "_")
        negate = kind is bool and f.default is True
        out.append(Option(name, kind, False if negate else f.default, meta["help"], meta.get("choices"),
                          meta.get("example"), None if name == f.name else f.name, negate,
                          meta.get("per_model", False)))
    return out


def fill(cls, options: list[Option], values):
    """An instance of cls from option values (a dict, or an argparse namespace); options
    missing from values keep the field's default."""
    values = values if isinstance(values, dict) else vars(values)
    kw = {}
    for o in options:
        v = o.convert(values.get(o.name), o.flag)
        if v is None and (o.negate or o.name not in values):
            continue  # not given: the field's own default
        kw[o.field or o.name] = (not v) if o.negate else v
    return cls(**kw)


def add_options(p: argparse.ArgumentParser, options: list[Option], given_only: bool = False) -> None:
    for o in options:
        o.add_to(p, given_only)
