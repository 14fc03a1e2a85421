"""The dashboard's panels. Each takes one stats reply through `show()`; layout
and colours of the containers live in top.tcss."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import DataTable, Static

from . import figures as F

# Segment colours (fixed, so that snapshots do not depend on the theme).
COLOURS = {"weights": "#5f87ff", "kv": "#af5fff", "act": "#ff875f", "other": "#767676", "reserve": "#d7af00",
           "free": "#3a3a3a", "ridge": "#5f87ff", "used": "#af5fff", "cached": "#5fafaf",
           "prefill": "#5fafff", "decode": "#87d75f"}
FREE_CHAR, FULL_CHAR = "░", "█"


class Bar(Widget):
    """One line: stacked segments, each as wide as its share of the sum."""

    DEFAULT_CSS = "Bar { height: 1; }"
    parts: reactive[tuple[tuple[int, str], ...]] = reactive(())  # (value, colour key)

    def render(self) -> Text:
        cells = F.split_cells([v for v, _ in self.parts], self.size.width)
        text = Text()
        for (_, key), n in zip(self.parts, cells, strict=True):
            text.append((FREE_CHAR if key == "free" else FULL_CHAR) * n, COLOURS[key])
        return text


class Spark(Widget):
    """Bars from zero to the window's peak, as tall as the widget, the points fitted to its width."""

    DEFAULT_CSS = "Spark { height: 1; }"
    BLOCKS = " ▁▂▃▄▅▆▇█"
    points: reactive[tuple[float, ...]] = reactive(())
    colour: reactive[str] = reactive("prefill")

    def render(self) -> Text:
        width, height = self.size.width, max(1, self.size.height)
        n, src = len(self.points), self.points
        # each column shows the largest point it covers, or repeats one when points are fewer than columns
        pts = [max(src[i * n // width:max((i + 1) * n // width, i * n // width + 1)]) for i in range(width)] \
            if n else [0.0] * width
        top = max(pts, default=0.0)
        eighths = [round(8 * height * v / top) if top > 0 else 0 for v in pts]
        rows = []
        for row in reversed(range(height)):  # row 0 is the bottom; its empty cells draw the baseline
            cells = (min(8, max(0, e - 8 * row)) for e in eighths)
            rows.append("".join(self.BLOCKS[c] if c or row else "▁" for c in cells))
        return Text("\n".join(rows), COLOURS[self.colour])


SHORT = {"weights": "wts", "kv": "KV", "act": "act", "other": "oth", "reserve": "res", "free": "free",
         "ridge": "rss"}


def legend(segments: list[F.Segment], short: bool = False, per_line: int = 0) -> Text:
    text = Text()
    for i, s in enumerate(segments):
        if i:
            text.append("\n" if per_line and i % per_line == 0 else " " if short else "  ")
        text.append("■" if short else "■ ", COLOURS[s.key])
        text.append(f"{SHORT.get(s.key, s.label) if short else s.label} {F.size(s.bytes)}")
    return text


class Panel(Vertical):
    def __init__(self, title: str, **kw):
        super().__init__(**kw)
        self.border_title = title


class MemoryPanel(Panel):
    """Long legends from 120 cells, short ones below (top.tcss shows one of each pair)."""

    def compose(self) -> ComposeResult:
        with Horizontal(classes="bar-row"):
            yield Static(id="device-label", classes="bar-label")
            yield Bar(id="device-bar")
        yield Static(id="device-legend", classes="legend long")
        yield Static(id="device-legend-short", classes="legend short")
        with Horizontal(classes="bar-row"):
            yield Static(id="host-label", classes="bar-label")
            yield Bar(id="host-bar")
        yield Static(id="host-legend", classes="legend long")

    def show(self, reply: dict) -> None:
        mem = reply["stats"].get("memory", {})
        dev, host = F.device_segments(mem), F.host_segments(mem)
        headroom = sum(s.bytes for s in dev if s.key == "free")
        self.border_title = f"Memory headroom {F.size(headroom)}"
        self.query_one("#device-label", Static).update(
            Text.assemble((f"{mem.get('device', '?')} ", "bold"), F.size(mem.get("device_total")), " "))
        self.query_one("#device-bar", Bar).parts = tuple((s.bytes, s.key) for s in dev)
        self.query_one("#device-legend", Static).update(legend(dev))
        self.query_one("#device-legend-short", Static).update(legend(dev, short=True, per_line=3))
        self.query_one("#host-label", Static).update(
            Text.assemble(("host ", "bold"), F.size(mem.get("host_total")), " "))
        self.query_one("#host-bar", Bar).parts = tuple((s.bytes, s.key) for s in host)
        self.query_one("#host-legend", Static).update(legend(host))


class KVPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Bar(id="kv-bar")
        yield Static(id="kv-blocks")
        yield Static(id="kv-bytes")
        yield Static(id="forecast")

    def show(self, reply: dict) -> None:
        kv = F.kv_figures(reply["stats"], reply.get("model", {}).get("max_model_len"))
        self.query_one("#kv-bar", Bar).parts = ((kv.used, "used"), (kv.cached, "cached"), (kv.empty, "free"))
        self.query_one("#kv-blocks", Static).update(Text.assemble(
            ("■", COLOURS["used"]), f"used {kv.used} ", ("■", COLOURS["cached"]), f"cached {kv.cached} ",
            ("■", COLOURS["free"]), f"free {kv.free}/{kv.total}"))
        self.query_one("#kv-bytes", Static).update(
            f"{kv.block_size} tok/blk · {F.size(kv.bytes_per_token)}/tok · free {F.size(kv.free_bytes)}")
        self.query_one("#forecast", Static).update(Text.assemble(
            "fits ", (str(kv.fits), "bold"), f" more requests at {F.context_label(kv.context)} context"))


class TiersPanel(Panel):
    """Where prefix blocks live beside the pool: host RAM and disk (top.tcss shows the one-line
    summary below 120 cells, the lines per tier from 120)."""

    def compose(self) -> ComposeResult:
        yield Static(id="tiers-short", classes="short")
        yield Static(id="tiers-long", classes="long")

    def show(self, reply: dict) -> None:
        st = reply["stats"]
        self.query_one("#tiers-short", Static).update(F.tier_line_short(st))
        self.query_one("#tiers-long", Static).update("\n".join(F.tier_lines(st)))


class ThroughputPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static(id="prefill-label", classes="rate-label")
        yield Spark(id="prefill-spark", classes="spark")
        yield Static(id="decode-label", classes="rate-label")
        yield Spark(id="decode-spark", classes="spark")

    def show_series(self, prefill: F.Series, decode: F.Series, window: int) -> None:
        self.border_title = f"Tokens/s · last {F.window_label(window)}"
        for name, s in (("prefill", prefill), ("decode", decode)):
            self.query_one(f"#{name}-label", Static).update(Text.assemble(
                (f"{name:<8}", COLOURS[name]), "now ", (F.rate(s.current), "bold"), " avg ", F.rate(s.average),
                " peak ", F.rate(s.peak)))
            spark = self.query_one(f"#{name}-spark", Spark)
            spark.colour = name
            spark.points = tuple(s.points)


REQUEST_COLUMNS = ("request", "state", "age", "in", "out", "TTFT", "tok/s")


class RequestsPanel(Panel):
    def __init__(self, title: str, **kw):
        super().__init__(title, **kw)
        self.rows: dict[str, dict] = {}  # row key -> the snapshot's request, for the details screen

    def compose(self) -> ComposeResult:
        yield Static("no figures yet: waiting for a daemon (start one with `ridge serve`)", id="request-counts")
        yield Static(id="request-rates")
        yield Static(id="request-models")
        yield DataTable(id="request-table", cursor_type="row")

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*REQUEST_COLUMNS)
        self.query_one("#request-models").display = False  # until a snapshot lists models

    def show(self, reply: dict) -> None:
        st = reply["stats"]
        self.query_one("#request-counts", Static).update(Text.assemble(
            ("running ", "bold"), str(st.get("running", 0)), ("  waiting ", "bold"), str(st.get("waiting", 0)),
            ("  preempted ", "bold"), str(st.get("preempted", 0)),
            f" ({st.get('num_preemptions', 0)} preemptions)  admitted {st.get('totals', {}).get('requests', 0)}"))
        self.query_one("#request-rates", Static).update(
            f"prefix hits {100 * float(st.get('prefix_hit_rate', 0.0)):.1f}% · "
            + F.speculative_line(st.get("speculative")))
        models = self.query_one("#request-models", Static)
        models.display = bool(reply.get("models"))  # a daemon before issue 28 sends none
        if models.display:
            models.update(Text.assemble(("models ", "bold"), F.model_line(reply["models"], float(reply["time"]))))
        self._fill(st.get("requests", []))

    def _fill(self, requests: list[dict]) -> None:
        table = self.query_one(DataTable)
        keep = table.cursor_row
        rows = {F.request_key(r): r for r in requests}
        table.clear()
        for key, r in rows.items():
            name = r.get("id", "?") + (f"/{r['index']}" if r.get("index") else "")
            table.add_row(name, r.get("state", "?"), F.duration(r.get("age")), str(r.get("prompt_tokens", 0)),
                          str(r.get("output_tokens", 0)), F.duration(r.get("ttft")), F.rate(r.get("tps")), key=key)
        self.rows = rows
        if rows:
            table.move_cursor(row=min(keep, len(rows) - 1), animate=False)


class ModelPanel(Panel):
    def compose(self) -> ComposeResult:
        yield Static(id="model-info")

    def show(self, reply: dict) -> None:
        m, st = reply.get("model", {}), reply["stats"]
        b = st.get("budget", {})
        rp = float(b.get("ridge_point", m.get("ridge_point", 0.0)) or 0.0)
        lines = [
            Text(m.get("name", "?"), "bold"),
            Text(f"weights {F.weights_label(m)} · KV {m.get('kv_dtype', st.get('kv_dtype', '?'))}"),
            Text.assemble("ridge point ", (f"{rp:.1f} FLOP/B", "bold"),
                          f" · T* {float(b.get('knee_tokens', 0)):.1f} tok"),
            Text(f"{m.get('arch', '?')} · {m.get('num_layers', '?')} layers · ctx {m.get('max_model_len', '?')} · "
                 f"{m.get('device', '?')}"),
            Text(f"block {m.get('block_size', st.get('kv_block_size', '?'))} tok · "
                 f"{m.get('num_kv_blocks', st.get('kv_blocks_total', '?'))} blocks · "
                 f"prefill chunk {b.get('prefill_chunk', '?')}"),
            Text(f"ridge point {b.get('ridge_source', m.get('ridge_source', '?'))}", "dim"),
        ]
        self.query_one("#model-info", Static).update(Text("\n").join(lines))
