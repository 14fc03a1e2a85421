"""`ridge bench-daemon`: the daemon against the engine in-process on the same
workload, and the idle round trip of `health`.

The daemon side is closed-loop like ridge/bench/runs.run_continuous:
`in_flight` asyncio clients each send a W1 request (chat messages, tokenized
by the daemon; ignore_eos; the W1 output length), stream it to its final
frame, then send the next. The in-process side is run_continuous itself, on an
engine built from the same flags and with the daemon's KV pool size, while the
daemon idles: rounds alternate between the two, so that outside load falls on
both alike.

Both engines hold their memory at once. On a GPU the daemon would size its pool
to all free memory and leave the in-process engine none (issue 12), so unless
the pool is sized by flag the daemon is told to leave half of the free memory
to this process; the in-process engine then takes the daemon's pool size."""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from ridge.spawn import python


def add_bench_daemon_parser(sub) -> None:
    from ridge.engine.config import add_engine_args

    p = sub.add_parser("bench-daemon", help="daemon vs in-process throughput (W1), and health round trips")
    p.add_argument("--endpoint", default=None, help="measure this running daemon instead of starting one")
    p.add_argument("--in-flight", type=int, default=32)
    p.add_argument("--requests", type=int, default=None, help="W1 requests (default 64)")
    p.add_argument("--lengths", default=None, help="W1 output lengths (default uniform:16-256)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--health", type=int, default=2000, help="idle health round trips to time")
    p.add_argument("--no-local", action="store_true", help="skip the in-process runs")
    p.add_argument("--rounds", type=int, default=2, help="alternating daemon / in-process rounds")
    p.add_argument("--no-stream", action="store_true", help="daemon requests without streaming (one frame each)")
    p.add_argument("--startup", type=int, default=0, metavar="N",
                   help="only time N starts of `ridge serve`, from exec to the first health reply")
    p.add_argument("--thread-check", action="store_true",
                   help="only time engine steps on the main thread, on another thread, and built on another thread")
    p.add_argument("--health-under-load", type=int, default=0, metavar="N",
                   help="only time health round trips while N clients send 512 KiB prompts and new JSON schemas")
    p.add_argument("--load-seconds", type=float, default=10.0, help="how long --health-under-load pings")
    p.add_argument("--json", default=None, metavar="PATH")
    add_engine_args(p)
    p.set_defaults(func=run_bench_daemon)


