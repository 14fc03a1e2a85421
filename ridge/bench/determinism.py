"""`ridge bench determinism`: does a request's output depend on its batch, and what does
deterministic mode cost (issue 29).

Part 1, the divergence: the same greedy requests (chat prompts, --tokens each) run alone, in one
batch of three, and alone under `--speculative ngram` at k = 1, 3 and 7, on an engine with and
one without --deterministic (--ks: the draft lengths); each row gives, per prompt, the first token where the output left the
request's own output alone (None: identical). Part 2, the cost: decode tokens/s at batch 1 and 16
on both engines (one loaded model, a pool each, the prefix cache off), in ABBA rounds in one
process, and their ratio: the machine's load moves both alike."""
from __future__ import annotations

import random
import time
from dataclasses import replace

PROMPTS = ("Write a short story about a robot who learns to paint.",
           "Explain how a refrigerator works, step by step.",
           "List ten facts about the moon and repeat the list.")


def add_determinism_parser(sub, common) -> None:
    d = sub.add_parser("determinism", help="a request's tokens alone, in a batch and under ngram speculation, "
                                           "with and without --deterministic; the mode's decode cost (ABBA)")
    common(d, workload=False)
    d.add_argument("--tokens", type=int, default=96, help="greedy tokens per request (the divergence part)")
    d.add_argument("--ks", default="1,3,7", help="ngram draft lengths (the divergence part)")
    d.add_argument("--batches", default="1,16", help="decode batch sizes (the cost part)")
    d.add_argument("--rounds", type=int, default=4, help="ABBA rounds per batch size, each engine twice per round")
    d.add_argument("--skip-divergence", action="store_true", help="only the cost part")


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def divergence(base, loaded, tokens: int, ks: list[int]) -> list[dict]:
    """Per mode and setting: the first token where each prompt's output left its output alone."""
    from ridge.engine.engine import LLMEngine
    from ridge.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    rows = []
    for det in (False, True):
        eng = LLMEngine(replace(base, deterministic=det), loaded=loaded)
        alone = [eng.generate([p], sp)[0].new_token_ids for p in prompts]
        batch = [o.new_token_ids for o in eng.generate(prompts, sp)]
        rows.append({"deterministic": det, "setting": "batch of 3", "first_diff": list(map(_first_diff, alone, batch))})
        for k in ks:
            spec = LLMEngine(replace(base, deterministic=det, speculative="ngram", num_speculative_tokens=k),
                             loaded=loaded)
            got = [spec.generate([p], sp)[0].new_token_ids for p in prompts]
            drafted = spec.stats()["speculative"]["total"]
            rows.append({"deterministic": det, "setting": f"ngram k={k}", "first_diff": list(map(_first_diff, alone, got)),
                         "drafted": drafted["drafted"], "accepted": drafted["accepted"]})
    return rows


def _decode_rate(eng, batch: int, tokens: int, rng: random.Random) -> float:
    """Tokens/s of the steps after the first (the prefill), for `batch` requests of 16-token prompts."""
    from ridge.engine.sampling_params import SamplingParams

    vocab = eng.loaded.config.vocab_size
    for _ in range(batch):
        eng.add_request(None, [rng.randrange(20, vocab) for _ in range(16)], SamplingParams(max_tokens=tokens, ignore_eos=True))
    eng.step()
    t0, n = time.perf_counter(), 0
    while eng.has_unfinished():
        n += sum(len(o.new_token_ids) for o in eng.step())
    return n / (time.perf_counter() - t0)


def cost(base, loaded, batches: list[int], rounds: int) -> list[dict]:
    from ridge.engine.engine import LLMEngine

    engines = {det: LLMEngine(replace(base, deterministic=det, enable_prefix_caching=False), loaded=loaded)
               for det in (False, True)}
    rng, rows = random.Random(0), []
    for b in batches:
        tokens = 40 if b == 1 else 24
        for det in (False, True):
            _decode_rate(engines[det], b, 4, rng)  # warm
        got = {False: [], True: []}
        for _ in range(rounds):
            for det in (False, True, True, False):
                got[det].append(_decode_rate(engines[det], b, tokens, rng))
        rows.append({"batch": b, "default_tok_s": got[False], "deterministic_tok_s": got[True],
                     "ratio": sum(got[True]) / sum(got[False])})
    return rows


def run_determinism(args, rep) -> None:
    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine

    cfg = engine_config(args)  # a pool of 1024 blocks each unless --num-kv-blocks: up to ten engines share the RAM
    base = replace(cfg, kv_disk=False, max_num_seqs=16, deterministic=False, num_kv_blocks=cfg.num_kv_blocks or 1024)
    first = LLMEngine(base)
    loaded = first.loaded
    rep.set_env(first)
    del first
    if not args.skip_divergence:
        rows = divergence(base, loaded, args.tokens, [int(k) for k in args.ks.split(",") if k.strip()])
        rep.add("divergence", rows)
        rep.table(f"first token where a greedy request's {args.tokens} left its own output alone (None: identical)",
                  ["deterministic", "setting", "per prompt", "drafted / accepted"],
                  [[r["deterministic"], r["setting"], r["first_diff"],
                    f"{r['drafted']} / {r['accepted']}" if "drafted" in r else "-"] for r in rows])
    rows = cost(base, loaded, [int(b) for b in args.batches.split(",") if b.strip()], args.rounds)
    rep.add("cost", rows)
    rep.table("decode tokens/s, ABBA rounds in one process",
              ["batch", "default tok/s", "deterministic tok/s", "ratio"],
              [[r["batch"], " ".join(f"{x:.1f}" for x in r["default_tok_s"]),
                " ".join(f"{x:.1f}" for x in r["deterministic_tok_s"]), f"{r['ratio']:.3f}"] for r in rows],
              note="ratio: the deterministic engine's tokens over the default's, summed over the rounds")
