"""`ridge top` with several models (issue 28): the loaded and loading ones, their memory and
the time until each unloads, from the snapshot's own clock (a replay shows what the live
screen did)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

from ridge.tui.app import TopApp
from ridge.tui.figures import model_line
from test_tui_harness import recorded_frames, widget_text

GIB = 1 << 30


def _models(now: float) -> list[dict]:
    return [{"name": "SmolLM2", "default": True, "state": "ready", "bytes": int(0.5 * GIB), "keep_alive": 300,
             "expires_at": now + 272.0, "requests": 0},
            {"name": "coder", "default": False, "state": "ready", "bytes": 3 * GIB, "keep_alive": -1,
             "expires_at": None, "requests": 2},
            {"name": "embed", "default": False, "state": "loading", "bytes": 0, "keep_alive": 300,
             "expires_at": None, "requests": 1, "elapsed": 2.5}]


def test_model_line_counts_from_the_snapshot_time():
    assert model_line(_models(1000.0), 1000.0) == "SmolLM2* 512M unloads in 4m32s · coder 3.00G kept · embed loading 2.5s"
    one = [{**_models(0.0)[0], "keep_alive": 60, "expires_at": None, "requests": 1}]
    assert model_line(one, 5.0) == "SmolLM2* 512M 1 req"


def _text(frames) -> str:
    async def run() -> str:
        app = TopApp(replay=frames)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            line = app.query_one("#request-models")
            return widget_text(app, "#request-models") if line.display else ""
    return asyncio.run(run())


def test_top_shows_the_models_and_when_each_unloads():
    frames = recorded_frames()  # it predates models: the snapshots (test_tui_snapshots.py) show no line
    last = frames[-1]
    reply = {**last.reply, "models": _models(float(last.reply["time"]))}
    shown = _text(frames[:-1] + [replace(last, reply=reply)])
    assert shown.startswith("models SmolLM2* 512M unloads in 4m32s · coder 3.00G kept · embed loading 2.5s")
