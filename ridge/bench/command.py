"""`ridge bench`: throughput and latency of the engine on named workloads.

    ridge bench throughput --workload W1 [--in-flight 16] [--requests 64] [--json out.json]
    ridge bench sweep      continuous vs static over output-length variance
    ridge bench hf         ridge vs HF transformers generate (static batches, fp32)
    ridge bench server     ridge vs an HTTP server (llama-server /completion or OpenAI /v1/completions)
    ridge bench overhead   engine step time vs the same step's matrix products alone
    ridge bench kv         decode step time per CPU KV dtype (fp32, bf16, fp8)
    ridge bench prefix     TTFT with a shared 2K-token prefix from each KV tier (cold, device, host, disk)
    ridge bench structured structured-output libraries compared, and the mask overhead
    ridge bench host       a pure-decode step's host time (schedule, plan, update, emit) per context
    ridge bench hashing    block identity's cost: hashing and hit checks per prompt and per decode step
    ridge bench contention throughput beside another CPU-heavy process, adaptive vs fixed threads
    ridge bench window     a sliding-window model's decode step at 1, 2 and 4 windows of context
    ridge bench determinism a request's tokens alone, batched and speculated; --deterministic's cost
    ridge bench moe        a random Qwen3-MoE-shaped model's decode against a dense one of its active size
    ridge bench hybrid     a random Qwen3.5-shaped hybrid against a dense model of equal parameters (1K-32K)
    ridge bench vision     time to first token with an image (Gemma-3-4B shape) against transformers' generate
    ridge bench embeddings embedding throughput at batch 1 and 64 against transformers on the same model
    ridge bench recurrent  one layer's recurrent ops (gated delta rule, conv, Mamba2) per backend
    ridge bench loading    time to first token while a model loads on request (host RAM, cache, cold)
    ridge bench all        the set, into one JSON

Every command prints tables headed by the device, threads, KV dtype and the
exact command, and writes the same figures as JSON with --json."""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

from .report import Report

DEFAULT_LEVELS = "none,low,high,tail"


