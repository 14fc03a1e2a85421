"""`ridge bench spec`: speculative decoding per proposer, at batch 1 and 16,
on a repetitive set (repeat, edit or quote the prompt) and an open-ended set
(stories). Greedy, so each proposer's output is checked against plain decoding."""
from __future__ import annotations

import json
import sys
import time

REPETITIVE = [
    "Repeat the following text exactly, word for word:\n\nThe quick brown fox jumps over the lazy dog. A journey "
    "of a thousand miles begins with a single step. All that glitters is not gold. The early bird catches the worm.",
    "Here is a Python function:\n\ndef area(width, height):\n    result = width * height\n    return result\n\n"
    "Rewrite it with the name rectangle_area instead of area, and print the whole function.",
    "Copy this list exactly, one item per line:\napples\nbananas\ncherries\ndates\nelderberries\nfigs\ngrapes",
    "Quote the first sentence of this paragraph exactly: \"Water boils at one hundred degrees Celsius at sea "
    "level. At higher altitudes it boils at lower temperatures because the air pressure is lower.\"",
    "Repeat after me: I will always check my work before I submit it. I will always check my work before I "
    "submit it.",
    "Here is JSON: {\"name\": \"Ada\", \"age\": 36, \"city\": \"London\"}. Write it out again with the age changed to 37.",
]
OPEN_ENDED = [
    "Write a short story about a lighthouse keeper.",
    "Tell me a story about a dragon who is afraid of heights.",
    "Write a story about two friends lost in a forest.",
    "Write a short fairy tale about a clever fox.",
    "Tell a bedtime story about the moon and the sea.",
    "Write a story about a robot learning to paint.",
]
SETS = {"repetitive": REPETITIVE, "open": OPEN_ENDED}


def add_spec_parser(sub, common) -> None:
    sp = sub.add_parser("spec", help="speculative decoding per proposer: repetitive and open-ended sets, batch 1 and 16")
    common(sp, workload=False)
    sp.add_argument("--proposers", default="ngram,self:8,auto", help="comma list, compared against off")
    sp.add_argument("--batches", default="1,16", help="requests in flight")
    sp.add_argument("--sets", default="repetitive,open")
    sp.add_argument("--max-tokens", type=int, default=128)
    sp.add_argument("--repeats", type=int, default=1, help="copies of the set per run at batch 1")
    sp.add_argument("--rounds", type=int, default=3, help="runs of every mode, taken in turn; medians reported")
    sp.add_argument("--server-url", default=None,
                    help="also time this llama-server's plain decode of the batch-1 prompts (same output lengths)")


def _run(engine, prompts: list[list[int]], max_tokens: int, batch: int):
    from ridge.engine.sampling_params import SamplingParams

    outs = {}
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = [engine.add_request(f"s{i + j}", p, SamplingParams(max_tokens=max_tokens))
               for j, p in enumerate(prompts[i:i + batch])]
        toks = {r: [] for r in ids}
        while engine.has_unfinished():
            for o in engine.step():
                toks[o.request_id] += o.new_token_ids
        outs.update(toks)
    return outs, time.perf_counter() - t0


class StepTimer:
    """Times the runner's work per step by the tokens in the step, decode steps only (no
    prompt tokens): what a verification of 1 + k tokens costs against a 1-token step."""

    def __init__(self, engine):
        self.times: dict[int, list[float]] = {}

        def observe(out, seconds: float) -> None:
            if not any(s.start < s.request.num_prompt_tokens for s in out.scheduled):
                tokens = sum(s.num_scheduled_tokens for s in out.scheduled)
                self.times.setdefault(tokens, []).append(seconds)
        engine.step_observers.append(observe)

    def summary(self) -> dict[int, dict]:
        import statistics

        return {t: {"steps": len(v), "ms": 1e3 * statistics.median(v)} for t, v in sorted(self.times.items())}


