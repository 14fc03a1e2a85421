"""`ridge top`'s layout as SVG snapshots at 80x24 and 200x50, fed with stats
frames recorded from a real daemon (tests/data/top_frames.msgpack, decoded by
ridge.daemon.protocol). Deterministic: fixed sizes and data, the daemon's clock,
no socket, no wall clock on screen.

Update after an intended change: RIDGE_UPDATE_SNAPSHOTS=1 pytest tests/test_tui_snapshots.py
Each snapshot has a .txt twin (the screen as text). With the textual and rich
versions the SVGs were made with (snapshots/VERSIONS), the SVG must match byte
for byte; with others (colours and SVG markup may change between releases), the
text must."""
from __future__ import annotations

import asyncio
import difflib
import os
from importlib.metadata import version
from pathlib import Path

import pytest

from ridge.tui.app import TopApp
from ridge.tui.screens import HelpScreen, RequestScreen
from test_tui_harness import recorded_frames, screen_text

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
UPDATE = os.environ.get("RIDGE_UPDATE_SNAPSHOTS") == "1"
VERSIONS = f"textual {version('textual')}\nrich {version('rich')}\n"


async def _shoot(size: tuple[int, int], keys: tuple[str, ...]) -> tuple[str, str, TopApp, object]:
    """-> (SVG, text, the app, the screen on top)."""
    app = TopApp(replay=recorded_frames(), replay_name="tests/data/top_frames.msgpack")
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        for key in keys:
            await pilot.press(key)
            await pilot.pause()
        return app.export_screenshot(title="ridge top"), screen_text(app), app, app.screen


def _compare(name: str, svg: str, text: str) -> None:
    svg_path, txt_path = SNAPSHOTS / f"{name}.svg", SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        svg_path.write_text(svg)
        txt_path.write_text(text)
        (SNAPSHOTS / "VERSIONS").write_text(VERSIONS)
        return
    assert txt_path.exists(), f"no snapshot {txt_path}; run with RIDGE_UPDATE_SNAPSHOTS=1"
    want = txt_path.read_text()
    if text != want:
        diff = "\n".join(difflib.unified_diff(want.splitlines(), text.splitlines(), "snapshot", "now", lineterm=""))
        pytest.fail(f"{name}: the screen changed:\n{diff}")
    if (SNAPSHOTS / "VERSIONS").read_text() == VERSIONS:
        assert svg == svg_path.read_text(), f"{name}: same text, different SVG (colours or styles changed)"


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
def test_layout_snapshot(size):
    svg, text, app, _ = asyncio.run(_shoot(size, ()))
    _compare(f"top_{size[0]}x{size[1]}", svg, text)
    # the recording's last frame is what the panels show
    last = recorded_frames()[-1].reply
    assert app.shown_seq == last["seq"]
    st = last["stats"]
    assert f"used {st['kv_blocks_used']} " in text and f"free {st['kv_blocks_free']}/{st['kv_blocks_total']}" in text


def test_help_snapshot_80x24():
    svg, text, _, screen = asyncio.run(_shoot((80, 24), ("question_mark",)))
    assert isinstance(screen, HelpScreen)
    _compare("top_help_80x24", svg, text)


def test_request_details_snapshot_80x24():
    svg, text, _, screen = asyncio.run(_shoot((80, 24), ("down", "enter")))
    assert isinstance(screen, RequestScreen)
    assert screen.request == recorded_frames()[-1].reply["stats"]["requests"][1]
    _compare("top_request_80x24", svg, text)