def _common(p: argparse.ArgumentParser, workload: bool = True) -> None:
    from ridge.engine.config import add_engine_args

    add_engine_args(p)
    p.add_argument("--json", metavar="PATH", default=None, help="write the figures as JSON")
    p.add_argument("--md", action="store_true", help="print tables as Markdown")
    p.add_argument("--retries", type=int, default=2,
                   help="rerun a measurement that another process slowed (CPU use < 90%% of the threads)")
    if workload:
        p.add_argument("--workload", default="W1", help="named workload (W1)")
        p.add_argument("--requests", type=int, default=None, help="number of requests (W1: 64)")
        p.add_argument("--lengths", default=None,
                       help="output lengths: fixed:N | uniform:LO-HI | lognormal:MEAN:LO-HI (W1: uniform:16-256)")
        p.add_argument("--seed", type=int, default=None, help="seed of the output lengths (W1: 0)")
        p.add_argument("--in-flight", type=int, default=16, help="concurrent requests (W1: 16)")
        p.add_argument("--repeat", type=int, default=1, help="alternate the modes this many times, keep the best")


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark the engine (throughput, latency, overheads, baselines)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench_command", required=True)

    t = sub.add_parser("throughput", help="continuous vs static batching on one workload")
    _common(t)
    t.add_argument("--no-static", action="store_true", help="skip the static-batching run")

    s = sub.add_parser("sweep", help="continuous vs static over output-length variance (same mean, 136)")
    _common(s)
    s.add_argument("--levels", default=DEFAULT_LEVELS, help=f"comma list of levels ({DEFAULT_LEVELS})")
    s.add_argument("--no-static", action="store_true", help="continuous only (the flatness check)")

    h = sub.add_parser("hf", help="ridge vs HF transformers generate (static batches, fp32)")
    _common(h)
    h.add_argument("--no-ridge", action="store_true", help="only the transformers run")

    v = sub.add_parser("server", help="ridge vs an HTTP server speaking /completion or /v1/completions")
    _common(v)
    v.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    v.add_argument("--api", choices=["llama", "openai"], default="llama")
    v.add_argument("--server-model", default=None, help="the OpenAI 'model' field")
    v.add_argument("--label", default=None, help="what the server is, for the table (e.g. 'llama-server Q4_1 t2')")
    v.add_argument("--timeout", type=float, default=600.0)
    v.add_argument("--no-ridge", action="store_true", help="only the server run")

    o = sub.add_parser("overhead", help="engine step vs the step's matrix products alone (pure decode)")
    _common(o, workload=False)
    o.add_argument("--batches", default="1,16,64", help="pure-decode batch sizes")
    o.add_argument("--context", type=int, default=150, help="context tokens per sequence")
    o.add_argument("--steps", type=int, default=12, help="timed steps per batch size")

    k = sub.add_parser("kv", help="decode step time with each CPU KV dtype (W1-like: 16 x ~150 tokens)")
    _common(k, workload=False)
    k.add_argument("--dtypes", default="fp32,bf16,fp8")
    k.add_argument("--batch", type=int, default=16)
    k.add_argument("--context", type=int, default=150)
    k.add_argument("--steps", type=int, default=10)

    a = sub.add_parser("all", help="the set: throughput (16, 64, 1 in flight), sweep, overhead, kv, hf [, server]")
    _common(a)
    a.add_argument("--skip", default="", help="comma list of parts to skip: throughput,sweep,overhead,kv,hf")
    a.add_argument("--batch1-requests", type=int, default=8, help="requests for the 1-in-flight run")
    a.add_argument("--url", default=None, help="also measure this server (see `ridge bench server`)")
    a.add_argument("--api", choices=["llama", "openai"], default="llama")
    a.add_argument("--server-model", default=None)
    a.add_argument("--label", default=None)
    a.add_argument("--timeout", type=float, default=600.0)

    from .accuracy import add_accuracy_parser
    from .contention import add_contention_parser
    from .hashing import add_hashing_parser
    from .host import add_host_parser
    from .prefix import add_prefix_parser
    from .speculative import add_spec_parser
    from .structured import add_structured_parser
    from .hybrid import add_hybrid_parser
    from .vision import add_vision_parser
    from .moe import add_moe_parser
    from .embeddings import add_embeddings_parser
    from .window import add_window_parser
    from .determinism import add_determinism_parser
    add_spec_parser(sub, _common)
    add_accuracy_parser(sub, _common)
    add_prefix_parser(sub, _common)
    add_structured_parser(sub, _common)
    add_host_parser(sub, _common)
    add_hashing_parser(sub, _common)
    add_contention_parser(sub, _common)
    add_window_parser(sub, _common)
    add_determinism_parser(sub, _common)
    add_moe_parser(sub, _common)
    add_hybrid_parser(sub, _common)
    add_vision_parser(sub, _common)
    add_embeddings_parser(sub, _common)
    from .recurrent import add_recurrent_parser
    add_recurrent_parser(sub, _common)
    from .loading import add_loading_parser
    add_loading_parser(sub)

    for name, sp in sub.choices.items():
        sp.set_defaults(func=run_bench, bench_parser=sp, bench_name=name)


# -- helpers ----------------------------------------------------------------------------------

def command_line(args) -> str:
    """The exact command, rebuilt from the parsed options that differ from their defaults."""
    import shlex

    parts = ["ridge", "bench", args.bench_name]
    for act in args.bench_parser._actions:
        if not act.option_strings or act.dest in ("help",):
            continue
        val = getattr(args, act.dest, None)
        if val == act.default:
            continue
        opt = act.option_strings[-1]
        parts += [opt] if isinstance(act, argparse._StoreTrueAction) else [opt, str(val)]
    return shlex.join(parts)


def workload_for(args, engine=None, requests=None, lengths=None):
    from .workloads import make_workload

    wl = make_workload(args.workload, requests or args.requests, lengths or args.lengths, args.seed)
    if engine is not None:
        wl.tokenize(engine.tokenizer, engine.max_model_len)
    return wl


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# -- parts ----------------------------------------------------------------------------------

def part_throughput(rep: Report, engine, args, in_flight: int, requests=None, static=True, key="throughput"):
    from .runs import compare

    wl = workload_for(args, engine, requests=requests)
    res = compare(engine, wl, in_flight, static=static, tag=f"t{in_flight}-", repeat=args.repeat,
                  retries=args.retries)
    rep.add(key, res)
    rep.throughput_table(f"{wl.name} at {in_flight} in flight", [res])
    if res["continuous"].get("kv_waste", {}).get("samples"):
        rep.waste_table(res)
    return res


