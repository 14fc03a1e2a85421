"""What every hybrid family's tests check through the engine (recurrent layers on the state cache
beside the paged KV), against transformers' greedy on the same tiny model: tests/test_granite_hybrid.py
and tests/test_nemotron_h.py (tests/test_lfm2.py's checks, written once)."""
from __future__ import annotations

import dataclasses

import torch

from engine_utils import assert_no_leak, greedy, make_engine, odd_prompts, run_named
from ridge.quant.hf_config import BASE_IGNORED
from test_families import N, V, build_hf, hf_greedy


def built_variants(tmp_path_factory, model_type: str, variants: dict, edit=None, seed: int = 0):
    """name -> (name, transformers model, its directory, token ids), each built once."""
    built = {}

    def get(name):
        if name not in built:
            model, path = build_hf(tmp_path_factory.mktemp(name), model_type, variants[name], seed=seed, edit=edit)
            ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
            built[name] = name, model, path, ids
        return built[name]
    return get


def draw_mamba2(mixers) -> None:
    """Mamba2 mixers' A_log, D and dt_bias away from their init (log 1..H, ones, ones)."""
    for m in mixers:
        m.A_log.copy_(torch.log(torch.rand_like(m.A_log) * 4 + 0.5))
        m.D.copy_(torch.randn_like(m.D))
        m.dt_bias.copy_(torch.randn_like(m.dt_bias) * 0.5)


def check_greedy(ref, lm, ids, chunk: int, seqs: int, n: int = 8) -> None:
    """Four requests through `seqs` slots in prefill chunks of `chunk`: a reused slot starts from
    zeros whatever the last request left in it."""
    prompts = odd_prompts(ids)
    eng = make_engine(lm, prefill_chunk=chunk, max_num_seqs=seqs)
    got = run_named(eng, prompts, n)
    assert got == {k: hf_greedy(ref, p, n) for k, p in prompts.items()}
    assert_no_leak(eng)
    assert eng.state_slots.num_free == seqs


def check_prefix_hit(model, lm, ids, chunk: int, seqs: int, n: int = 6) -> None:
    """A shared prompt of 37 tokens: later requests hit its first two blocks (32 tokens) and
    continue from the states checkpointed at that boundary."""
    system = ids[:37]
    eng = make_engine(lm, prefill_chunk=chunk, max_num_seqs=seqs)
    first = system + ids[60:70]
    got = run_named(eng, {"first": first}, n)
    later = {f"user-{i}": system + ids[70 + 5 * i:80 + 5 * i] for i in range(seqs)}
    cached = {}
    for rid, p in later.items():
        eng.add_request(rid, p, greedy(n))
        got[rid] = []
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
    assert cached == {rid: 32 for rid in later}
    assert got == {rid: hf_greedy(model, p, n) for rid, p in {"first": first, **later}.items()}
    assert_no_leak(eng)


def check_ngram_rollback(model, lm, ids, n: int = 16) -> None:
    """Prompt lookup drafts the model's own continuation, which it follows for a while and then
    leaves: rejected drafts roll each state back to its last accepted token."""
    prompts = {}
    for start in (60, 36):
        p = ids[start:start + 16]
        prompts[f"from-{start}"] = p + hf_greedy(model, p, 12) + p
    eng = make_engine(lm, speculative="ngram", num_speculative_tokens=4, prefill_chunk=16, max_num_seqs=2)
    seen = []
    verified = eng.speculator.on_verified
    eng.speculator.on_verified = lambda req, drafted, accepted: (seen.append((drafted, accepted)),
                                                                 verified(req, drafted, accepted))
    got = run_named(eng, prompts, n)
    assert got == {k: hf_greedy(model, p, n) for k, p in prompts.items()}
    assert any(a < d for d, a in seen), f"no draft was rejected: {seen}"
    assert any(a > 0 for d, a in seen), f"no draft was accepted: {seen}"
    assert_no_leak(eng)


def check_fields_declared(family, config_class) -> None:
    """Every field of the transformers config class read (with its default) or declared ignored."""
    fields = {f.name: f.default for f in dataclasses.fields(config_class)}
    undeclared = sorted(set(fields) - family.fields - family.ignored - BASE_IGNORED)
    assert not undeclared, f"{config_class.__name__} fields neither read nor ignored: {undeclared}"
    wrong = {k: (v, fields[k]) for k, v in family.defaults.items() if k in fields and fields[k] != v}
    assert not wrong, f"defaults differ from transformers' (ours, theirs): {wrong}"


def check_triton(model, lm, ids) -> None:
    """The GPU path's kernels (Triton; under the interpreter without a GPU) through the engine:
    the varlen convolution and chunked scan, the token-by-token scan keeping states for a prefix
    checkpoint and for n-gram speculation, then a prefix hit from that checkpoint."""
    from ridge.kernels import ops

    system = ids[:37]
    prompts = {"a": system + ids[60:64], "b": system + ids[70:75]}
    eng = make_engine(lm, prefill_chunk=16, max_num_seqs=2, speculative="ngram", num_speculative_tokens=3)
    got, cached = {}, {}
    with ops.use_triton(True):
        for rid, p in prompts.items():
            eng.add_request(rid, p, greedy(6))
            got[rid] = []
            while eng.has_unfinished():
                for o in eng.step():
                    got[o.request_id] += o.new_token_ids
                    cached[o.request_id] = o.num_cached_tokens
    assert got == {k: hf_greedy(model, p, 6) for k, p in prompts.items()}
    assert cached == {"a": 0, "b": 32}
    assert_no_leak(eng)
