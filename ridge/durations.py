"""A duration as people write one: seconds as a number, or Go's duration syntax as Ollama reads a
`keep_alive` ("5m", "1h30m", "90s", "250ms"), with days too ("1d"). One parser for every place a
keep_alive is read: config.toml's `keep_alive` and `[models.NAME]` tables, a request's field
(docs/protocol.md §3.10) and Ollama's API, so that a value means the same wherever it is given.

Shared and low-level (tests/test_layers.py): the torch-free gateway and the daemon's registry
both import it."""
from __future__ import annotations

import math
import re

FOREVER = math.inf  # a negative keep_alive (-1, "-5m"): never unloaded for idleness
# Go's units (time.ParseDuration: "µs" is U+00B5, "μs" U+03BC) and a day, which config.toml took
# before the gateway and the registry shared this parser.
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0,
          "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h|d)")


def parse_duration(value, where: str = "keep_alive") -> float:
    """A number of seconds, a numeric string ("2.5", "-1") or a duration ("5m", "1h30m", "-1s",
    "1d"), case-insensitive -> seconds; a negative one is FOREVER, 0 unloads a model once its
    requests are done. ValueError, naming `where`, for anything else (a bool, "5 minutes", NaN)."""
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a duration (seconds, or e.g. \"5m\"), got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        s = value.strip().lower()
        try:
            seconds = float(s)
        except ValueError:
            sign, body = (-1.0, s[1:]) if s.startswith("-") else (1.0, s.removeprefix("+"))
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