async def _daemon_run(endpoint: str, wl, in_flight: int, stream: bool = True) -> dict:
    from ridge.daemon.aio_client import AsyncClient

    async with AsyncClient(endpoint, timeout=600) as c:
        await c.hello()
        for q in wl.questions[:2]:  # warm-up
            await c.generate(messages=[{"role": "user", "content": q}], max_tokens=8, ignore_eos=True)
        nxt, tokens, ttft, reasons = 0, 0, [], {}

        async def worker():
            nonlocal nxt, tokens
            while nxt < wl.num_requests:
                i, nxt = nxt, nxt + 1
                t0, first = time.perf_counter(), None
                kw = dict(messages=wl.messages(i), max_tokens=wl.lengths[i], ignore_eos=True, temperature=0.0)
                if stream:
                    s = c.stream(**kw)
                    async for d in s:
                        first = first or time.perf_counter()
                        tokens += len(d.token_ids)
                    final = s.final
                else:  # one frame per request: what streaming itself costs
                    final = await c.generate(**kw)
                    tokens += len(final.token_ids)
                ttft.append(first - t0 if first else None)
                reasons[final.finish_reason] = reasons.get(final.finish_reason, 0) + 1

        busy_health: list[float] = []

        async def pinger():  # health while the engine is busy: the socket thread must not wait for it
            while True:
                await asyncio.sleep(0.5)
                t = time.perf_counter()
                await c.health()
                busy_health.append(time.perf_counter() - t)

        st0 = await c.stats()
        totals0, cpu0 = st0["stats"]["totals"], st0["daemon"]["cpu_s"]
        t0, cpu_c = time.perf_counter(), time.process_time()
        ping = asyncio.create_task(pinger())
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        wall = time.perf_counter() - t0
        ping.cancel()
        st1 = await c.stats()
        totals1, cpu1 = st1["stats"]["totals"], st1["daemon"]["cpu_s"]  # totals may lag one snapshot interval
    from .workloads import percentiles
    return {"mode": "daemon", "wall_s": wall, "generated_tokens": tokens, "generated_tok_s": tokens / wall,
            "useful_tokens": wl.useful_tokens, "finish_reasons": reasons, "ttft_s": percentiles(ttft),
            "health_under_load_s": percentiles(busy_health), "loadavg_end": list(os.getloadavg()),
            "steps": totals1["steps"] - totals0["steps"],
            "daemon_cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0}, "client_cpu_s": time.process_time() - cpu_c}


def health_latency(endpoint: str, n: int) -> dict:
    from ridge.daemon.client import Client

    with Client(endpoint) as c:
        for _ in range(50):
            c.health()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.health()
            times.append(time.perf_counter() - t0)
    times.sort()
    return {"n": n, "p50_us": 1e6 * times[n // 2], "p99_us": 1e6 * times[int(n * 0.99)],
            "mean_us": 1e6 * sum(times) / n, "min_us": 1e6 * times[0]}


def _share_the_gpu(args) -> list[str]:
    """`ridge serve` flags that leave half of the device's free memory (weights,
    activations and KV pool alike) to the in-process engine; none where the two
    do not share a GPU or the user sized the pool."""
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" or args.no_local or args.num_kv_blocks is not None or args.kv_memory_gib is not None:
        return []
    free, _ = torch.cuda.mem_get_info(device)  # this process's CUDA context is already counted out
    return ["--gpu-reserve-gib", f"{args.gpu_reserve_gib + free / 2 / 2**30:.3f}"]


def _pool_blocks(endpoint: str) -> int:
    from ridge.daemon.client import Client

    with Client(endpoint) as c:
        return int(c.hello()["model"]["num_kv_blocks"])


def _spawn(args, in_flight: int, poll_s: float = 0.2):
    tmp = tempfile.mkdtemp(prefix="ridge-bench-")
    endpoint = f"ipc://{tmp}/ridge.sock"
    from ridge.engine.config import engine_options

    cmd = [*python("-m", "ridge.cli"), "serve", "--endpoint", endpoint,
           "--max-num-seqs", str(max(args.max_num_seqs, in_flight))]
    for o in engine_options():  # the same engine flags as the in-process run
        if o.name != "max_num_seqs":
            cmd += o.argv(getattr(args, o.name))
    cmd += _share_the_gpu(args)  # after the user's flags: the last one wins
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    from ridge.daemon.transport.endpoint import ipc_path, socket_alive
    deadline = time.monotonic() + 600
    while not socket_alive(ipc_path(endpoint)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the daemon did not start:\n{proc.stderr.read()}")
        time.sleep(poll_s)
    return proc, endpoint


def startup_times(args, n: int) -> list[float]:
    """Seconds from the exec of `ridge serve` to its first health reply, n starts in a row: the
    first may convert the model into the cache, the later ones start as a restart does."""
    from ridge.daemon.client import Client

    times = []
    for i in range(n):
        t0 = time.perf_counter()
        proc, endpoint = _spawn(args, 1, poll_s=0.01)
        try:
            with Client(endpoint) as c:
                c.health()
            times.append(time.perf_counter() - t0)
            print(f"start {i}: ready in {times[-1]:.2f} s", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
    return times


def _timed_steps(engine, tag: str, batch: int = 32, steps: int = 40) -> dict:
    """ms per decode step and cores used (this process's CPU time over wall time) at `batch`."""
    from ridge.engine.sampling_params import SamplingParams

    for i in range(batch):
        engine.add_request(f"{tag}{i}", engine.tokenizer.encode_chat([{"role": "user", "content": f"Question {i}"}]),
                           SamplingParams(max_tokens=steps + 20, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:  # past every prefill: time pure decode steps
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    while engine.has_unfinished():
        engine.step()
    return {"where": tag, "ms_per_step": 1e3 * wall / steps, "cores": cpu / wall}


def thread_check(args) -> list[dict]:
    """Why the daemon builds its engine on the engine thread (engine_loop.py)."""
    import threading

    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine

    out: list[dict] = []

    def on_thread(fn):
        t = threading.Thread(target=fn)
        t.start()
        t.join()

    main_engine = LLMEngine(engine_config(args))
    out.append(_timed_steps(main_engine, "built and stepped on the main thread"))
    on_thread(lambda: out.append(_timed_steps(main_engine, "built on the main thread, stepped on another")))
    del main_engine
    on_thread(lambda: out.append(_timed_steps(LLMEngine(engine_config(args)), "built and stepped on another thread")))
    for r in out:
        print(f"{r['where']}: {r['ms_per_step']:.1f} ms per step at batch 32, {r['cores']:.2f} cores", flush=True)
    return out


def run_bench_daemon(args) -> int:
    """Rounds alternate daemon and in-process runs of the same trace, so that load from
    elsewhere on the machine falls on both alike; the ratio is taken per round."""
    import statistics

    from .workloads import make_workload

    if args.health_under_load:
        return _run_health_under_load(args)
    if args.thread_check or args.startup:
        res = {"command": shlex.join(["ridge", "bench-daemon"] + sys.argv[2:])}
        if args.thread_check:
            res["thread_check"] = thread_check(args)
        if args.startup:
            t = res["startup_s"] = startup_times(args, args.startup)
            print(f"ready after a start: first {t[0]:.2f} s, then median {statistics.median(t[1:] or t):.2f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        return 0
    wl = make_workload("W1", args.requests, args.lengths, args.seed)
    res = {"command": shlex.join(["ridge", "bench-daemon"] + sys.argv[2:]),
           "workload": {"name": wl.name, "requests": wl.num_requests, "lengths": wl.law, "seed": wl.seed,
                        "useful_tokens": wl.useful_tokens}, "in_flight": args.in_flight, "cpu_count": os.cpu_count(),
           "rounds": []}
    proc, endpoint = (None, args.endpoint) if args.endpoint else _spawn(args, args.in_flight)
    try:
        blocks = res["kv_blocks"] = {"daemon": _pool_blocks(endpoint)}
        engine = None if args.no_local else _local_engine(args, wl, blocks["daemon"])
        if engine is not None:
            blocks["in_process"] = engine.kv_cache_manager.num_blocks
        for r in range(args.rounds):
            rnd = {"daemon": asyncio.run(_daemon_run(endpoint, wl, args.in_flight, not args.no_stream))}
            d = rnd["daemon"]
            print(f"round {r}: daemon     {d['generated_tok_s']:.1f} tok/s ({d['generated_tokens']} tokens in "
                  f"{d['wall_s']:.1f} s, ~{d['steps']} steps); health while busy: p50 {_ms(d['health_under_load_s']['p50'])}, "
                  f"p99 {_ms(d['health_under_load_s']['p99'])}; load {d['loadavg_end'][0]:.1f}; cpu s: socket "
                  f"thread {d['daemon_cpu_s']['socket_thread']:.1f}, daemon {d['daemon_cpu_s']['process']:.1f}, "
                  f"client {d['client_cpu_s']:.1f}", flush=True)
            if engine is not None:
                from .runs import run_continuous
                loc = rnd["local"] = run_continuous(engine, wl, args.in_flight, tag=f"local{r}")
                rnd["ratio"] = d["generated_tok_s"] / loc["generated_tok_s"]
                print(f"round {r}: in-process {loc['generated_tok_s']:.1f} tok/s ({loc['generated_tokens']} tokens in "
                      f"{loc['wall_s']:.1f} s, {loc['steps']} steps, cpu {loc['cpu_util']:.2f}); "
                      f"daemon / in-process {rnd['ratio']:.3f}",
                      flush=True)
            res["rounds"].append(rnd)
        if args.health:
            h = res["health"] = health_latency(endpoint, args.health)
            print(f"health:     p50 {h['p50_us']:.0f} us, p99 {h['p99_us']:.0f} us, mean {h['mean_us']:.0f} us "
                  f"over {h['n']} idle round trips", flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    ratios = [r["ratio"] for r in res["rounds"] if "ratio" in r]
    if ratios:
        res["ratio_median"] = statistics.median(ratios)
        print(f"daemon / in-process, median of {len(ratios)} round(s): {res['ratio_median']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _run_health_under_load(args) -> int:
    from .health_load import health_under_load

    proc, endpoint = (None, args.endpoint) if args.endpoint else _spawn(args, 1)
    try:
        r = health_under_load(endpoint, args.health_under_load, args.load_seconds)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    r["command"] = shlex.join(["ridge", "bench-daemon"] + sys.argv[2:])
    i, b = r["idle_s"], r["loaded_s"]
    print(f"health idle: p50 {_ms(i['p50'])}, p99 {_ms(i['p99'])}; under {r['clients']} loaders: p50 "
          f"{_ms(b['p50'])}, p99 {_ms(b['p99'])}, max {_ms(r['max_s'])} over {r['round_trips']} round trips; "
          f"loader replies {r['loader_replies']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f} ms"  # None: a run too short to sample


def _local_engine(args, wl, num_kv_blocks: int):
    """The in-process engine: the daemon's flags and KV pool size (built while the daemon idles)."""
    from ridge.engine.config import engine_config
    from .runs import warm_up
    from ridge.engine.engine import LLMEngine

    cfg = engine_config(args)
    cfg.max_num_seqs = max(cfg.max_num_seqs, args.in_flight)
    cfg.num_kv_blocks = num_kv_blocks
    engine = LLMEngine(cfg)
    wl.tokenize(engine.tokenizer, engine.max_model_len)
    warm_up(engine)
    return engine
