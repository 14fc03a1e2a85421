"""`ridge bench structured`: which library, and what a constraint costs a step.

    ridge bench structured --part libraries   xgrammar, llguidance, outlines-core on the
                                              model's vocabulary: tokenizer set-up, compile
                                              time, mask time per token at batch 1 and 16,
                                              and correctness on the case set (greedy)
    ridge bench structured --part overhead    batch 16 with half the batch constrained:
                                              the step's constraint section (matcher sync,
                                              masks, the batched apply) against the step,
                                              and the same step with no constraint

The case set is ridge/bench/structured_cases.py (12 JSON schemas, 8 regexes).
A library that is not installed is reported as such."""
from __future__ import annotations

import json
import re
import statistics
import time

import torch

from .structured_cases import REGEXES, SCHEMAS, TYPICAL


def add_structured_parser(sub, common) -> None:
    p = sub.add_parser("structured", help="structured output: the libraries compared, and the mask overhead")
    common(p, workload=False)
    p.add_argument("--part", choices=["libraries", "overhead", "all"], default="all")
    p.add_argument("--libraries", default="llguidance,xgrammar,outlines-core")
    p.add_argument("--max-tokens", type=int, default=160, help="per case, greedy (libraries)")
    p.add_argument("--batch", type=int, default=16, help="decode batch (overhead); half of it constrained")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per run (overhead)")
    p.add_argument("--repeat", type=int, default=3, help="alternate constrained and plain runs, keep medians")


def cases() -> list[tuple[str, str, str, object]]:
    """-> (name, kind, prompt, spec) for every case."""
    return [(n, "json", p, s) for n, (p, s) in SCHEMAS.items()] + [(n, "regex", p, r) for n, (p, r) in REGEXES.items()]


def conforms(kind: str, spec, text: str) -> bool:
    try:
        if kind == "regex":
            return re.fullmatch(spec, text) is not None
        value = json.loads(text)
        try:
            import jsonschema
        except ImportError:  # a test dependency: without it, parsing is what is checked
            return True
        jsonschema.validate(value, spec)
        return True
    except Exception:
        return False


