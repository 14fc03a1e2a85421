"""`ridge top`: a Textual dashboard of one daemon, fed by its stats (docs/protocol.md
§3.6 and §6) and nothing else. The socket I/O runs in a thread worker
(tui/feed.py); this module only draws. Layout: top.tcss."""
from __future__ import annotations

import time
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import DataTable, Footer, Static
from textual.worker import get_current_worker

from . import feed
from . import figures as F
from .panels import KVPanel, MemoryPanel, ModelPanel, RequestsPanel, ThroughputPanel, TiersPanel
from .screens import HelpScreen, RequestScreen


class TopApp(App[int]):
    CSS_PATH = "top.tcss"
    TITLE = "ridge top"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    BINDINGS = [
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("p", "pause", "pause"),
        Binding("w", "window", "window"),
        Binding("q", "quit", "quit"),
    ]

    connected: reactive[bool] = reactive(False)
    paused: reactive[bool] = reactive(False)
    window: reactive[int] = reactive(F.WINDOWS[0])  # seconds shown by the tokens/s plots
    endpoint: reactive[str] = reactive("")
    reason: reactive[str] = reactive("connecting")  # why we are not connected
    shown_seq: reactive[int] = reactive(-1)  # the `seq` of the snapshot on screen

    class Fed(Message):
        """One feed event, posted from the socket thread."""

        def __init__(self, event: feed.Event):
            super().__init__()
            self.event = event

    def __init__(self, endpoint: str | None = None, *, replay: list[feed.Frame] | None = None,
                 replay_name: str = "recording", record: Path | None = None, follow: bool = True, **feed_kw):
        super().__init__()
        self.target = endpoint
        self.replay = replay
        self.replay_name = replay_name
        self.record_path = record
        self.follow = follow and replay is None
        self.feed_kw = feed_kw
        self.throughput = F.Throughput()
        self.latest: dict | None = None  # the newest snapshot, shown or not (pause)
        self.shown: dict | None = None  # the snapshot on screen
        self.frames = 0

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        with Container(id="panels"):
            yield MemoryPanel("Memory headroom", id="memory")
            yield KVPanel("KV cache", id="kv")
            yield ModelPanel("Model and device", id="model")
            yield ThroughputPanel("Tokens/s", id="throughput")
            yield TiersPanel("KV tiers", id="tiers")
            yield RequestsPanel("Requests", id="requests")
        yield Footer()

    def on_mount(self) -> None:
        self._draw_status()
        if self.replay is not None:
            self.endpoint = self.replay_name
            self.connected = True
            for frame in self.replay:
                self.take(frame)
        elif self.follow:
            self.follow_daemon()

    # -- the feed ---------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="feed", exit_on_error=False)
    def follow_daemon(self) -> None:
        worker = get_current_worker()
        feed.follow(self.target, lambda ev: self.post_message(self.Fed(ev)), lambda: worker.is_cancelled,
                    **self.feed_kw)

    def on_top_app_fed(self, message: Fed) -> None:
        if not self.is_running:  # shutting down: the socket thread may still post a last frame
            return
        ev = message.event
        if isinstance(ev, feed.Frame):
            self.take(ev)
        elif isinstance(ev, feed.Connected):
            self.endpoint = ev.endpoint
            self.connected = True
        else:
            self.reason = ev.reason
            self.connected = False

    def take(self, frame: feed.Frame) -> None:
        """Every snapshot goes into the history; the screen shows it unless paused."""
        reply = frame.reply
        st = reply["stats"]
        if self.record_path is not None:
            feed.record(self.record_path, frame.raw)
        self.frames += 1
        self.throughput.add(float(reply.get("time", time.time())), reply.get("daemon", {}).get("pid"),
                            st.get("totals", {}), st.get("prefill_tps", 0.0), st.get("decode_tps", 0.0))
        self.latest = reply
        if not self.paused:
            self.show(reply)

    def show(self, reply: dict) -> None:
        self.shown = reply
        for panel in (self.query_one(MemoryPanel), self.query_one(KVPanel), self.query_one(ModelPanel),
                      self.query_one(TiersPanel), self.query_one(RequestsPanel)):
            panel.show(reply)
        self._draw_throughput()
        self.shown_seq = int(reply.get("seq", -1))
        self._draw_status()

    def _draw_throughput(self) -> None:
        panel = self.query_one(ThroughputPanel)
        prefill, decode = self.throughput.series(self.window)
        panel.show_series(prefill, decode, self.window)

    # -- status line ------------------------------------------------------------------
    def watch_connected(self, connected: bool) -> None:
        if self.is_mounted:  # the dashboard's own screen, even while a modal is on top
            self.screen_stack[0].set_class(not connected, "-offline")
        self._draw_status()

    def watch_paused(self) -> None:
        self._draw_status()

    def watch_reason(self) -> None:
        self._draw_status()

    def watch_window(self) -> None:
        if self.is_mounted:
            self._draw_throughput()
            self._draw_status()

    def _draw_status(self) -> None:
        if not self.is_mounted:
            return
        text = Text.assemble(("ridge top", "bold"), " │ ")
        if self.paused:
            text.append("PAUSED", "bold reverse yellow")
            text.append(" │ ")
        if not self.connected:
            text.append("○ not connected", "bold red")
            text.append(f" ({self.reason}); retrying", "red")
            self.query_one("#status", Static).update(text)
            return
        text.append(*(("● replay", "bold cyan") if self.replay is not None else ("● connected", "bold green")))
        r = self.shown
        if r is not None:
            d, st = r.get("daemon", {}), r["stats"]
            state = d.get("state", "?")
            text.append(f" │ pid {d.get('pid', '?')} ")
            text.append(state, "" if state == "ok" else "bold yellow")
            text.append(f" │ up {F.duration(st.get('uptime'))}")
        text.append(f" │ window {F.window_label(self.window)} │ {self.endpoint}")
        self.query_one("#status", Static).update(text)

    # -- keys -------------------------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused and self.latest is not None:
            self.show(self.latest)

    def action_window(self) -> None:
        i = F.WINDOWS.index(self.window) if self.window in F.WINDOWS else -1
        self.window = F.WINDOWS[(i + 1) % len(F.WINDOWS)]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        panel = self.query_one(RequestsPanel)
        request = panel.rows.get(str(event.row_key.value))
        if request is not None:
            bs = (self.shown or {}).get("stats", {}).get("kv_block_size")
            self.push_screen(RequestScreen(request, bs))
