"""`ridge bench prefix`: a long shared system prompt and short questions, with the
prefix served from each KV tier in turn, side by side in one run.

Two system prompts of --system-tokens tokens (A and B) take turns, each request
with its own question, one request at a time (TTFT without queueing):

  cold     no prefix caching: every request computes its whole prompt
  device   the pool holds both prefixes
  host     the pool holds one request, so each prefix evicts the other; the
           evicted one comes back from host RAM
  disk     a restart: a new engine, with no host tier and the same one-request
           pool, over a disk tier that an earlier engine wrote the two prefixes to
  disk, out of page cache   the same, with the tier's files dropped from the
           OS page cache before every request (fsync + POSIX_FADV_DONTNEED), as
           after a reboot

Greedy; every run's outputs are compared with the cold run's (the questions it
ran) and with the device run's (all). The disk tier lives in a fresh folder under
$XDG_CACHE_HOME/ridge/kv, removed at the end."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import replace

TOPICS = ["rivers", "bridges", "orchards", "lighthouses", "glaciers", "markets", "libraries", "volcanoes"]


def add_prefix_parser(sub, common) -> None:
    p = sub.add_parser("prefix", help="TTFT and throughput with a shared long prefix from each KV tier "
                                      "(cold, device, host, disk after a restart)")
    common(p, workload=False)
    p.add_argument("--system-tokens", type=int, default=2048, help="tokens of each shared system prompt")
    p.add_argument("--questions", type=int, default=64, help="requests per warm run")
    p.add_argument("--cold-questions", type=int, default=8,
                   help="requests of the cold run (each computes the whole prompt)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens of each answer (greedy)")
    p.add_argument("--skip-uncached-disk", action="store_true", help="skip the run out of the page cache")


def system_prompts(tok, n_tokens: int) -> list[list[int]]:
    out = []
    for name, seed in (("A", 3), ("B", 7)):
        lines = [f"You are assistant {name}. Follow the house rules below."]
        i = 0
        while len(tok.encode("\n".join(lines))) < n_tokens + 16:
            lines.append(f"Rule {i}: when asked about {TOPICS[(i * seed) % len(TOPICS)]}, cite fact "
                         f"{(i * seed * 37) % 1000} and keep answers under {10 + (i * seed) % 40} words.")
            i += 1
        out.append(tok.encode("\n".join(lines))[:n_tokens])
    return out


def questions(tok, n: int) -> list[list[int]]:
    return [tok.encode(f"\nQuestion {i}: what is fact {(i * 53) % 1000} about "
                       f"{TOPICS[i % len(TOPICS)]}?\nAnswer:") for i in range(n)]


def drop_page_cache(root) -> None:
    """Evict the tier's files from the OS page cache (only ours; needs no privilege)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def measure(engine, prompts: list[list[int]], max_tokens: int, before=None) -> dict:
    """Each prompt alone; -> TTFT percentiles, throughput, tier hits and outputs."""
    from ridge.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = engine.stats()["kv_tiers"]
    engine.tier_wait = dict.fromkeys(engine.tier_wait, 0) | {"max_frac": 0.0}
    ttft, busy, outs, cached = [], 0.0, [], []
    for i, p in enumerate(prompts):
        if before is not None:
            before()
        start = time.perf_counter()
        rid = engine.add_request(f"p{i}", p, params)
        toks = []
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid:
                    toks += o.new_token_ids
                    if o.finished:
                        ttft.append(o.timings["ttft"])
                        cached.append(o.num_cached_tokens)
        busy += time.perf_counter() - start
        outs.append(toks)
    t1 = engine.stats()["kv_tiers"]
    hits = {t: t1[t]["hits"] - t0[t]["hits"] for t in ("device", "host", "disk")}
    w = engine.tier_wait
    return {"requests": len(prompts), "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99),
            "ttft_mean": statistics.mean(ttft), "seconds": busy, "req_s": len(prompts) / busy,
            "prompt_tok_s": sum(map(len, prompts)) / busy, "output_tok_s": sum(map(len, outs)) / busy,
            "cached_tokens_mean": statistics.mean(cached), "hit_blocks": hits,
            "step_wait_pct": 100 * w["busy_s"] / w["step_s"] if w["step_s"] else 0.0,
            "step_wait_max_pct": 100 * w["max_frac"], "outputs": outs}


