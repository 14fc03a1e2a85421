"""The dashboard's arithmetic on stats snapshots, as plain data: memory
segments, the KV forecast, throughput over a window. No Textual, no torch."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

GIB, MIB = 2**30, 2**20
FORECAST_CONTEXT = 4096  # "fits N more requests at 4K context"
WINDOWS = (60, 300, 900)  # the `w` key cycles these (seconds)
BUCKETS = 60  # sparkline points per window, at most
MIN_BUCKET_S = 1.0  # and at least two snapshots' spacing wide, so that no bucket is left empty by chance


def size(n: float | None) -> str:
    """Bytes for a narrow column: 1.23G, 456M, 12K."""
    if n is None:
        return "-"
    for unit, scale in (("G", GIB), ("M", MIB), ("K", 1024)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.2f}{unit}" if v < 10 else f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"
    return f"{n:.0f}B"


def duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{1000 * s:.0f}ms"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def window_label(seconds: int) -> str:
    return f"{seconds // 60}m"


# -- memory ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Segment:
    key: str  # also the CSS-ish colour name the panel looks up
    label: str
    bytes: int


def device_segments(mem: dict) -> list[Segment]:
    """Device memory, left to right: what ridge holds, what others hold, the reserve kept for
    the desktop and other processes, and the headroom past it. Sums to device_total."""
    total = int(mem.get("device_total") or 0)
    ours = [Segment("weights", "weights", int(mem.get("weights") or 0)),
            Segment("kv", "KV", int(mem.get("kv_pool") or 0)),
            Segment("act", "activations", int(mem.get("activations") or 0))]
    free = max(0, min(int(mem.get("device_free") or 0), total))
    held = sum(s.bytes for s in ours)
    other = max(0, total - free - held)
    reserve = min(int(mem.get("reserve") or 0), free)
    return ours + [Segment("other", "others", other), Segment("reserve", "reserve", reserve),
                   Segment("free", "free", free - reserve)]


def host_segments(mem: dict) -> list[Segment]:
    total = int(mem.get("host_total") or 0)
    avail = max(0, min(int(mem.get("host_available") or 0), total))
    rss = min(int(mem.get("host_rss") or 0), total - avail)
    return [Segment("ridge", "ridge", rss), Segment("other", "others", total - avail - rss),
            Segment("free", "available", avail)]


def split_cells(values: list[int], width: int) -> list[int]:
    """Cells per value for a bar `width` wide, summing to width; a non-zero value gets at least one
    cell when there is room (largest remainder otherwise)."""
    total = sum(values)
    if width <= 0 or total <= 0:
        return [0] * len(values)
    exact = [v * width / total for v in values]
    cells = [int(x) for x in exact]
    for i in sorted(range(len(values)), key=lambda i: exact[i] - cells[i], reverse=True)[:width - sum(cells)]:
        cells[i] += 1
    for i, v in enumerate(values):  # lend a cell to a visible sliver from the widest segment
        if v > 0 and cells[i] == 0:
            j = max(range(len(cells)), key=cells.__getitem__)
            if cells[j] > 1:
                cells[j] -= 1
                cells[i] = 1
    return cells


# -- KV blocks and the forecast ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVFigures:
    total: int
    used: int
    cached: int  # free blocks that still hold a reusable prefix (part of `free`)
    free: int
    block_size: int
    bytes_per_token: int
    context: int  # the forecast's context length
    fits: int  # more requests of `context` tokens the free blocks hold

    @property
    def empty(self) -> int:
        return self.free - self.cached

    @property
    def free_bytes(self) -> int:
        return self.free * self.block_size * self.bytes_per_token


def kv_figures(stats: dict, max_model_len: int | None = None) -> KVFigures:
    """The seed's arithmetic: free blocks x block size tokens, over ceil(context / block size)
    blocks a request of `context` tokens needs. Cached blocks count as free: the pool evicts them."""
    bs = int(stats.get("kv_block_size") or 1)
    context = min(FORECAST_CONTEXT, max_model_len) if max_model_len else FORECAST_CONTEXT
    free = int(stats.get("kv_blocks_free", 0))
    return KVFigures(int(stats.get("kv_blocks_total", 0)), int(stats.get("kv_blocks_used", 0)),
                     int(stats.get("kv_blocks_cached", 0)), free, bs, int(stats.get("kv_bytes_per_token", 0)),
                     context, free // math.ceil(context / bs))


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


# -- throughput ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Series:
    points: list[float]  # tokens/s per bucket, oldest first
    current: float  # the daemon's own figure (its last 10 s)
    average: float  # over the part of the window that has samples
    peak: float


class Throughput:
    """Token totals over time, from consecutive snapshots' `totals` (daemon clock, so a
    replayed recording draws the same picture). A daemon restart resets its totals: the
    sample after one counts nothing."""

    def __init__(self, keep: float = max(WINDOWS)):
        self.keep = keep
        self.samples: deque[tuple[float, int, int]] = deque()  # (time, prefill tokens, decode tokens) added
        self._last: tuple[object, int, int] | None = None  # (daemon pid, prefill total, decode total)
        self.current = (0.0, 0.0)

    def add(self, t: float, pid: object, totals: dict, prefill_tps: float, decode_tps: float) -> None:
        p, d = int(totals.get("prefill_tokens", 0)), int(totals.get("decode_tokens", 0))
        last = self._last
        fresh = last is None or last[0] != pid or p < last[1] or d < last[2]
        if self.samples and t < self.samples[-1][0]:
            # Snapshots can arrive out of time order (a pushed one overtaking a polled one):
            # the series needs a sorted deque, so a late one counts at the newest time.
            t = self.samples[-1][0]
        self.samples.append((t, 0 if fresh else p - last[1], 0 if fresh else d - last[2]))
        self._last = (pid, p, d)
        self.current = (float(prefill_tps), float(decode_tps))
        while self.samples and self.samples[0][0] < t - self.keep:
            self.samples.popleft()

    def spacing(self) -> float:
        """The median time between snapshots."""
        times = [t for t, _, _ in list(self.samples)[-41:]]
        gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
        return gaps[len(gaps) // 2] if gaps else 0.0

    def series(self, window: float, buckets: int = BUCKETS) -> tuple[Series, Series]:
        """Tokens/s per bucket of window/buckets seconds, on a grid aligned to the daemon clock so
        that points keep their height as the window slides; the newest bucket is still filling."""
        buckets = max(1, min(buckets, int(window / max(MIN_BUCKET_S, 2 * self.spacing()))))
        width = window / buckets
        pre, dec = [0.0] * buckets, [0.0] * buckets
        first = None
        if self.samples:
            last = math.floor(self.samples[-1][0] / width)
            for t, p, d in self.samples:
                i = math.floor(t / width) - (last - buckets + 1)
                if i < 0:
                    continue
                first = t if first is None else first
                pre[i] += p
                dec[i] += d
        span = max(width, self.samples[-1][0] - first) if first is not None else width
        out = [Series([x / width for x in tokens], cur, sum(tokens) / span, max(tokens) / width)
               for tokens, cur in ((pre, self.current[0]), (dec, self.current[1]))]
        return out[0], out[1]


# -- requests --------------------------------------------------------------------------
def request_key(r: dict) -> str:
    return f"{r.get('id')}#{r.get('index', 0)}"


def weights_label(model: dict) -> str:
    if model.get("fp8_weights"):
        return "FP8"
    if model.get("quantized"):  # FP8 numbers, held upcast (the CPU path)
        return f"FP8→{model.get('weight_dtype', '?')}"
    return str(model.get("weight_dtype", "?"))


def speculative_line(spec: dict | None) -> str:
    spec = spec or {}
    name = spec.get("proposer") or "off"
    if name == "off":
        return "speculative off"
    tot = spec.get("total") or {}
    if not tot.get("verifications"):
        return f"speculative {name}: no drafts yet"
    return (f"speculative {name}: accept {100 * tot.get('acceptance_rate', 0.0):.0f}%, "
            f"{tot.get('tokens_per_verification', 0.0):.2f} tok/step")


# -- KV tiers --------------------------------------------------------------------------
NO_TIERS = "no tier figures from this daemon"


def count(n: int) -> str:
    """1234 -> 1.2k, for narrow columns."""
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else str(n)


def _tier(name: str, t: dict, moved: str) -> tuple[str, str]:
    """-> (what it holds, its traffic), or an off line and ''."""
    if not t.get("enabled"):
        reason = t.get("off_reason") or ""
        return f"{name:<6} off" + (f": {reason}" if reason else ""), ""
    held = f"{name:<6} {count(t.get('blocks', 0))} blk {size(t.get('used_bytes', 0))}/{size(t.get('capacity_bytes', 0))}"
    traffic = (f"  hit {count(t.get('hits', 0))} miss {count(t.get('misses', 0))} · {moved} "
               f"{size(t.get('bytes_in', 0))} out {size(t.get('bytes_out', 0))}")
    return held, traffic


def tier_lines(stats: dict) -> list[str]:
    """The KV tiers panel, one tier after another: device, host RAM, disk; then the loads in
    flight and the engine thread's time in tier work."""
    t = stats.get("kv_tiers")
    if not t:
        return [NO_TIERS]
    dev = t.get("device", {})
    lines = [f"device {count(dev.get('blocks', 0))} blk cached · hit {count(dev.get('hits', 0))} "
             f"miss {count(dev.get('misses', 0))}"]
    for name, moved in (("host", "in"), ("disk", "read")):
        lines += [line for line in _tier(name, t.get(name, {}), moved) if line]
    w = t.get("step_wait", {})
    lines.append(f"loading {t.get('loading', 0)} · tier work {w.get('pct', 0.0):.1f}% of steps "
                 f"(max {w.get('max_pct', 0.0):.1f}%)")
    return lines


