"""Time to first token for a request that loads its model (issue 28; docs/benchmarks.md,
"Loading a model on request"): from host RAM (the weights an unload parked), from the
converted cache on disk, and cold (the source parsed and quantized), each against the same
model's time to first token once it is loaded, measured in the same round.

Two daemons, max_loaded_models = 1, so that every request for the other model loads it: one
parks weights (parked_gib large enough for both), one parks none (parked_gib = 0: reloads read
the converted cache). Their XDG_CACHE_HOME is private (the C kernels and the CPU format plan
linked in), so that a cold round can empty the converted cache without touching anyone else's;
it starts from the converted models a previous run kept under
$XDG_CACHE_HOME/ridge/bench-loading/converted (the warm-up's loads, not timed). The models: the
embedded SmolLM2-135M and a random Llama-3.2-1B-shaped directory (bf16 safetensors, written
once under $XDG_CACHE_HOME/ridge/bench-loading).

    ridge bench loading [--rounds 3] [--cold-rounds 1] [--skip-1b]

With --model PATH it times a process's start on that model instead (issue 39): `ridge generate
--local` to its first tokens, cold (the converted cache empty: the source read, converted and
calibrated a layer at a time) and from the converted cache; each start's wall time, peak RSS
(the child's rusage) and resident weights (the memory plan's log line), and the weights' load
against the time to read the converted cache's bytes in the same state (its pages cached).

    ridge bench loading --model DIR [--cold-rounds 1] [--rounds 3]"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ridge.spawn import python

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                max_position_embeddings=4096, rope_theta=500000.0)


def cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def write_1b(path: Path) -> Path:
    import torch
    import transformers

    from .window import write_byte_tokenizer

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(**LLAMA_1B)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    write_byte_tokenizer(path)
    return path


class Served:
    """`ridge serve` in a subprocess on its own socket, with a private cache home."""

    def __init__(self, tmp: Path, cache: Path, models_dir: Path, *flags):
        self.tmp, self.cache = tmp, cache
        real = cache_home() / "ridge"
        (self.cache / "ridge").mkdir(parents=True, exist_ok=True)
        for name in ("native", "cpu-format.json"):  # built and measured once per machine: shared
            if (real / name).exists() and not (self.cache / "ridge" / name).exists():
                (self.cache / "ridge" / name).symlink_to(real / name)
        self.endpoint = f"ipc://{tmp}/ridge.sock"
        env = {**os.environ, "XDG_CACHE_HOME": str(self.cache), "XDG_CONFIG_HOME": str(tmp / "config")}
        self.log = open(tmp / "daemon.log", "w")
        self.proc = subprocess.Popen([*python("-m", "ridge.cli"), "serve", "--endpoint", self.endpoint,
                                      "--models-dir", str(models_dir), "--max-loaded-models", "1", "--no-kv-disk",
                                      "--kv-host-gib", "0", "--device", "cpu", "--num-kv-blocks", "512",
                                      "--client-timeout", "600", *flags],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        from ridge.daemon.client import Client
        deadline = time.monotonic() + 600
        while True:
            try:
                self.client = Client(self.endpoint, timeout=600)
                self.client.hello()
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not start:\n{(tmp / 'daemon.log').read_text()}")
                time.sleep(0.5)

    def ttft(self, model: str | None) -> float:
        t = time.perf_counter()
        s = self.client.stream("Hello", model=model, max_tokens=2, temperature=0.0)
        it = iter(s)
        next(it)
        first = time.perf_counter() - t
        for _ in it:
            pass
        return first

    def state(self, model: str) -> dict:
        return next(m for m in self.client.models()["models"] if m["name"] == model)

    def drop_converted(self) -> None:
        shutil.rmtree(self.cache / "ridge" / "models", ignore_errors=True)

    def stop(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        self.log.close()


def measure(rounds: int, cold_rounds: int, with_1b: bool) -> dict:
    """-> {model: {source: [(load ttft, warm ttft), ...]}}; every round alternates the models, so
    each request for the other one loads it."""
    work = Path(tempfile.mkdtemp(prefix="ridge-bench-loading-"))
    models_dir = work / "models"
    models_dir.mkdir()
    names = []
    if with_1b:
        src = write_1b(cache_home() / "ridge" / "bench-loading" / "llama-1b-shaped")
        (models_dir / "llama-1b-shaped").symlink_to(src)
        names.append("llama-1b-shaped")
    out: dict = {}
    seed, cache = cache_home() / "ridge" / "bench-loading" / "converted", work / "cache"
    if seed.is_dir():
        shutil.copytree(seed, cache / "ridge" / "models")
    try:
        for parked, sources in ((True, ("host",)), (False, ("cache", "convert"))):
            tmp = work / ("parked" if parked else "unparked")
            tmp.mkdir()
            d = Served(tmp, cache, models_dir, "--parked-gib", "16" if parked else "0")
            default = d.client.models()["default"]
            everyone = [default] + names
            try:
                for m in everyone:  # each loaded once: the converted cache is filled, the weights parked
                    d.ttft(m)
                if not seed.is_dir():
                    shutil.copytree(cache / "ridge" / "models", seed)
                for source in sources:
                    for _ in range(cold_rounds if source == "convert" else rounds):
                        for m in everyone:
                            if source == "convert":
                                d.drop_converted()
                            load = d.ttft(m)
                            got = d.state(m)["load_from"]
                            assert got == source, f"{m} loaded from {got}, not {source}"
                            warm = d.ttft(m)
                            out.setdefault(m, {}).setdefault(source, []).append((load, warm))
            finally:
                d.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def report(results: dict) -> str:
    lines = ["| model | load from | TTFT loading it (median) | TTFT loaded | ratio | rounds |", "|---|---|---|---|---|---|"]
    for m, by in results.items():
        for source in ("host", "cache", "convert"):
            if source not in by:
                continue
            loads, warms = zip(*by[source])
            ratios = [a / b for a, b in by[source]]
            lines.append(f"| {m} | {source} | {statistics.median(loads):.2f} s | {1000 * statistics.median(warms):.0f} ms"
                         f" | {statistics.median(ratios):.0f}x | {len(loads)} |")
    return "\n".join(lines)


def _start(path: Path, cache: Path, threads: int) -> dict:
    """One `ridge generate --local` on path with XDG_CACHE_HOME=cache: wall, peak RSS, what its log says."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    t = time.perf_counter()
    proc = subprocess.Popen([*python("-m", "ridge.cli"), "generate", "--local", "--raw", "--model", str(path),
                             "--max-tokens", "4", "--threads", str(threads), "--no-kv-disk", "Hello"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"ridge generate failed ({proc.returncode}):\n{err[-4000:]}")
    weights = re.search(r"memory: weights ([0-9.]+) GiB", err)
    loaded = re.search(r"weights loaded in ([0-9.]+) s \((from the converted cache|converted from the source)\)", err)
    if not (weights and loaded):
        raise RuntimeError(f"the start's log lacks its memory plan or load line:\n{err[-4000:]}")
    return {"wall": wall, "peak_rss": usage.ru_maxrss * 1024, "weights": float(weights[1]) * (1 << 30),
            "load": float(loaded[1]), "cached": loaded[2].startswith("from")}


def source_params(path: Path) -> int:
    """The source's parameter count, from its files' headers (safetensors or GGUF)."""
    if path.is_dir():
        from safetensors import safe_open

        total = 0
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    total += math.prod(st.get_slice(name).get_shape())
        return total
    import gguf

    return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)


