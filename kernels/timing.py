"""An explicit timing hook for profilers (ridge bench profile), so that nothing
has to monkey-patch the engine. Code that wants its time attributed wraps the
work in `with section("name"):`; with no timer installed that is a shared
null context and costs about a tenth of a microsecond.

A timer is any callable name -> context manager. Sections nest (lm_head holds
a linear); a timer that wants exclusive times keeps its own stack."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

_NULL = nullcontext()
_TIMER: Callable[[str], ContextManager] | None = None


def set_timer(timer: Callable[[str], ContextManager] | None):
    """Install a timer (None removes it); -> the one it replaces."""
    global _TIMER
    previous, _TIMER = _TIMER, timer
    return previous


def section(name: str) -> ContextManager:
    return _NULL if _TIMER is None else _TIMER(name)
