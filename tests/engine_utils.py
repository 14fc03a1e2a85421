"""Helpers for engine tests: a tiny model loaded once, engines over it, and runs."""
from __future__ import annotations

from ridge.engine.engine import EngineConfig, LLMEngine
from ridge.engine.sampling_params import SamplingParams


def make_engine(loaded, **kw) -> LLMEngine:
    # No disk tier unless a test asks: blocks one test left there would change what the next schedules.
    cfg = dict(device="cpu", kv_dtype="fp32", num_kv_blocks=256, max_num_seqs=16, prefill_chunk=64, ridge_point=8.0,
               kv_disk=False)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def run(engine: LLMEngine, prompts, params) -> dict[str, list[int]]:
    """Run to completion; -> request id -> output tokens (sample 0)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
    toks = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            if o.index == 0:
                toks[o.request_id] += o.new_token_ids
    return toks


def run_named(engine: LLMEngine, prompts: dict, n_tokens: int, params=None) -> dict[str, list[int]]:
    """Run to completion with the prompts' own request ids; -> id -> output tokens (greedy
    n_tokens unless params is given)."""
    got = {k: [] for k in prompts}
    for k, p in prompts.items():
        engine.add_request(k, p, params or greedy(n_tokens))
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    return got


def odd_prompts(ids: list[int]) -> dict[str, list[int]]:
    """A one-token prompt (its first step decode-shaped), odd lengths and one past a 64-token chunk."""
    return {"a": ids[:50], "b": ids[10:23], "c": ids[40:41], "d": ids[:70]}


def assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks, "KV blocks leaked"
    assert all(b.ref_cnt == 0 for b in engine.kv_cache_manager.pool.blocks)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def load_tiny(tmp_path_factory, name: str, **kw):
    """A tiny llama written as a GGUF file and loaded on CPU through the real loader."""
    from ridge.models.loader import load_model
    from tiny_models import make_tiny

    path, _, _ = make_tiny(tmp_path_factory.mktemp(name), "llama", max_position=512, **kw)
    return load_model(path, device="cpu", use_cache=False)