def read_seconds(entry: Path) -> float:
    """The time to read every file of a converted-cache entry into one reused buffer."""
    buf = bytearray(64 << 20)
    t = time.perf_counter()
    for f in sorted(entry.iterdir()):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t


def measure_starts(path: Path, cold_rounds: int, rounds: int, threads: int) -> dict:
    """-> {"cold": [start, ...], "cached": [start with "read": seconds, ...], "params": n, "cache_bytes": n,
    "image_bytes": n}."""
    from ridge.models.cpu_image import image_key

    work = Path(tempfile.mkdtemp(prefix="ridge-bench-starts-"))
    cache = work / "cache"
    real = cache_home() / "ridge"
    (cache / "ridge").mkdir(parents=True)
    for name in ("native", "cpu-format.json"):  # built and measured once per machine: shared
        if (real / name).exists():
            (cache / "ridge" / name).symlink_to(real / name)
    out: dict = {"cold": [], "cached": [], "params": source_params(path)}
    try:
        for _ in range(max(1, cold_rounds)):
            shutil.rmtree(cache / "ridge" / "models", ignore_errors=True)
            out["cold"].append(_start(path, cache, threads))
        entries = [d for d in (cache / "ridge" / "models").iterdir() if (d / "meta.json").is_file()]
        images = [d for d in entries if d.name.endswith(image_key(""))]
        out["cache_bytes"] = sum(f.stat().st_size for d in entries if d not in images for f in d.iterdir())
        out["image_bytes"] = sum(f.stat().st_size for d in images for f in d.iterdir())
        # What a cached start reads: on a CPU the image (its weights mapped; the converted entry's
        # weights are not read), else the converted entry.
        read = images or entries
        for _ in range(rounds):
            start = _start(path, cache, threads)
            start["read"] = sum(read_seconds(d) for d in read)
            out["cached"].append(start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def report_starts(path: Path, r: dict) -> str:
    gib, n = 1 << 30, r["params"]
    lines = [f"{path.name}: {n / 1e9:.2f}B parameters, converted cache {r['cache_bytes'] / gib:.2f} GiB, "
             f"CPU image {r.get('image_bytes', 0) / gib:.2f} GiB (a cached start reads the image where there is one)",
             "", "| start | wall (median) | peak RSS | resident weights | bytes/param | RSS - weights | "
             "weights load | reading the cache | load / read | rounds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for kind in ("cold", "cached"):
        rows = r[kind]
        if not rows:
            continue
        med = {k: statistics.median(x[k] for x in rows) for k in ("wall", "peak_rss", "weights", "load")}
        read = statistics.median(x["read"] for x in rows) if kind == "cached" else None
        lines.append(f"| {kind} | {med['wall']:.1f} s | {med['peak_rss'] / gib:.2f} GiB | {med['weights'] / gib:.2f} GiB"
                     f" | {med['weights'] / n:.2f} | {(med['peak_rss'] - med['weights']) / gib:.2f} GiB"
                     f" | {med['load']:.2f} s | " + (f"{read:.2f} s | {med['load'] / read:.1f}x" if read else "- | -")
                     + f" | {len(rows)} |")
    return "\n".join(lines)


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="rounds from host RAM and from the converted cache")
    p.add_argument("--cold-rounds", type=int, default=1, help="rounds that convert the source")
    p.add_argument("--skip-1b", action="store_true", help="only the embedded model")
    p.add_argument("--model", type=Path, help="time a process's start on this model (cold and cached) instead")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="with --model: the starts' CPU threads")


def add_loading_parser(sub) -> None:
    """`ridge bench loading`: the daemons it starts take their own options, not the engine's."""
    _options(sub.add_parser("loading", help="time to first token while a model loads on request, "
                                            "against the loaded model's"))


def run_loading(args) -> int:
    if args.model is not None:
        print(report_starts(args.model, measure_starts(args.model, args.cold_rounds, args.rounds, args.threads)))
        return 0
    print(report(measure(args.rounds, args.cold_rounds, not args.skip_1b)))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ridge bench loading", description=__doc__.split("\n\n")[0])
    _options(p)
    return run_loading(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
