"""Structured output on the embedded SmolLM2: every output of the case set
(ridge/bench/structured_cases.py: 12 schemas, 8 regexes), greedy and sampled
with several seeds, parses and validates; and a constraint that admits every
text token changes nothing. One engine run holds the whole set (continuous
batching), so the file costs about one batch of decode steps."""
from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
import torch

from ridge.bench.structured_cases import REGEXES, SCHEMAS
from ridge.engine.engine import EngineConfig, LLMEngine
from ridge.engine.sampling_params import SamplingParams
from ridge.models.loader import load_model

pytestmark = pytest.mark.slow
SEEDS = (11, 12)  # sampled: n = 2 samples from each seed's request, so four draws per case


@pytest.fixture(scope="module")
def engine():
    before = torch.get_num_threads()
    # One thread: on the shared 2-core machine, two threads' barriers (a dozen per layer) each
    # cost a scheduler slice whenever another process holds a core.
    torch.set_num_threads(1)
    yield _engine()
    torch.set_num_threads(before)


@functools.cache
def _loaded():
    # test_tools_smollm2 imports the fixture, so each module builds its own engine on these weights.
    return load_model(None, device="cpu", weights="fp32", use_cache=False, show_progress=False)


def _engine():
    loaded = _loaded()
    # fp32 weights: the packed bf16 copy is exact only for e4m3 weights, and rounding these
    # turned "The capital of France is Paris." into "L'Étoile, la Marseillaise, ...".
    return LLMEngine(EngineConfig(device="cpu", kv_dtype="fp32", max_num_seqs=128, num_kv_blocks=1024,
                                  cpu_weight_format="fp32"), loaded=loaded)


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(engine, jobs: dict) -> dict:
    """jobs: id -> (prompt ids, params). -> (id, index) -> (text, finish reason)."""
    for rid, (ids, sp) in jobs.items():
        engine.add_request(rid, ids, sp)
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            text, _ = got.get((o.request_id, o.index), ("", None))
            got[o.request_id, o.index] = (text + o.new_text, o.finish_reason)
    return got


def test_every_output_of_the_case_set_conforms(engine):
    jobs, checks = {}, {}
    cases = [(f"json:{k}", p, {"type": "json_schema", "json_schema": {"name": k, "schema": s}}, s)
             for k, (p, s) in SCHEMAS.items()]
    cases += [(f"regex:{k}", p, {"type": "regex", "regex": r}, r) for k, (p, r) in REGEXES.items()]
    for name, prompt, fmt, spec in cases:
        ids = chat(engine, prompt)
        jobs[f"{name}:greedy"] = (ids, SamplingParams(max_tokens=200, response_format=fmt))
        for seed in SEEDS:
            jobs[f"{name}:{seed}"] = (ids, SamplingParams(max_tokens=200, temperature=0.8, seed=seed, n=2,
                                                          response_format=fmt))
        checks[name] = spec
    got = run(engine, jobs)
    assert len(got) == len(cases) * (1 + 2 * len(SEEDS))
    bad = []
    for (rid, idx), (text, reason) in got.items():
        name = rid.rsplit(":", 1)[0]
        try:
            if name.startswith("json:"):
                jsonschema.validate(json.loads(text), checks[name])
            elif not re.fullmatch(checks[name], text):
                raise ValueError("no full match")
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append((rid, idx, reason, text[:200], str(e)[:200]))
    assert not bad, bad
    assert engine.grammars.misses == len(cases)  # compiled once each, then cached


def test_a_constraint_that_admits_every_text_token_changes_nothing(engine):
    prompts = ["What is the capital of France?", "Write a haiku about rain.", "Name three primes."]
    free = {"type": "regex", "regex": r"(?s:.*)"}
    jobs = {f"p{i}": (chat(engine, p), SamplingParams(max_tokens=48)) for i, p in enumerate(prompts)}
    ref = run(engine, jobs)
    got = run(engine, {k: (ids, SamplingParams(max_tokens=48, response_format=free)) for k, (ids, _) in jobs.items()})
    assert got == ref
    assert "Paris" in ref["p0", 0][0]
