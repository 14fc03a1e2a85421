"""GPU serving check (issue 12): is a step's time the GPU's time?

    python tests/gpu/serve_check.py           # one CUDA GPU; about 5 minutes on an H200
    python tests/gpu/serve_check.py --tiny    # CPU, tiny sizes: proves the script runs

Needs torch, triton, numpy, safetensors, tokenizers, msgpack, pyzmq and ridge
itself installed (the GPU machine has no registry: carry `pip wheel --no-deps .`
and a pyzmq wheel, and `pip install --no-deps` them there). It never imports
gguf or textual, which that machine lacks.

It writes a random model of Llama-3.2-1B's shape (vocab 128256, hidden 2048,
FFN 8192, 16 layers, 32 heads, 8 KV heads, head_dim 64) as an HF safetensors
directory with the tiny test tokenizer, loaded with FP8 weights and FP8 KV, and
measures, side by side in one run:
  - W1 at 64 in flight, continuous against static batching (`ridge bench throughput`);
  - step time by kind (pure decode, mixed) in steady continuous serving: the time
    between consecutive steps' tokens, which with overlap is the device's time;
  - the GPU's busy fraction over steady steps (torch.profiler: the union of kernel
    intervals over the wall time);
  - host syncs per step (torch.cuda sync debug mode: every synchronizing call warns);
  - the daemon against the in-process engine (`ridge bench-daemon`).
JSON goes to $OUT/serve_check.json when $OUT is set."""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

for _absent in ("gguf", "textual"):  # the GPU machine lacks these: prove the serving path never needs them
    sys.modules.setdefault(_absent, None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tiny model writers

import torch  # noqa: E402

TINY = "--tiny" in sys.argv
DEV = "cpu" if TINY else "cuda"
IN_FLIGHT = 4 if TINY else 64
REQUESTS = 8 if TINY else 256
TARGETS = {"continuous_over_static": 1.5, "gpu_busy": 0.85, "mixed_over_decode": 1.3, "syncs_per_step": 0,
           "daemon_over_inprocess": 0.95}


def write_model(root: Path) -> Path:
    from tiny_models import random_state_dict, tiny_config, write_hf_dir, write_tokenizer_files

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16) if TINY else \
        dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
             num_kv_heads=8, head_dim=64)
    cfg = tiny_config("llama", max_position=8192, tie_word_embeddings=True, name="random-1b-shape", **shape)
    sd = random_state_dict(cfg, seed=0, device=DEV)
    for name, t in sd.items():  # std 1/sqrt(fan-in), so activations stay finite over 16 layers
        if name.endswith("_proj.weight"):
            t.mul_(t.shape[1] ** -0.5 / 0.08)
    path = write_hf_dir(root / "random-1b", cfg, sd, dtype=torch.bfloat16)
    write_tokenizer_files(path)
    del sd
    return path


def engine_args(model: Path) -> list[str]:
    return ["--model", str(model), "--device", DEV, "--max-num-seqs", str(IN_FLIGHT)] + \
        (["--num-kv-blocks", "256", "--threads", "2"] if TINY else [])


def cli_json(args: list[str], root: Path, name: str) -> dict:
    from ridge.cli import main

    out = root / f"{name}.json"
    rc = main(args + ["--json", str(out)])
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return {"rc": rc, **json.loads(out.read_text())} if out.exists() else {"rc": rc}


