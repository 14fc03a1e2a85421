"""`ridge bench embeddings`: embedding throughput, ridge against transformers on the same model.

The model is random and Qwen3-Embedding-shaped (qwen3, last-token pooling, L2-normalised; its
widths, fewer layers by default), saved as embedding checkpoints ship (transformers' Qwen3Model
alone) under $XDG_CACHE_HOME/ridge/bench-embed, keyed by shape. The same inputs, token ids of
seeded random lengths, go through both:

- ridge: the engine's add_embedding (engine/pooling.py), with the weights it serves (`--weights`,
  its CPU format); at batch 1 one input a request, one after another; at batch B one request of
  B inputs, batched by the scheduler as a server batches them.
- transformers: AutoModel in fp32 under inference_mode, as sentence-transformers runs it: a
  batch is right-padded with its attention mask, each input's state taken at its last real
  token, then normalised.

Rounds alternate (ridge then transformers, then the other way round), and each side keeps its
best; the ratio is inputs per second, ridge over transformers. The two sides' vectors are
compared (cosine) so that the figure is of the same computation."""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

SHAPE = dict(hidden=1024, layers=8, heads=16, kv_heads=8, head_dim=128, inter=3072, vocab=151669)


def add_embeddings_parser(sub, common) -> None:
    e = sub.add_parser("embeddings", help="embedding throughput at batch 1 and B, ridge against transformers")
    common(e, workload=False)
    e.add_argument("--batches", default="1,64", help="inputs a batch (1: one request at a time)")
    e.add_argument("--lengths", default="16-64", help="input lengths in tokens, LO-HI (uniform, seeded)")
    e.add_argument("--inputs", type=int, default=64, help="inputs timed at each batch size")
    e.add_argument("--rounds", type=int, default=3, help="alternating rounds (each side keeps its best)")
    for key, value in SHAPE.items():
        e.add_argument(f"--{key.replace('_', '-')}", type=int, default=value, help=f"model shape (default {value})")


def write_model(shape: dict, root: Path | None = None) -> Path:
    """A random Qwen3Model checkpoint of `shape` (written once, reused after)."""
    import hashlib

    import torch
    import transformers

    from .window import write_byte_tokenizer

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    d = (root or Path(base) / "ridge" / "bench-embed") / f"qwen3-{key}"
    if not (d / "config.json").is_file():
        config = transformers.Qwen3Config(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
            num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
            intermediate_size=shape["inter"], max_position_embeddings=4096, tie_word_embeddings=True)
        torch.manual_seed(0)
        tmp = d.with_name(d.name + ".tmp")
        transformers.AutoModel.from_config(config, dtype=torch.float32).save_pretrained(tmp)
        write_byte_tokenizer(tmp)
        tmp.rename(d)
    return d


def inputs_of(n: int, lengths: str, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    lo, hi = (int(x) for x in lengths.split("-"))
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def ridge_embed(engine, batch: list[list[int]]) -> list[list[float]]:
    rid = engine.add_embedding(None, batch)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    return out.embeddings


def hf_embed(model, batch: list[list[int]]):
    """sentence-transformers' path for a last-token model: right padding, each input's last real row."""
    import torch

    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, :len(x)], mask[i, :len(x)] = torch.tensor(x), 1
    with torch.inference_mode():
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = h[torch.arange(len(batch)), mask.sum(1) - 1]
        return torch.nn.functional.normalize(last.float(), dim=-1)


def _timed(fn, inputs: list[list[int]], batch: int) -> tuple[float, list]:
    t0, vecs = time.perf_counter(), []
    for i in range(0, len(inputs), batch):
        vecs.extend(list(fn(inputs[i:i + batch])))
    return time.perf_counter() - t0, vecs


def _cosine(a, b) -> float:
    import torch

    a, b = torch.tensor([list(map(float, v)) for v in a]), torch.stack([torch.as_tensor(v) for v in b]).float()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


def run_embeddings(args, rep) -> None:
    import torch
    import transformers

    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine
    from ridge.models.loader import load_model

    shape = {k: getattr(args, k) for k in SHAPE}
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    d = write_model(shape)
    threads = torch.get_num_threads()
    loaded = load_model(d, device=args.device, weights=args.weights, use_cache=False, show_progress=False)
    cfg = replace(engine_config(args), model=str(d), pooling="last", max_num_seqs=max(max(batches), 1),
                  kv_disk=False, kv_host_gib=0, kv_memory_gib=0.5)
    engine = LLMEngine(cfg, loaded=loaded)
    torch.set_num_threads(threads)  # transformers at the thread count ridge started with
    hf = transformers.AutoModel.from_pretrained(d, dtype=torch.float32).eval()
    rep.set_env(engine)
    inputs = inputs_of(args.inputs, args.lengths, shape["vocab"])
    tokens = sum(map(len, inputs))
    for fn in (lambda b: ridge_embed(engine, b), lambda b: hf_embed(hf, b)):  # warm both
        _timed(fn, inputs[:2], 2)
    rows = []
    for b in batches:
        best = {"ridge": float("inf"), "transformers": float("inf")}
        vecs, rounds = {}, []
        for r in range(args.rounds):
            sides = [("ridge", lambda x: ridge_embed(engine, x)), ("transformers", lambda x: hf_embed(hf, x))]
            took = {}
            for name, fn in (sides if r % 2 == 0 else sides[::-1]):
                took[name], vecs[name] = _timed(fn, inputs, b)
                best[name] = min(best[name], took[name])
            rounds.append({k: len(inputs) / v for k, v in took.items()})
        rows.append({"batch": b, "inputs": len(inputs), "tokens": tokens,
                     "ridge_inputs_s": len(inputs) / best["ridge"], "hf_inputs_s": len(inputs) / best["transformers"],
                     "ratio": best["transformers"] / best["ridge"], "rounds": rounds,
                     "min_cosine": _cosine(vecs["ridge"], vecs["transformers"])})
    params = loaded.config.shape().num_params
    rep.add("embeddings", {"shape": shape, "path": str(d), "params": params, "weights": args.weights,
                           "lengths": args.lengths, "hf_threads": threads, "rows": rows})
    rep.table(f"embeddings: random Qwen3-Embedding-shaped qwen3 ({params / 1e6:.0f}M parameters, {shape['layers']} "
              f"layers), last-token pooling, {len(inputs)} inputs of {args.lengths} tokens; ridge's {args.weights} "
              f"weights against transformers fp32 at {threads} threads (best of {args.rounds} alternating rounds)",
              ["batch", "ridge inputs/s", "transformers inputs/s", "ridge / transformers", "tokens/s: ridge",
               "min cosine", "ratio by round"],
              [[r["batch"], f"{r['ridge_inputs_s']:.1f}", f"{r['hf_inputs_s']:.1f}", f"{r['ratio']:.2f}",
                f"{r['ridge_inputs_s'] * tokens / len(inputs):.0f}", f"{r['min_cosine']:.5f}",
                " ".join(f"{x['ridge'] / x['transformers']:.2f}" for x in r["rounds"])] for r in rows],
              note="batch 1: one input a request, one after another; batch B: one request of B inputs (ridge) or "
                   "one padded batch (transformers)")
