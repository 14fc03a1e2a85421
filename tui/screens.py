"""Modal screens: the key help, and one request's details."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from . import figures as F

HELP = """\
[b]Keys[/b]
  ?          this help
  p          pause the display (the history keeps recording)
  w          window of the tokens/s plots: 1m, 5m, 15m
  ↑ ↓ Enter  choose a request and show its details
  q          quit

[b]Panels[/b]
  Memory     device: weights, KV pool, activations, other
             processes, the reserve kept free, and the headroom
             past it. Host RAM: the daemon's RSS, others, free.
  KV cache   blocks used, cached (free, holding a reusable
             prefix) and empty. The forecast: free blocks over
             the blocks one request of that context needs.
  Tokens/s   from the daemon's token totals; now = its last
             10 s, avg and peak over the window.
  Requests   counts, prefix hits, speculative acceptance, and
             the requests in the engine (daemon ids).
  Model      dtypes, KV block size, the device's ridge point."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box", classes="modal-box") as box:
            box.border_title = "ridge top: help"
            box.border_subtitle = "Escape closes"
            yield Static(HELP, id="help-text")


REQUEST_FIELDS = (("id", "daemon id"), ("index", "sample"), ("state", "state"), ("age", "age"),
                  ("prompt_tokens", "prompt tokens"), ("output_tokens", "output tokens"), ("ttft", "TTFT"),
                  ("tps", "decode tok/s"))


def request_details(r: dict, kv_block_size: int | None = None) -> Text:
    lines = []
    for key, label in REQUEST_FIELDS:
        v = r.get(key)
        shown = F.duration(v) if key in ("age", "ttft") else F.rate(v) if key == "tps" else "-" if v is None else v
        lines.append(Text.assemble((f"{label:<15}", "bold"), str(shown)))
    tokens = int(r.get("prompt_tokens", 0)) + int(r.get("output_tokens", 0))
    lines.append(Text.assemble((f"{'context':<15}", "bold"), f"{tokens} tokens"))
    if kv_block_size:
        lines.append(Text.assemble((f"{'KV blocks':<15}", "bold"), f"~{-(-tokens // kv_block_size)} blocks "
                                   f"of {kv_block_size} tokens"))
    for key in sorted(set(r) - {k for k, _ in REQUEST_FIELDS}):  # fields a newer daemon adds
        lines.append(Text.assemble((f"{key:<15}", "bold"), str(r[key])))
    return Text("\n").join(lines)


class RequestScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,enter,q", "dismiss", "close")]

    def __init__(self, request: dict, kv_block_size: int | None = None):
        super().__init__()
        self.request = request
        self.kv_block_size = kv_block_size

    def compose(self) -> ComposeResult:
        with Vertical(id="request-box", classes="modal-box") as box:
            box.border_title = f"request {self.request.get('id', '?')}"
            box.border_subtitle = "Escape closes"
            yield Static(request_details(self.request, self.kv_block_size), id="request-text")