def part_sweep(rep: Report, engine, args):
    from .runs import compare
    from .workloads import SWEEP_LEVELS

    levels = dict(SWEEP_LEVELS)
    rows = []
    for name in args.levels.split(",") if hasattr(args, "levels") else levels:
        if name not in levels:
            raise ValueError(f"unknown sweep level {name!r}; known: {', '.join(levels)}")
        wl = workload_for(args, engine, lengths=levels[name])
        res = compare(engine, wl, args.in_flight, static=not getattr(args, "no_static", False), tag=f"sw{name}-",
                      repeat=args.repeat, retries=args.retries)
        res["level"] = name
        rows.append(res)
    c = [r["continuous"]["useful_tok_s"] for r in rows]
    flat = {"continuous_min_tok_s": min(c), "continuous_max_tok_s": max(c),
            "continuous_spread_pct": 100 * (max(c) - min(c)) / max(c)}
    rep.add("sweep", {"levels": rows, "flatness": flat})
    rep.throughput_table(f"sweep over output-length variance, {args.in_flight} in flight", rows, flat)


def part_hf(rep: Report, args, engine=None):
    from ridge.quant.source import resolve_model_path
    from .external import load_hf_model, run_hf
    from .runs import clean_run

    res = {}
    if engine is None and not getattr(args, "no_ridge", False):
        from .runs import make_engine
        engine = make_engine(args, args.in_flight)
    if engine is not None:
        from .runs import run_continuous, warm_up
        warm_up(engine)
        wl = workload_for(args, engine)
        res["ridge"] = clean_run(lambda a: run_continuous(engine, wl, args.in_flight, tag=f"hfr{a}-"), args.retries)
        tok = engine.tokenizer
    else:
        tok = _tokenizer(args)
        wl = workload_for(args)
        wl.tokenize(tok)
    path = resolve_model_path(args.model)
    model, load_s = load_hf_model(path)
    pad = tok.eos_token_ids[0] if tok.eos_token_ids else 0
    res["hf"] = clean_run(lambda a: run_hf(model, wl, args.in_flight, pad), args.retries)
    res["hf"]["load_s"] = load_s
    del model
    gc.collect()
    res["workload"] = wl.describe()
    if "ridge" in res:
        res["ratio"] = res["ridge"]["useful_tok_s"] / res["hf"]["useful_tok_s"]
    rep.add("hf", res)
    rep.baseline_table(f"ridge vs HF transformers generate (fp32, static batches of {args.in_flight})", res,
                       "hf", "transformers")


def _tokenizer(args, engine=None):
    if engine is not None:
        return engine.tokenizer
    from ridge.models.fp8_calibrate import calibrate
    from ridge.models.loader import default_device
    from ridge.models.registry import convert
    device = getattr(args, "device", None) or default_device().type
    return convert(args.model, show_progress=False, recipe=getattr(args, "fp8_recipe", None), calibrate=calibrate,
                   device=str(device).split(":")[0]).tokenizer  # the entry the engine's conversion made


def _peer_note(engine, args) -> str | None:
    """How to keep the peer's idle threads from skewing ridge's CPU figures. ridge's thread governor
    reads CPU time other processes take as work and shrinks its team to the cores left (ridge/engine/
    threads.py); a server whose idle threads spin between requests (llama-server's default --poll 50)
    looks like such work, though it yields the core the moment ridge wants it."""
    if engine is None or engine.device.type != "cpu" or not engine.config.adaptive_threads:
        return None
    peer = "llama-server with --poll 0 (its idle threads then sleep)" if args.api == "llama" else \
        "the peer with its idle threads sleeping"
    return (f"ridge ran with its thread governor on: run {peer}, or ridge with --fixed-threads, so that "
            "the peer's spinning idle threads do not read as other work and shrink ridge's team")


