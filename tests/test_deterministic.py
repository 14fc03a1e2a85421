"""Deterministic mode (issue 29): a request's tokens, greedy and seeded-sampled, and its logprobs'
bits are the same alone, in a batch of 16, in prefill chunks of three sizes, under ngram
speculation at k = 1, 3 and 7, and while another process loads the CPU."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine_utils import assert_no_leak, load_tiny, make_engine, prompts, run
from ridge.errors import InvalidRequest
from ridge.engine.sampling_params import SamplingParams
from ridge.kernels import cpu_linear_plan
from ridge.kernels.cpu_linear import CpuLinear

N = 12


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_tiny(tmp_path_factory, "det", num_layers=2)


@pytest.fixture(scope="module")
def request_prompt(loaded):
    p = prompts(loaded.config.vocab_size, [37], seed=5)[0]
    return p + p[:20] + p  # repeats, so that prompt lookup drafts


def params() -> list[SamplingParams]:
    """Greedy with logprobs (no speculation then), greedy, and sampled with a seed."""
    return [SamplingParams(max_tokens=N, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=N, ignore_eos=True),
            SamplingParams(max_tokens=N, ignore_eos=True, temperature=1.0, top_p=0.9, seed=11)]


def outputs(engine, prompt, mates: int = 0, seed: int = 0, deterministic: bool | None = None) -> list[tuple]:
    """The request's (tokens, logprobs) under each of params() (asking `deterministic` of each),
    beside `mates` random others, which do not ask."""
    got = []
    for sp in params():
        sp.deterministic = deterministic
        others = prompts(engine.loaded.config.vocab_size, [3 + (7 * i + seed) % 50 for i in range(mates)], seed=seed)
        ids = [engine.add_request("me", prompt, sp)]
        ids += [engine.add_request(f"o{i}", p, SamplingParams(max_tokens=N + i % 5, ignore_eos=True,
                                                              temperature=0.7 * (i % 2), seed=i))
                for i, p in enumerate(others)]
        toks, lps = [], []
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == "me":
                    toks += o.new_token_ids
                    lps += [(lp[0], tuple(lp[1])) for lp in o.logprobs or []]
        got.append((toks, lps))
    return got


@pytest.fixture(scope="module")
def alone(loaded, request_prompt):
    return outputs(make_engine(loaded, deterministic=True), request_prompt)


def test_a_prefix_hit_changes_nothing(alone):
    """The greedy runs after the first find its prompt's blocks cached: the same tokens as computed."""
    assert alone[0][0] == alone[1][0] and len(alone[0][0]) == N


def test_batch_of_16_changes_nothing(loaded, request_prompt, alone):
    eng = make_engine(loaded, deterministic=True, prefill_chunk=16)
    assert outputs(eng, request_prompt, mates=15, seed=1) == alone
    assert_no_leak(eng)


@pytest.mark.parametrize("chunk", [5, 16, 200])
def test_prefill_chunks_change_nothing(loaded, request_prompt, alone, chunk):
    eng = make_engine(loaded, deterministic=True, prefill_chunk=chunk)
    assert outputs(eng, request_prompt, mates=3, seed=chunk) == alone


@pytest.mark.parametrize("k", [1, 3, 7])
def test_ngram_speculation_changes_nothing(loaded, request_prompt, alone, k):
    eng = make_engine(loaded, deterministic=True, speculative="ngram", num_speculative_tokens=k, ridge_point=100.0)
    assert outputs(eng, request_prompt, mates=2, seed=k) == alone
    st = eng.stats()["speculative"]["total"]
    assert st["drafted"] > 0 and st["accepted"] > 0  # speculation ran and landed


def test_competing_process_changes_nothing(loaded, request_prompt, alone):
    """A spinning process: the thread governor shrinks the team, and step times (which the draft
    length follows) swing."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        eng = make_engine(loaded, deterministic=True, speculative="ngram", num_threads=2, adaptive_threads=True)
        got = outputs(eng, request_prompt, mates=2, seed=9)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert got == alone


def test_request_field_in_a_batch_dependent_engine(loaded, request_prompt, alone):
    """params.deterministic = true on an engine without --deterministic: its steps run the
    invariant formats, and its tokens are the deterministic engine's."""
    eng = make_engine(loaded, speculative="ngram", num_speculative_tokens=3, prefill_chunk=5)
    got = outputs(eng, request_prompt, mates=3, seed=3, deterministic=True)
    assert got == alone


def test_invariant_formats_give_a_row_the_same_bits_at_every_row_count(loaded):
    """Every layer runs one product at every step size, one that the start-up check passes;
    the check itself fails on a product whose rows change with the row count."""
    eng = make_engine(loaded, deterministic=True)
    kinds = set()
    head = eng.model.lm_head.cpu_weights()
    for m in eng.cpu_formats.layers:
        assert m.bounds == [1] and len(m.runs) == 1
        assert cpu_linear_plan.is_invariant(m.runs[0], m.shape[1], 40)
        if m is not head:
            kinds |= set(m.kinds)
    # Every decoder layer is e4m3 on a CPU: the streaming kernel where it is invariant here, else
    # the blocked product padded as MKL's fp32 is. The head is the default recipe's table as
    # int8 codes (quant/embedding.py), run by the same two products.
    assert kinds and kinds <= {"fp8", "tiles"} and head.code == "i8" and set(head.kinds) <= {"fp8", "tiles"}
    w = torch.randn(96, 64)
    assert not cpu_linear_plan.is_invariant(lambda x: x @ w.T * (1 + 1e-6 * len(x)), 64, 40)


def test_sampled_deterministic_request_without_seed_gets_one(loaded):
    eng = make_engine(loaded, deterministic=True)
    rid = eng.add_request(None, [5, 6, 7], SamplingParams(max_tokens=2, temperature=1.0))
    assert eng.requests[rid].params.seed is not None and eng.requests[rid].params.deterministic
    with pytest.raises(InvalidRequest):
        SamplingParams(deterministic=1)


def test_padded_rows_are_cut_off():
    layer = CpuLinear(torch.randn(32, 8))
    run = cpu_linear_plan._pad_rows(lambda x: x @ layer.weight.T, 16)
    x = torch.randn(3, 8)
    assert run(x).shape == (3, 32) and torch.allclose(run(x), x @ layer.weight.T, atol=1e-5)


def test_bench_determinism_reports_divergence_and_cost(tmp_path):
    """`ridge bench determinism` end to end on a tiny model: the deterministic rows never diverge."""
    import json

    from tiny_models import make_tiny

    from ridge.cli import main

    path, _, _ = make_tiny(tmp_path, "llama")
    out = tmp_path / "det.json"
    assert main(["bench", "determinism", "--model", str(path), "--device", "cpu", "--threads", "1",
                 "--num-kv-blocks", "96", "--ridge-point", "8", "--prefill-chunk", "32", "--tokens", "4", "--ks", "3",
                 "--batches", "1", "--rounds", "1",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    rows = res["divergence"]
    assert [r["setting"] for r in rows if r["deterministic"]] == ["batch of 3", "ngram k=3"]
    assert all(d is None for r in rows if r["deterministic"] for d in r["first_diff"])
    assert res["cost"][0]["batch"] == 1 and res["cost"][0]["ratio"] > 0
