"""Shared pieces of the `ridge top` tests: the screen as text, waiting on the
app under the pilot, and the recorded stats frames. No tests here."""
from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

from rich.console import Console

from ridge.tui import feed

DATA = Path(__file__).resolve().parent / "data"
FRAMES = DATA / "top_frames.msgpack"  # recorded from `ridge serve` (SmolLM2, CPU, ngram) under load


def recorded_frames() -> list[feed.Frame]:
    """The fixture, through the daemon's own protocol decoder (ridge.daemon.protocol.unpack)."""
    return list(feed.replay(FRAMES))


def screen_text(app) -> str:
    """What the terminal shows, as plain text (the same render export_screenshot() makes)."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor", record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


def widget_text(app, selector: str) -> str:
    """A Static's content as plain text."""
    return str(app.query_one(selector).render())


async def until(pilot, cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}:\n{screen_text(pilot.app)}")
        await asyncio.sleep(0.05)
    await pilot.pause()