def steady_steps(model: Path) -> dict:
    """Continuous serving at IN_FLIGHT: step time by kind, busy fraction, syncs per step."""
    from ridge.bench.workloads import make_workload
    from ridge.engine.config import EngineConfig
    from ridge.engine.engine import LLMEngine
    from ridge.engine.sampling_params import SamplingParams

    # On CPU the GPU's defaults (overlap, padded graph shapes) are forced, so that --tiny runs their code.
    eng = LLMEngine(EngineConfig(model=str(model), device=DEV, max_num_seqs=IN_FLIGHT, async_scheduling=True,
                                 cuda_graph=True, num_kv_blocks=256 if TINY else None,
                                 num_threads=2 if TINY else None))
    wl = make_workload("W1", requests=REQUESTS * 8, lengths="uniform:4-12" if TINY else None)
    wl.tokenize(eng.tokenizer, eng.max_model_len)
    done = {"step_times": {"decode": [], "mixed": []}, "last": None}

    def observe(out, seconds):
        now = time.perf_counter()
        if done["last"] is not None:
            kind = "decode" if all(s.num_scheduled_tokens == 1 and s.start >= s.request.num_prompt_tokens
                                   for s in out.scheduled) else "mixed"
            done["step_times"][kind].append(now - done["last"])
        done["last"] = now
    eng.step_observers.append(observe)
    nxt = 0

    def top_up():
        nonlocal nxt
        while len(eng.groups) < IN_FLIGHT and nxt < wl.num_requests:
            eng.add_request(f"w{nxt}", wl.prompt_ids[nxt], SamplingParams(max_tokens=wl.lengths[nxt], ignore_eos=True))
            nxt += 1

    def run(steps: int) -> None:
        for _ in range(steps):
            top_up()
            eng.step()

    run(20 if TINY else 200)  # warm-up to a steady mix
    done["step_times"] = {"decode": [], "mixed": []}
    done["last"] = None
    run(20 if TINY else 400)
    res = {"engine": {"async_scheduling": eng.async_scheduling, "graphs": eng.runner.graphs is not None,
                      "kv_blocks": eng.kv_cache_manager.num_blocks, "budget": eng.sched_config.max_num_batched_tokens}}
    for kind, ts in done["step_times"].items():
        res[f"{kind}_step_ms"] = 1e3 * statistics.median(ts) if ts else None
        res[f"{kind}_steps"] = len(ts)
    if res["decode_step_ms"] and res["mixed_step_ms"]:
        res["mixed_over_decode"] = res["mixed_step_ms"] / res["decode_step_ms"]
    n = 10 if TINY else 50
    if DEV == "cuda":
        res["gpu_busy"] = busy_fraction(lambda: run(n))
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(n)
        torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        res["syncs_per_step"] = len(syncs) / n
        res["sync_examples"] = sorted(set(s[:200] for s in syncs))[:5]
    while eng.has_unfinished():
        eng.step()
    del eng
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return res


def busy_fraction(work) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        work()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # the union of kernel intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / wall_us


def main() -> int:
    t0 = time.time()
    name = "CPU (tiny)" if TINY else torch.cuda.get_device_name(0)
    print(f"device: {name}; torch {torch.__version__}")
    root = Path(tempfile.mkdtemp(prefix="ridge-serve-check-"))
    os.environ.setdefault("XDG_CACHE_HOME", str(root / "cache"))
    model = write_model(root)
    print(f"model written in {time.time() - t0:.0f} s: {model}")
    lengths = ["--lengths", "uniform:4-12"] if TINY else []
    thr = cli_json(["bench", "throughput"] + engine_args(model) + ["--in-flight", str(IN_FLIGHT), "--requests",
                                                                  str(REQUESTS)] + lengths, root, "throughput")
    t = thr.get("results", {}).get("throughput", {})
    res = {"device": name, "torch": torch.__version__, "tiny": TINY, "throughput": t,
           "continuous_over_static": t.get("ratio"), "bound": t.get("bound")}
    print(f"W1 at {IN_FLIGHT}: continuous/static {t.get('ratio')} (bound {t.get('bound')})")
    res["steps"] = steady_steps(model)
    print("steady steps:", json.dumps({k: v for k, v in res["steps"].items() if k != "sync_examples"}))
    dmn = cli_json(["bench-daemon"] + engine_args(model) + ["--in-flight", str(IN_FLIGHT), "--rounds", "1",
                                                           "--health", "50"] + lengths, root, "daemon")
    res["daemon"] = dmn
    ratio = dmn.get("ratio_median")
    res["daemon_over_inprocess"] = ratio
    print(f"daemon/in-process {ratio}")
    checks = {"continuous_over_static": res["continuous_over_static"], "gpu_busy": res["steps"].get("gpu_busy"),
              "mixed_over_decode": res["steps"].get("mixed_over_decode"),
              "syncs_per_step": res["steps"].get("syncs_per_step"), "daemon_over_inprocess": ratio}
    res["targets"] = {}
    for k, v in checks.items():
        lower_is_better = k in ("mixed_over_decode", "syncs_per_step")
        met = None if v is None else (v <= TARGETS[k] if lower_is_better else v >= TARGETS[k])
        res["targets"][k] = {"measured": v, "target": TARGETS[k], "met": met}
        print(f"{k:<24} {v if v is None else round(v, 3)!s:>8}  target {'<=' if lower_is_better else '>='} "
              f"{TARGETS[k]}  {'-' if met is None else ('met' if met else 'NOT met')}")
    res["seconds"] = time.time() - t0
    print(f"total {res['seconds']:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        out = Path(os.environ["OUT"]) / "serve_check.json"
        out.write_text(json.dumps(res, indent=1, default=str))
        print("wrote", out)
    return 0 if thr.get("rc") == 0 and dmn.get("rc") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
