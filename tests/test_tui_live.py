"""`ridge top` under Textual's pilot against a real `ridge serve` (tiny GGUF
model, one engine thread, a temporary ipc endpoint): the panels show the
daemon's own figures, the keys work, and the dashboard rides out the daemon's
stop and restart. Tests run in file order on one daemon; the last restarts it."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from ridge.tui import figures as F
from ridge.tui.app import TopApp
from ridge.tui.panels import RequestsPanel
from ridge.tui.screens import HelpScreen, RequestScreen
from test_daemon_harness import ROOT, Daemon, Raw, stats, wait_idle
from test_tui_harness import screen_text, until, widget_text
from tiny_models import make_tiny

BLOCKS, MAX_SEQS = 96, 2
FLAGS = ("--num-kv-blocks", BLOCKS, "--max-num-seqs", MAX_SEQS, "--stats-interval", 0.1)
PROMPT = "the same words start every prompt here, so the prefix cache has something to share: "


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path, _, _ = make_tiny(tmp_path_factory.mktemp("model"), "llama")
    box = {"model": str(path), "tmp": tmp_path_factory.mktemp("daemon")}
    box["daemon"] = Daemon(box["tmp"], box["model"], *FLAGS)
    yield box
    box["daemon"].stop()


class Load:
    """Requests on one raw DEALER; pump() reads their frames and keeps the heartbeats going."""

    def __init__(self, endpoint: str, n: int, max_tokens: int):
        self.client = Raw(endpoint)
        for i in range(n):
            self.client.generate(f"g{i}", prompt=PROMPT + str(i), params={"max_tokens": max_tokens,
                                                                          "ignore_eos": True})

    def pump(self) -> bool:
        self.client.pump()
        return not self.client.open  # all final

    def close(self) -> None:
        self.client.close()


def table_rows(app) -> list[list[str]]:
    table = app.query_one("#request-table")
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def test_panels_show_the_daemons_figures(served):
    d = served["daemon"]

    async def scenario():
        app = TopApp(d.endpoint)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.connected and app.shown is not None, what="the first snapshot")
            first = app.shown["stats"]["totals"]
            loads = [Load(d.endpoint, 8, 160)]

            def busy() -> bool:  # two running (max-num-seqs), the rest waiting: freeze the screen on it
                st = app.shown["stats"]
                app.paused = st["running"] == MAX_SEQS and st["waiting"] > 0
                # On a loaded machine a load can run out between two snapshots the app drew: another.
                if loads[-1].pump() and not app.paused:
                    loads.append(Load(d.endpoint, 8, 160))
                return app.paused

            await until(pilot, busy, timeout=60, what="a busy snapshot")
            snap = app.shown["stats"]["requests"]  # the table is the snapshot's list
            assert [(r[0], r[1], r[3], r[4]) for r in table_rows(app)] == \
                [(x["id"], x["state"], str(x["prompt_tokens"]), str(x["output_tokens"])) for x in snap]
            counts = widget_text(app, "#request-counts")
            assert f"running {MAX_SEQS}" in counts and f"waiting {app.shown['stats']['waiting']}" in counts
            app.paused = False
            await until(pilot, lambda: all([x.pump() for x in loads]), timeout=90, what="the load to finish")
            for x in loads:
                x.close()
            await asyncio.to_thread(wait_idle, d.endpoint)
            ref = await asyncio.to_thread(stats, d.endpoint)
            await until(pilot, lambda: app.shown_seq > ref["seq"], what="a snapshot newer than the stats reply")

            st, want = app.shown["stats"], ref["stats"]
            for k in ("kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "kv_blocks_cached", "running",
                      "waiting", "totals", "prefix_hit_rate"):
                assert st[k] == want[k], k
            assert want["kv_blocks_cached"] > 0 and want["prefix_hit_rate"] > 0  # the shared prefix
            kv = widget_text(app, "#kv-blocks")
            assert kv == (f"■used {want['kv_blocks_used']} ■cached {want['kv_blocks_cached']} "
                          f"■free {want['kv_blocks_free']}/{want['kv_blocks_total']}")
            # the forecast: the tiny model's context is 256 tokens = 16 blocks of 16
            assert widget_text(app, "#forecast") == f"fits {want['kv_blocks_free'] // 16} more requests at 256 context"
            assert f"admitted {want['totals']['requests']}" in widget_text(app, "#request-counts")
            assert f"prefix hits {100 * want['prefix_hit_rate']:.1f}%" in widget_text(app, "#request-rates")
            assert "speculative off" in widget_text(app, "#request-rates")
            mem = want["memory"]
            assert f"KV {F.size(mem['kv_pool'])}" in widget_text(app, "#device-legend")
            assert f"weights {F.size(mem['weights'])}" in widget_text(app, "#device-legend")
            model = widget_text(app, "#model-info")
            assert "tiny-llama" in model and f"KV {ref['model']['kv_dtype']}" in model and f"{BLOCKS} blocks" in model
            assert f"ridge point {ref['model']['ridge_point']:.1f} FLOP/B" in model
            # tokens/s: every token the daemon counted since the first snapshot is in the 1-minute window
            prefill, decode = app.throughput.series(60)
            width = 60 / len(decode.points)
            assert sum(decode.points) * width == pytest.approx(want["totals"]["decode_tokens"] - first["decode_tokens"])
            assert sum(prefill.points) * width == pytest.approx(
                want["totals"]["prefill_tokens"] - first["prefill_tokens"])
            assert decode.peak > 0 and f"peak {F.rate(decode.peak)}" in widget_text(app, "#decode-label")
            assert f"pid {d.proc.pid} ok" in widget_text(app, "#status")
            # the KV tiers panel: the daemon's own tier figures, the host tier on by default
            tiers = app.shown["stats"]["kv_tiers"]
            assert tiers["host"]["enabled"] and tiers["device"]["hits"] > 0
            assert widget_text(app, "#tiers-long") == "\n".join(F.tier_lines(app.shown["stats"]))
            assert f"host   {tiers['host']['blocks']} blk" in widget_text(app, "#tiers-long")

    asyncio.run(scenario())


def test_keys(served):
    d = served["daemon"]

    async def scenario():
        app = TopApp(d.endpoint)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.connected and app.shown is not None, what="the first snapshot")
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen) and "pause the display" in screen_text(app)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)

            for label, seconds in (("5m", 300), ("15m", 900), ("1m", 60)):
                await pilot.press("w")
                assert app.window == seconds and f"last {label}" in screen_text(app)

            await pilot.press("p")
            assert app.paused and "PAUSED" in widget_text(app, "#status")
            frozen, frames = app.shown_seq, app.frames
            await until(pilot, lambda: app.frames >= frames + 3, what="more frames while paused")
            assert app.shown_seq == frozen  # the feed goes on, the screen does not
            await pilot.press("p")
            assert not app.paused and app.shown_seq > frozen

            # Enter on a request row: pause while the table has rows, so the rows stay put
            load = Load(d.endpoint, 4, 200)

            def rows_shown() -> bool:
                load.pump()
                if len(table_rows(app)) >= 2:
                    app.action_pause()  # what `p` does, in the same tick as the check
                return app.paused

            await until(pilot, rows_shown, what="request rows")
            rows = app.query_one(RequestsPanel).rows
            app.query_one("#request-table").focus()
            await pilot.press("down", "enter")
            assert isinstance(app.screen, RequestScreen)
            want = list(rows.values())[1]
            assert app.screen.request == want
            text = screen_text(app)
            assert f"request {want['id']}" in text and f"prompt tokens  {want['prompt_tokens']}" in text
            await pilot.press("escape")
            await pilot.press("p")
            await until(pilot, load.pump, timeout=60, what="the load to finish")
            load.close()
            await pilot.press("q")
        return app

    app = asyncio.run(scenario())
    assert app.return_code == 0


def test_survives_the_daemons_stop_and_restart(served):
    old = served["daemon"]

    async def scenario():
        app = TopApp(old.endpoint)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.connected and app.shown is not None, what="the first snapshot")
            assert app.shown["daemon"]["pid"] == old.proc.pid
            assert await asyncio.to_thread(old.stop) == 0
            await until(pilot, lambda: not app.connected, timeout=15, what="'not connected'")
            assert "not connected" in widget_text(app, "#status") and app.screen.has_class("-offline")
            new = served["daemon"] = await asyncio.to_thread(Daemon, served["tmp"], served["model"], *FLAGS)
            await until(pilot, lambda: app.connected and app.shown["daemon"]["pid"] == new.proc.pid, timeout=30,
                        what="the restarted daemon")
            assert "● connected" in widget_text(app, "#status") and not app.screen.has_class("-offline")
            assert app.shown["stats"]["totals"]["requests"] == 0  # a fresh daemon's figures, not the old ones
            assert app.shown["stats"]["kv_blocks_free"] == BLOCKS

    asyncio.run(scenario())


@pytest.mark.parametrize("code", [
    "import ridge.tui.app, ridge.tui.command, ridge.tui.feed; bad = {'torch', 'triton'} & set(sys.modules)",
    "import ridge.cli; ridge.cli.build_parser(); bad = {'textual'} & set(sys.modules)",
], ids=["tui-without-torch", "cli-without-textual"])
def test_import_boundaries(code):
    r = subprocess.run([sys.executable, "-c", f"import sys; {code}; assert not bad, bad"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