def _prompts(engine, name: str, batch: int, repeats: int) -> list[list[int]]:
    texts = SETS[name]
    n = max(batch, len(texts) * repeats) if batch > 1 else len(texts) * repeats
    return [engine.tokenizer.encode_chat([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(n)]


def _same_prefix(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), 1)


def part_spec(rep, args, loaded) -> None:
    """Every mode of one (batch, set) gets its own engine, built once; rounds then run the
    modes in turn, so that drifting machine load falls on all alike. Speedup is taken per
    round against that round's plain run, and the median over rounds is reported."""
    import statistics

    from ridge.engine.engine import LLMEngine
    from ridge.engine.config import engine_config

    modes = ["off"] + args.proposers.split(",")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for name in args.sets.split(","):
            engines = {}
            for spec in modes:
                cfg = engine_config(args)
                cfg.speculative, cfg.max_num_seqs = spec, max(batch, 1)
                engines[spec] = LLMEngine(cfg, loaded=loaded)
            prompts = _prompts(engines["off"], name, batch, args.repeats)
            for e in engines.values():
                _run(e, prompts[:1], 8, 1)  # warm-up
            timers = {spec: StepTimer(e) for spec, e in engines.items()}
            outs, rates = {}, {m: [] for m in modes}
            for _ in range(args.rounds):
                for spec, e in engines.items():
                    o, dt = _run(e, prompts, args.max_tokens, batch)
                    outs[spec] = o
                    rates[spec].append(sum(len(v) for v in o.values()) / dt)
            for spec, e in engines.items():
                st = e.stats()["speculative"].get("total", {})
                speedups = [r / b for r, b in zip(rates[spec], rates["off"])]
                row = {"batch": batch, "set": name, "proposer": spec, "rounds": args.rounds,
                       "tok_s": statistics.median(rates[spec]), "tok_s_rounds": rates[spec],
                       "speedup": statistics.median(speedups), "speedup_rounds": speedups,
                       "acceptance_rate": st.get("acceptance_rate"),
                       "tokens_per_verification": st.get("tokens_per_verification"), "drafted": st.get("drafted"),
                       "decode_steps_by_tokens": timers[spec].summary(),
                       "greedy_match": sum(_same_prefix(outs["off"][k], outs[spec][k]) for k in outs[spec])
                       / len(outs[spec])}
                rows.append(row)
                print(f"batch {batch:>2} {name:<10} {spec:<8} {row['tok_s']:6.1f} tok/s  x{row['speedup']:.2f} "
                      f"({', '.join(f'{x:.2f}' for x in speedups)})  accept {row['acceptance_rate'] or 0:.2f}  "
                      f"tokens/verify {row['tokens_per_verification'] or 0:.2f}  match {row['greedy_match']:.2f}",
                      file=sys.stderr)
            if batch == 1 and args.server_url:
                rows.append(_server_row(args.server_url, name, prompts, [len(v) for v in outs["off"].values()]))
            del engines
    rep.add("speculative", rows)
    _print(rows, rep)
    _print_steps(rows, rep)


def _server_row(url: str, name: str, prompts: list[list[int]], lengths: list[int]) -> dict:
    """llama-server's plain decode of the same prompt tokens, one at a time, each for as many
    tokens as ridge's plain run made (ignore_eos), timed like ridge's runs: tokens / wall."""
    from .external import run_server
    from .workloads import Workload

    wl = Workload(f"spec-{name}", [""] * len(prompts), lengths, "ridge's plain output lengths", 0)
    res = run_server(url, "llama", wl, prompts, 1)
    if res["errors"] or res["short_requests"]:
        raise RuntimeError(f"llama-server at {url}: {res['errors'] or 'short outputs'}")
    print(f"batch  1 {name:<10} llama-server {res['useful_tok_s']:6.1f} tok/s", file=sys.stderr)
    return {"batch": 1, "set": name, "proposer": "llama-server", "rounds": 1, "tok_s": res["useful_tok_s"],
            "tok_s_rounds": [res["useful_tok_s"]], "speedup": None, "speedup_rounds": [], "acceptance_rate": None,
            "tokens_per_verification": None, "drafted": 0, "decode_steps_by_tokens": {}, "greedy_match": None}


def _print(rows, rep) -> None:
    out = rep.out
    env = rep.data["env"]
    print(f"\n# speculative decoding — {env.get('device')} threads {env.get('threads')} KV {env.get('kv_dtype')}", file=out)
    print(f"# command: {rep.data['command']}", file=out)
    print("| batch | set | proposer | tok/s | speedup (median; per round) | acceptance | tokens/verification "
          "| greedy match |", file=out)
    print("|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        if r["proposer"] == "llama-server":
            print(f"| {r['batch']} | {r['set']} | llama-server (plain) | {r['tok_s']:.1f} | - | - | - | - |", file=out)
            continue
        acc = "-" if r["proposer"] == "off" else f"{r['acceptance_rate'] or 0:.2f}"
        tpv = "-" if r["proposer"] == "off" else f"{r['tokens_per_verification'] or 0:.2f}"
        rounds = ", ".join(f"{x:.2f}" for x in r["speedup_rounds"])
        print(f"| {r['batch']} | {r['set']} | {r['proposer']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x ({rounds}) | {acc} | "
              f"{tpv} | {r['greedy_match']:.2f} |", file=out)


def _print_steps(rows, rep) -> None:
    """Decode step time by tokens in the step (batch x (1 + drafts)), per proposer."""
    out = rep.out
    print("\n# decode steps by tokens in the step: median ms (steps)", file=out)
    print("| batch | set | proposer | steps by tokens |", file=out)
    print("|---|---|---|---|", file=out)
    for r in rows:
        if r["proposer"] == "llama-server":
            continue
        cells = ", ".join(f"{t}: {v['ms']:.1f} ({v['steps']})" for t, v in r["decode_steps_by_tokens"].items())
        print(f"| {r['batch']} | {r['set']} | {r['proposer']} | {cells} |", file=out)


def run_spec(args, rep) -> None:
    from ridge.models.loader import load_model

    loaded = load_model(args.model, device=args.device, weights=args.weights, max_model_len=args.max_model_len)
    from ridge.engine.engine import LLMEngine
    from ridge.engine.config import engine_config
    rep.set_env(LLMEngine(engine_config(args), loaded=loaded))
    part_spec(rep, args, loaded)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.data, f, indent=1, default=str)