# -- libraries ---------------------------------------------------------------------------------
@torch.inference_mode()
def greedy_under(model, lib, compiled, ids: list[int], max_tokens: int, eos) -> tuple[list[int], list[float]]:
    """Greedy decoding of one sequence with the library's masks; -> (tokens, mask seconds per token)."""
    from ridge.cache.kv_cache import KVCache
    from ridge.kernels.metadata import AttentionMetadata

    bs = 16
    nb = -(-(len(ids) + max_tokens) // bs)
    cache = KVCache(model.cfg, nb, bs, "fp32", model.cos_sin.device)
    table = [list(range(nb))]
    m, bitmask = lib.matcher(compiled), lib.alloc(1)
    V = model.cfg.vocab_size
    shifts = torch.arange(32, dtype=torch.int32)
    n = len(ids)
    h = model(torch.tensor(ids), torch.arange(n), AttentionMetadata.build([n], [n], table, list(range(n))), cache.layers)
    logits = model.compute_logits(h[-1:])
    out, mask_s = [], []
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        lib.fill([m], bitmask)
        mask_s.append(time.perf_counter() - t0)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(1, -1)[:, :V].bool()
        t = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        if t in eos or not lib.consume(m, t):
            break
        out.append(t)
        pos = n + len(out) - 1
        h = model(torch.tensor([t]), torch.tensor([pos]), AttentionMetadata.build([1], [pos + 1], table, [pos]),
                  cache.layers)
        logits = model.compute_logits(h)
    return out, mask_s


def batch_mask_ms(lib, compiled: dict, trajectories: list, batch: int) -> float:
    """Median time to fill `batch` rows at once, replaying greedy outputs (cycling the cases)."""
    picks = [trajectories[i % len(trajectories)] for i in range(batch)]
    ms = [lib.matcher(compiled[name]) for name, _ in picks]
    bitmask = lib.alloc(batch)
    times = []
    for s in range(min(len(t) for _, t in picks)):
        t0 = time.perf_counter()
        lib.fill(ms, bitmask)
        times.append(time.perf_counter() - t0)
        for m, (_, toks) in zip(ms, picks):
            lib.consume(m, toks[s])
    return 1e3 * statistics.median(times) if times else float("nan")


def run_library(name: str, loaded, args) -> dict:
    from .structured_libs import LIBRARIES

    tok, model = loaded.tokenizer, loaded.model
    try:
        lib = LIBRARIES[name](tok, loaded.config.vocab_size)
    except ImportError:
        return {"library": name, "installed": False}
    res = {"library": name, "version": lib.version, "installed": True, "tokenizer_ms": 1e3 * lib.tokenizer_s,
           "ok": 0, "cases": 0, "failures": []}
    compile_ms, mask_s, compiled, trajectories = {}, [], {}, []
    for case, kind, prompt, spec in cases():
        res["cases"] += 1
        t0 = time.perf_counter()
        try:
            compiled[case] = lib.compile(kind, spec)
        except Exception as e:
            res["failures"].append(f"{case}: does not compile: {e}"[:200])
            continue
        compile_ms[case] = 1e3 * (time.perf_counter() - t0)
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        out, ms = greedy_under(model, lib, compiled[case], ids, args.max_tokens, set(tok.eos_token_ids))
        mask_s += ms
        trajectories.append((case, out))
        text = tok.decode(out)
        if conforms(kind, spec, text):
            res["ok"] += 1
        else:
            res["failures"].append(f"{case}: {text[:120]!r}")
    res.update(compile_ms_typical=compile_ms.get(TYPICAL), compile_ms_median=statistics.median(compile_ms.values()),
               compile_ms_max=max(compile_ms.values()), mask_ms_b1_median=1e3 * statistics.median(mask_s),
               mask_ms_b1_p99=1e3 * sorted(mask_s)[int(0.99 * (len(mask_s) - 1))],
               mask_ms_b16_median=batch_mask_ms(lib, compiled, trajectories, 16))
    return res


def part_libraries(rep, args) -> None:
    from ridge.models.loader import load_model

    loaded = load_model(args.model, device=args.device or "cpu", weights=args.weights, max_model_len=4096,
                        show_progress=False)
    rows = [run_library(n, loaded, args) for n in args.libraries.split(",")]
    rep.add("libraries", rows)
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    rep.table(f"structured output libraries on {loaded.config.name} ({loaded.config.vocab_size} tokens)",
              ["library", "version", "tokenizer ms", "compile ms typical/median/max", "mask ms b1 median/p99",
               "mask ms b16 median", "valid greedy"],
              [[r["library"], r.get("version", "-"), f(r.get("tokenizer_ms")),
                f"{f(r.get('compile_ms_typical'))} / {f(r.get('compile_ms_median'))} / {f(r.get('compile_ms_max'))}",
                f"{f(r.get('mask_ms_b1_median'))} / {f(r.get('mask_ms_b1_p99'))}", f(r.get("mask_ms_b16_median")),
                f"{r['ok']}/{r['cases']}"] if r["installed"] else [r["library"], "not installed"] + ["-"] * 5
               for r in rows],
              note="\n".join(f"{r['library']} failed: {x}" for r in rows for x in r.get("failures", [])) or None)


# -- overhead ----------------------------------------------------------------------------------
def _decode_run(engine, prompts: list, formats: list, steps: int) -> dict:
    """Admit every prompt, finish the prefill, then time `steps` decode steps while all run."""
    from ridge.engine.sampling_params import SamplingParams

    from .profile import step_breakdown

    for i, (ids, fmt) in enumerate(zip(prompts, formats)):
        engine.add_request(f"o{i}", ids, SamplingParams(max_tokens=steps + 64, response_format=fmt,
                                                        ignore_eos=fmt is None))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    with step_breakdown(engine) as bd:
        for _ in range(steps):
            if len(engine.scheduler.running) < len(prompts):
                break  # a constrained output ended: the batch is no longer the one measured
            bd.step(engine.step)
    for i in range(len(prompts)):
        engine.abort_request(f"o{i}")
    while engine.has_unfinished():
        engine.step()
    ms = bd.per_step_ms()
    return {"steps": bd.steps, "step_ms": ms.get("total"), "constraints_ms": ms.get("constraints", 0.0),
            "sample_ms": ms.get("sample", 0.0)}


def part_overhead(rep, engine, args) -> None:
    b = args.batch
    names = list(SCHEMAS)
    prompts, formats = [], []
    for i in range(b):
        prompt, schema = SCHEMAS[names[i % len(names)]]
        prompts.append(engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]))
        formats.append({"type": "json_schema", "json_schema": {"schema": schema}} if i % 2 == 0 else None)
    runs = {"half constrained": [], "none constrained": []}
    for _ in range(args.repeat):  # alternate, so that other load on the machine hits both alike
        runs["half constrained"].append(_decode_run(engine, prompts, formats, args.steps))
        runs["none constrained"].append(_decode_run(engine, prompts, [None] * b, args.steps))
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("step_ms", "constraints_ms", "sample_ms")}
           for k, v in runs.items()}
    half, none = med["half constrained"], med["none constrained"]
    res = {"batch": b, "constrained": (b + 1) // 2, "runs": runs, "median": med,
           "constraints_share": half["constraints_ms"] / half["step_ms"],
           "step_ratio": half["step_ms"] / none["step_ms"]}
    rep.add("overhead", res)
    rep.table(f"constraint overhead, batch {b}, {res['constrained']} constrained (JSON schemas), "
              f"{args.steps} decode steps x {args.repeat}",
              ["run", "step ms", "constraints section ms", "sample ms", "constraints / step"],
              [[k, f"{v['step_ms']:.1f}", f"{v['constraints_ms']:.2f}", f"{v['sample_ms']:.2f}",
                f"{100 * v['constraints_ms'] / v['step_ms']:.1f}%"] for k, v in med.items()],
              note=f"step time with half the batch constrained / without: {res['step_ratio']:.3f}")


def run_structured(args, rep) -> None:
    from .runs import make_engine

    if args.part in ("libraries", "all"):
        rep.set_env(None, args)
        part_libraries(rep, args)
    if args.part in ("overhead", "all"):
        engine = make_engine(args, args.batch)
        rep.set_env(engine)
        part_overhead(rep, engine, args)