def part_server(rep: Report, args, engine=None, in_flights=None, requests_for=None):
    """The server and ridge in-process on the same trace. With --repeat R the two alternate R times
    (server, in-process, server, ...) and the best of each is kept. An OpenAI server's /metrics
    gives the CPU it used while serving (ridge's gateway: its own, and its daemon's socket thread)."""
    from .external import cpu_used, run_server, server_cpu, server_info
    from .runs import clean_run, run_continuous

    tok = _tokenizer(args, engine)
    info = server_info(args.url, args.api)
    label = args.label or f"server ({args.api}, {args.url})"
    out = []
    for n in in_flights or [args.in_flight]:
        wl = workload_for(args, requests=(requests_for or {}).get(n))
        wl.tokenize(tok, engine.max_model_len if engine is not None else None)
        res = {"in_flight": n, "workload": wl.describe(), "server_info": info, "label": label, "rounds": [],
               "peer_note": _peer_note(engine, args)}
        best: dict = {}
        for a in range(max(1, getattr(args, "repeat", 1))):
            cpu0 = server_cpu(args.url) if args.api == "openai" else {}
            srv = run_server(args.url, args.api, wl, wl.prompt_texts(tok), n, args.server_model, args.timeout)
            if cpu0:
                srv["server_cpu"] = cpu_used(cpu0, server_cpu(args.url), srv["wall_s"])
            rnd = {"server": srv}
            if engine is not None:
                rnd["ridge"] = clean_run(lambda t: run_continuous(engine, wl, n, tag=f"srv{n}.{a}.{t}-"), args.retries)
            for side, m in rnd.items():
                if side not in best or (m["useful_tok_s"] or 0) > (best[side]["useful_tok_s"] or 0):
                    best[side] = m
            res["rounds"].append({side: m["useful_tok_s"] for side, m in rnd.items()})
        res.update(best)
        if engine is not None:
            res["ratio"] = res["ridge"]["useful_tok_s"] / res["server"]["useful_tok_s"]
            res["server_over_ridge"] = 1 / res["ratio"]
            # each round's pair ran minutes apart at most: on a shared machine its ratio is the steadier figure
            pairs = sorted(r["server"] / r["ridge"] for r in res["rounds"])
            res["server_over_ridge_by_round"] = pairs
            res["server_over_ridge_median"] = statistics.median(pairs)
        out.append(res)
        rep.baseline_table(f"ridge vs {label} at {n} in flight ({wl.num_requests} requests)", res, "server", label)
    rep.add("server", out)


def part_overhead(rep: Report, engine, args):
    from .decode import run_overhead

    from ridge.kernels import native

    # The bound a step's reads run against: the memory's read bandwidth with the products' thread team.
    bandwidth = native.read_bandwidth() if engine.device.type == "cpu" else None
    rows = [run_overhead(engine, b, args.context, args.steps, retries=args.retries, bandwidth=bandwidth)
            for b in _ints(args.batches)]
    rep.add("overhead", rows)
    rep.data["env"]["read_bandwidth_gbs"] = bandwidth / 1e9 if bandwidth else None
    llc = native.last_level_cache() if engine.device.type == "cpu" else None
    rep.data["env"]["last_level_cache_mib"] = llc / 2 ** 20 if llc else None
    rep.overhead_table(rows, bandwidth, llc)