def tier_line_short(stats: dict) -> str:
    """One line for narrow screens: each tier's blocks and hits."""
    t = stats.get("kv_tiers")
    if not t:
        return NO_TIERS
    parts = [f"device {count(t.get('device', {}).get('hits', 0))} hits"]
    for name in ("host", "disk"):
        x = t.get(name, {})
        parts.append(f"{name} {count(x.get('blocks', 0))} blk {count(x.get('hits', 0))} hits"
                     if x.get("enabled") else f"{name} off")
    return " · ".join(parts + [f"loading {t.get('loading', 0)}"])


# -- models (docs/protocol.md §3.10) -------------------------------------------------
def model_line(models: list[dict], now: float) -> str:
    """The daemon's models loaded or loading, one phrase each: its name (* the default), its
    memory, and the time until it unloads counted from the snapshot's time (`now`), so that a
    replay shows what the live screen did."""
    parts = []
    for m in models:
        name = m["name"] + ("*" if m.get("default") else "")
        state = m.get("state")
        if state == "ready":
            if m.get("expires_at") is not None:
                when = f"unloads in {duration(max(m['expires_at'] - now, 0.0))}"
            else:
                when = "kept" if m.get("keep_alive") == -1 else f"{m.get('requests', 0)} req"
            parts.append(f"{name} {size(m.get('bytes'))} {when}")
        elif state == "loading":
            parts.append(f"{name} loading {duration(m.get('elapsed'))}")
        else:
            parts.append(f"{name} {state}")
    return " · ".join(parts)
