"""`ridge bench hashing`: what block identity costs (cache/block_hash.py), without a model.

- lookup: one prompt's prefix lookup at admission. The keyed BLAKE2b chain alone, and
  get_computed_blocks on a full hit (the chain, then a parent and token compare per block),
  first and again (a request waiting for room is looked up every step: its BlockChain
  keeps the hashes, so only the compares run again), beside what ridge did before issue 23: Python's tuple hash
  chained, and a dict lookup per block.
- decode: the manager's cache_blocks for `batch` requests in one decode step (each request
  publishes a block every block_size steps: hashed, and its tokens kept for the compare), with
  the keyed hash and with Python's built-in hash in its place (the crypto's share)."""
from __future__ import annotations

import random
import time

from ridge.cache.block_hash import BlockChain
from ridge.cache.manager import KVCacheManager


def add_hashing_parser(sub, common) -> None:
    h = sub.add_parser("hashing", help="block hashing and hit checks, per prompt and per decode step (no model)")
    common(h, workload=False)
    h.add_argument("--prompts", default="2048,16384", help="comma list of prompt lengths (tokens)")
    h.add_argument("--batch", type=int, default=64, help="requests in the decode step")
    h.add_argument("--context", type=int, default=2048, help="their context at the first timed step")
    h.add_argument("--steps", type=int, default=256, help="timed decode steps")
    h.add_argument("--repeat", type=int, default=20, help="lookups timed per prompt length (best kept)")


def python_hash(data: bytes) -> bytes:
    """The built-in hash as a block hash: the same work around it, no cryptography."""
    return hash(data).to_bytes(8, "little", signed=True) * 2


def former_lookup(tokens: list[int], bs: int, cached: dict) -> int:
    """Before issue 23: hash((parent, tuple(block))) chained from 0, one dict lookup per block."""
    parent, hits = 0, 0
    for i in range(0, (len(tokens) - 1) // bs * bs, bs):
        parent = hash((parent, tuple(tokens[i:i + bs])))
        if cached.get(parent) is None:
            break
        hits += 1
    return hits


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def lookup_row(n: int, bs: int, repeat: int) -> dict:
    tokens = [random.randrange(50_000) for _ in range(n + 1)]
    kv = KVCacheManager(n // bs + 2, bs)
    kv.allocate("warm", n + 1)
    kv.cache_blocks("warm", tokens, n + 1)
    hits, _ = kv.get_computed_blocks("q", tokens)
    assert len(hits) == n // bs, "the bench's prompt must be a full hit"
    former, parent = {}, 0  # the same prompt cached the former way: a full hit too
    for i in range(0, n, bs):
        parent = hash((parent, tuple(tokens[i:i + bs])))
        former[parent] = True

    def first_lookup():
        kv.get_computed_blocks("q", tokens)  # no chain given: every block hashed anew

    chain = BlockChain()
    kv.get_computed_blocks("q", tokens, chain=chain)

    return {"tokens": n, "blocks": n // bs,
            "chain_ms": 1e3 * _best(lambda: kv.chain(tokens[:n]), repeat),
            "lookup_ms": 1e3 * _best(first_lookup, repeat),
            "again_ms": 1e3 * _best(lambda: kv.get_computed_blocks("q", tokens, chain=chain), repeat),
            "former_lookup_ms": 1e3 * _best(lambda: former_lookup(tokens, bs, former), repeat)}


def decode_ms(hash_fn, batch: int, context: int, steps: int, bs: int) -> float:
    """cache_blocks over `batch` requests, per decode step (ms)."""
    kv = KVCacheManager(batch * (-(-(context + steps) // bs)) + 1, bs, hash_fn=hash_fn)
    toks = {f"r{i}": [random.randrange(50_000) for _ in range(context + steps)] for i in range(batch)}
    for r, t in toks.items():
        kv.allocate(r, len(t))
        kv.cache_blocks(r, t, context)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        for r, t in toks.items():
            kv.cache_blocks(r, t, context + s)
    return 1e3 * (time.perf_counter() - t0) / steps


def run_hashing(args, rep) -> None:
    bs = args.block_size
    rows = [lookup_row(int(n), bs, args.repeat) for n in args.prompts.split(",") if n.strip()]
    rep.add("lookup", rows)
    rep.table(f"a prompt's prefix lookup, block size {bs} (ms, best of {args.repeat})",
              ["tokens", "blocks", "keyed BLAKE2b chain", "lookup, full hit (chain + compare)",
               "the same again (waiting for room)", "before (tuple hash)"],
              [[r["tokens"], r["blocks"], f"{r['chain_ms']:.3f}", f"{r['lookup_ms']:.3f}", f"{r['again_ms']:.3f}",
                f"{r['former_lookup_ms']:.3f}"] for r in rows])
    keyed = decode_ms(None, args.batch, args.context, args.steps, bs)
    plain = decode_ms(python_hash, args.batch, args.context, args.steps, bs)
    dec = {"batch": args.batch, "context": args.context, "steps": args.steps, "keyed_ms": keyed, "python_hash_ms": plain}
    rep.add("decode", dec)
    rep.table(f"cache_blocks per decode step, batch {args.batch} at context {args.context} (ms a step, "
              f"mean of {args.steps})", ["keyed BLAKE2b", "Python's hash in its place"],
              [[f"{keyed:.3f}", f"{plain:.3f}"]])
