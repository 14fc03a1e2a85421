"""The pipe a worker thread pokes to wake the socket thread's poll (the engine thread's
outputs, daemon/frontend/engine_loop.py; admission results, daemon/frontend/admission.py)."""
from __future__ import annotations

import os


def wake_pipe() -> tuple[int, int]:
    """-> (read end, write end), both non-blocking: a poke never waits, a drain never blocks."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def poke(w: int) -> None:
    try:
        os.write(w, b"\0")
    except BlockingIOError:  # the pipe is full: a wake-up is already pending
        pass


def drain(r: int) -> None:
    try:
        os.read(r, 1 << 16)
    except BlockingIOError:
        pass
