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

    ridge bench loading [--rounds 3] [--cold-rounds 1] [--skip-1b]"""
from __future__ import annotations

import argparse
import os
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


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="rounds from host RAM and from the converted cache")
    p.add_argument("--cold-rounds", type=int, default=1, help="rounds that convert the source")
    p.add_argument("--skip-1b", action="store_true", help="only the embedded model")


def add_loading_parser(sub) -> None:
    """`ridge bench loading`: the daemons it starts take their own options, not the engine's."""
    _options(sub.add_parser("loading", help="time to first token while a model loads on request, "
                                            "against the loaded model's"))


def run_loading(args) -> int:
    print(report(measure(args.rounds, args.cold_rounds, not args.skip_1b)))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ridge bench loading", description=__doc__.split("\n\n")[0])
    _options(p)
    return run_loading(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