def run_prefix(args, rep) -> None:
    from ridge.cache.disk_tier import kv_root
    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine
    from ridge.models.loader import load_model

    loaded = load_model(args.model, device=args.device, weights=args.weights, max_model_len=args.max_model_len)
    tok = loaded.tokenizer
    systems, qs = system_prompts(tok, args.system_tokens), questions(tok, args.questions)
    prompts = [systems[i % 2] + q for i, q in enumerate(qs)]
    root = kv_root() / f"bench-prefix-{os.getpid()}"
    snapshot = root.with_name(root.name + "-snapshot")
    base = replace(engine_config(args), kv_disk_dir=str(root), max_num_seqs=max(args.max_num_seqs, 1))
    one_request = -(-(args.system_tokens + max(map(len, qs)) + args.max_tokens) // base.block_size) + 1
    runs = {}

    def engine(**kw):
        return LLMEngine(replace(base, **kw), loaded=loaded)

    def warm(e):  # both prefixes computed once, not measured: only their blocks are cached
        measure(e, [s + qs[0][:1] for s in systems], 1)

    try:
        e = engine(enable_prefix_caching=False, num_kv_blocks=2 * one_request)
        rep.set_env(e)
        # Every engine after this one multiplies in the same CPU weight format.
        base = replace(base, cpu_weight_format=f"bf16:{e.lowp_max_tokens}" if e.lowp_max_tokens else "fp32")
        _log("cold", len(prompts[:args.cold_questions]))
        runs["cold"] = measure(e, prompts[:args.cold_questions], args.max_tokens)
        del e
        e = engine(kv_host_gib=0, kv_disk=False, num_kv_blocks=4 * one_request)
        warm(e)
        _log("device", len(prompts))
        runs["device"] = measure(e, prompts, args.max_tokens)
        del e
        e = engine(num_kv_blocks=one_request, kv_disk=False)
        warm(e)
        _log("host", len(prompts))
        runs["host"] = measure(e, prompts, args.max_tokens)
        del e
        e = engine(num_kv_blocks=one_request, kv_host_gib=0)
        warm(e)  # writes the prefixes through to the disk tier
        e.close()
        del e
        # Each disk run starts from these files alone: a run writes its own questions' blocks
        # through, and a later run hitting them would compute other chunks than the cold run.
        shutil.copytree(root, snapshot)
        for name, before in (("disk", None), ("disk_uncached", lambda: drop_page_cache(root))):
            if name == "disk_uncached" and args.skip_uncached_disk:
                continue
            shutil.rmtree(root)
            shutil.copytree(snapshot, root)
            e = engine(num_kv_blocks=one_request, kv_host_gib=0)  # the restart
            _log(NAMES[name], len(prompts))
            runs[name] = measure(e, prompts, args.max_tokens, before)
            e.close()
            del e
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(snapshot, ignore_errors=True)
    _compare(runs)
    rep.data["env"]["host_pool_blocks"] = one_request
    rep.add("prefix", {k: {x: y for x, y in v.items() if x != "outputs"} for k, v in runs.items()})
    _print(runs, rep, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.data, f, indent=1, default=str)


def _log(name: str, n: int) -> None:
    print(f"prefix bench: {name} ({n} requests)", file=sys.stderr)


def _compare(runs: dict) -> None:
    cold, device = runs["cold"]["outputs"], runs["device"]["outputs"]
    for r in runs.values():
        r["same_as_cold"] = sum(a == b for a, b in zip(r["outputs"], cold))
        r["same_as_device"] = sum(a == b for a, b in zip(r["outputs"], device))


NAMES = {"cold": "cold (no prefix cache)", "device": "device tier", "host": "host tier (pool of one request)",
         "disk": "disk after a restart", "disk_uncached": "disk after a restart, out of page cache"}


def _print(runs: dict, rep, args) -> None:
    out, env = rep.out, rep.data["env"]
    cold = runs["cold"]["ttft_p50"]
    print(f"\n# prefix tiers — {env.get('device')} threads {env.get('threads')} KV {env.get('kv_dtype')}, "
          f"{args.system_tokens}-token system prompts x2 alternating, {args.max_tokens}-token answers, "
          f"one request at a time", file=out)
    print(f"# command: {rep.data['command']}", file=out)
    print("| prefix from | requests | TTFT p50 ms | TTFT p99 ms | vs cold (p50) | req/s | prompt tok/s "
          "| blocks hit device/host/disk | tier work, % of step time (mean / max) | same as cold | same as device |",
          file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    ncold = runs["cold"]["requests"]
    for k, r in runs.items():
        h = r["hit_blocks"]
        print(f"| {NAMES[k]} | {r['requests']} | {1e3 * r['ttft_p50']:.0f} | {1e3 * r['ttft_p99']:.0f} "
              f"| {cold / r['ttft_p50']:.1f}x | {r['req_s']:.2f} | {r['prompt_tok_s']:.0f} "
              f"| {h['device']}/{h['host']}/{h['disk']} | {r['step_wait_pct']:.2f} / {r['step_wait_max_pct']:.1f} "
              f"| {r['same_as_cold']}/{min(ncold, r['requests'])} | {r['same_as_device']}/{r['requests']} |", file=out)