def part_kv(rep: Report, args, loaded=None):
    from dataclasses import replace

    from ridge.engine.config import engine_config
    from .decode import run_kv_dtypes
    from ridge.engine.engine import LLMEngine

    base = engine_config(args)
    blocks = args.batch * (-(-(args.context + 3 * args.steps + 64) // base.block_size)) + 16
    engines = {}
    for dt in args.dtypes.split(","):
        cfg = replace(base, kv_dtype=dt, max_num_seqs=args.batch, num_kv_blocks=blocks)
        engines[dt] = LLMEngine(cfg, loaded=loaded)
        loaded = engines[dt].loaded
    first = engines[next(iter(engines))]
    default = replace(base, kv_dtype=None).resolved_kv_dtype(loaded.device)
    rep.set_env(first)
    rep.data["env"]["kv_dtype"] = "per row (" + args.dtypes + ")"
    res = run_kv_dtypes(engines, args.batch, args.context, args.steps, retries=args.retries)
    del engines
    gc.collect()
    best = min(res.values(), key=lambda r: r["step_ms"])["kv_dtype"]
    rep.add("kv", {"by_dtype": res, "fastest": best, "engine_default": default})
    rep.kv_table(res, best, default)
    return loaded


# -- entry --------------------------------------------------------------------------------

def run_bench(args) -> int:
    import torch

    name = args.bench_name
    if name == "loading":
        from .loading import run_loading
        return run_loading(args)
    rep = Report(command_line(args), md=args.md)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = None
    if name == "spec":
        from .speculative import run_spec
        run_spec(args, rep)
        return 0
    if name == "prefix":
        from .prefix import run_prefix
        run_prefix(args, rep)
        return 0
    if name == "accuracy":
        from .accuracy import run_accuracy
        rep.set_env(None, args)
        run_accuracy(args, rep)
        return 0
    if name == "hashing":
        from .hashing import run_hashing
        rep.set_env(None, args)
        run_hashing(args, rep)
        _write_json(rep, args)
        return 0
    if name == "window":
        from .window import run_window
        run_window(args, rep)
        _write_json(rep, args)
        return 0
    if name == "determinism":
        from .determinism import run_determinism
        run_determinism(args, rep)
        _write_json(rep, args)
        return 0
    if name == "moe":
        from .moe import run_moe
        run_moe(args, rep)
        _write_json(rep, args)
        return 0
    if name == "hybrid":
        from .hybrid import run_hybrid
        run_hybrid(args, rep)
        _write_json(rep, args)
        return 0
    if name == "vision":
        from .vision import run_vision
        run_vision(args, rep)
        _write_json(rep, args)
        return 0
    if name == "recurrent":
        from .recurrent import run_recurrent
        run_recurrent(args, rep)
        _write_json(rep, args)
        return 0
    if name == "embeddings":
        from .embeddings import run_embeddings
        run_embeddings(args, rep)
        _write_json(rep, args)
        return 0
    if name == "structured":
        from .structured import run_structured
        run_structured(args, rep)
        _write_json(rep, args)
        return 0
    needs_engine = name in ("throughput", "sweep", "overhead", "host", "contention", "all") or (
        name in ("hf", "server") and not args.no_ridge)
    if needs_engine:
        need = max([getattr(args, "in_flight", 1)] + (_ints(args.batches) if name == "overhead" else [])
                   + ([args.batch] if name == "host" else [])
                   + ([64] if name == "all" else []))
        from .runs import make_engine
        engine = make_engine(args, need)
        rep.set_env(engine)
        from .runs import warm_up
        warm_up(engine)
    else:
        rep.set_env(None, args)
    skip = set(getattr(args, "skip", "").split(",")) - {""}
    t0 = time.perf_counter()
    if name == "throughput":
        part_throughput(rep, engine, args, args.in_flight, static=not args.no_static)
    elif name == "sweep":
        part_sweep(rep, engine, args)
    elif name == "hf":
        part_hf(rep, args, engine)
    elif name == "server":
        part_server(rep, args, engine)
    elif name == "overhead":
        part_overhead(rep, engine, args)
    elif name == "host":
        from .host import host_table, run_host
        rows = run_host(engine, args.batch, _ints(args.contexts), args.steps, args.interleave)
        rep.add("host", rows)
        host_table(rep, rows)
    elif name == "contention":
        from .contention import contention_table, run_contention
        res = run_contention(engine, workload_for(args, engine), args.in_flight, args.compete_threads)
        rep.add("contention", res)
        contention_table(rep, res)
    elif name == "kv":
        part_kv(rep, args)
    elif name == "all":
        if "throughput" not in skip:
            part_throughput(rep, engine, args, args.in_flight)
            part_throughput(rep, engine, args, 64, key="throughput_64")
            part_throughput(rep, engine, args, 1, requests=args.batch1_requests, static=False, key="throughput_1")
        if "sweep" not in skip:
            args.levels = DEFAULT_LEVELS
            part_sweep(rep, engine, args)
        if "overhead" not in skip:
            args.batches, args.context, args.steps = "1,16,64", 150, 12
            part_overhead(rep, engine, args)
        if args.url:
            part_server(rep, args, engine, [args.in_flight, 64, 1], {1: args.batch1_requests})
        if "hf" not in skip:
            part_hf(rep, args, engine)
        if "kv" not in skip:
            args.dtypes, args.batch, args.context, args.steps = "fp32,bf16,fp8", 16, 150, 10
            loaded = engine.loaded
            del engine
            gc.collect()
            part_kv(rep, args, loaded)
    rep.data["elapsed_s"] = time.perf_counter() - t0
    _write_json(rep, args)
    return 0


def _write_json(rep: Report, args) -> None:
    rep.data["env"]["loadavg_end"] = list(os.getloadavg())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.data, f, indent=1, default=str)
        print(f"wrote {args.json}", file=sys.stderr)
