"""`ridge bench-daemon --health-under-load N`: one client's `health` round trips
while N others keep the daemon's admission busy (issue 24).

Each loader is a client of its own that sends, back to back, a generate whose
prompt is 512 KiB of text (tokenized by the daemon, then refused if it is longer
than the context: the tokenizing is the load) and a generate with a short prompt
and a JSON schema no request used before (compiled by the daemon), max_tokens 1.
Meanwhile the pinger times `health` round trips, one every 10 ms."""
from __future__ import annotations

import threading
import time

PROMPT_BYTES = 512 * 1024
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing ".split()


def big_prompt(seed: int) -> str:
    words, n, i = [], 0, seed
    while n < PROMPT_BYTES:
        w = WORDS[i % len(WORDS)] + str(i % 97)
        words.append(w)
        n, i = n + len(w) + 1, i + 7
    return " ".join(words)[:PROMPT_BYTES]


def schema(k: int) -> dict:
    """A JSON schema no other request used: the compiler's cache misses."""
    props = {f"f{k}_{j}": {"type": ["string", "integer", "boolean"][(k + j) % 3]} for j in range(12)}
    body = {"type": "object", "properties": props, "required": sorted(props)[:6]}
    return {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": body}}


def _loader(endpoint: str, index: int, stop: threading.Event, counts: dict) -> None:
    from ridge.daemon.client import Client, RidgeError

    prompt, k = big_prompt(index), 0
    with Client(endpoint, timeout=600) as c:
        while not stop.is_set():
            for kw in (dict(prompt=prompt, max_tokens=1), dict(prompt="Answer:", max_tokens=1)):
                kw["response_format"] = schema(1000 * index + k)
                k += 1
                try:
                    c.generate(**kw)
                    counts["ok"] += 1
                except RidgeError as e:
                    counts[e.code] = counts.get(e.code, 0) + 1


def _ping(endpoint: str, seconds: float) -> list[float]:
    from ridge.daemon.client import Client

    times = []
    with Client(endpoint, timeout=600) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            c.health()
            times.append(time.perf_counter() - t0)
            time.sleep(0.01)
    return times


def health_under_load(endpoint: str, clients: int, seconds: float) -> dict:
    from .workloads import percentiles

    idle = _ping(endpoint, 1.0)
    stop, counts = threading.Event(), {"ok": 0}
    loaders = [threading.Thread(target=_loader, args=(endpoint, i, stop, counts), daemon=True)
               for i in range(clients)]
    for t in loaders:
        t.start()
    time.sleep(1.0)  # every loader has a request in
    busy = _ping(endpoint, seconds)
    stop.set()
    for t in loaders:
        t.join(600)
    return {"clients": clients, "seconds": seconds, "idle_s": percentiles(idle), "loaded_s": percentiles(busy),
            "round_trips": len(busy), "max_s": max(busy), "loader_replies": counts}
