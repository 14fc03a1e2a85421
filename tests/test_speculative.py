"""Speculative decoding inside continuous batching, on tiny models (fp32 KV:
greedy output must be exactly plain decoding's)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine_utils import assert_no_leak, greedy, make_engine, prompts, run
from ridge.engine.sampling_params import SamplingParams
from ridge.engine.speculative.policy import SpecPolicy, expected_tokens
from ridge.engine.speculative.proposers import NgramProposer
from ridge.models.loader import load_model
from tiny_models import make_tiny, random_state_dict, tiny_config, write_gguf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    path, cfg, _ = make_tiny(tmp, "llama", max_position=512, num_layers=4)
    dcfg = tiny_config("llama", max_position=512, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    draft = write_gguf(tmp / "draft.gguf", dcfg, random_state_dict(dcfg, seed=3))
    return load_model(path, device="cpu", use_cache=False), str(draft)


@pytest.fixture(scope="module")
def workload(models):
    loaded, _ = models
    ps = prompts(loaded.config.vocab_size, [5, 17, 40, 129, 3, 64, 23, 90])
    ps = [p + p[:12] + p for p in ps]  # repetition, so that prompt lookup finds matches
    return ps, run(make_engine(loaded), ps, greedy(30))


SPECS = ["ngram", "self:2", "auto", "draft"]


def spec_of(name, models):
    return f"draft:{models[1]}" if name == "draft" else name


@pytest.mark.parametrize("spec", SPECS)
def test_greedy_equals_plain_decoding_in_a_batch(models, workload, spec):
    ps, ref = workload
    eng = make_engine(models[0], speculative=spec_of(spec, models))
    assert run(eng, ps, greedy(30)) == ref
    st = eng.stats()["speculative"]["total"]
    assert st["drafted"] > 0 and st["verifications"] > 0
    assert_no_leak(eng)


@pytest.mark.parametrize("spec", SPECS)
def test_greedy_equals_plain_decoding_alone(models, workload, spec):
    ps, ref = workload
    eng = make_engine(models[0], speculative=spec_of(spec, models))
    assert run(eng, [ps[3]], greedy(30))["r0"] == ref["r3"]
    assert_no_leak(eng)


def test_speculation_with_prefill_chunks_in_the_same_step(models, workload):
    ps, ref = workload
    eng = make_engine(models[0], speculative="self:2", prefill_chunk=8)
    eng.add_request("r3", ps[3], greedy(30))
    for _ in range(40):
        eng.step()
    eng.add_request("r7", ps[7], greedy(30))  # a long prompt arriving mid-stream
    toks = {"r3": [], "r7": []}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
    assert toks["r7"] == ref["r7"]
    assert_no_leak(eng)


def test_no_leak_after_rejections_aborts_and_preemption(models, workload):
    ps, ref = workload
    eng = make_engine(models[0], speculative="self:1", num_kv_blocks=22)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, greedy(30))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 6:
            eng.abort_request("r2")
            eng.abort_request("r5")
    assert eng.scheduler.num_preemptions > 0
    assert eng.stats()["speculative"]["total"]["drafted"] > eng.stats()["speculative"]["total"]["accepted"]
    assert_no_leak(eng)


def test_per_request_switch_off(models, workload):
    ps, _ = workload
    eng = make_engine(models[0], speculative="ngram")
    run(eng, [ps[0]], SamplingParams(max_tokens=20, ignore_eos=True, speculative=False))
    assert eng.stats()["speculative"]["total"]["drafted"] == 0


def _chi2_quantile(df: int, p: float = 0.999) -> float:
    z = 3.09  # the standard normal's 0.999 quantile; Wilson-Hilferty approximation
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("spec", ["draft", "ngram"])
def test_sampled_distribution_matches_target(models, spec):
    """Chi-squared two-sample test on the joint law of the first three sampled
    tokens, with and without speculation (top-k 3 keeps the support small)."""
    loaded, _ = models
    import random
    prompt = list(range(3, loaded.config.vocab_size))
    random.Random(21).shuffle(prompt)  # every token occurs: prompt lookup always proposes

    def samples(speculative: str, seed0: int) -> Counter:
        # A GPU-like knee (ridge point 100: T* = 200), so that even a poor draft keeps drafting.
        eng = make_engine(loaded, speculative=speculative, max_num_seqs=4, ridge_point=100.0)
        c = Counter()
        params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=seed0 + i, ignore_eos=True)
                  for i in range(1000)]
        out = run(eng, [prompt] * len(params), params)
        for toks in out.values():
            c[tuple(toks)] += 1
        if speculative != "off":
            st = eng.stats()["speculative"]["total"]
            assert st["drafted"] > 150 and 0 < st["accepted"] < st["drafted"]
        assert_no_leak(eng)
        return c

    a = samples("off", 0)
    b = samples(spec_of(spec, models), 10_000)
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    na, nb = sum(a[k] for k in keys), sum(b[k] for k in keys)
    # The homogeneity statistic: sum over cells of (a/na - b/nb)^2 / ((a+b)/(na*nb)).
    chi2 = sum((a[k] / na - b[k] / nb) ** 2 / ((a[k] + b[k]) / (na * nb)) for k in keys)
    assert len(keys) >= 5
    assert chi2 < _chi2_quantile(len(keys) - 1), (chi2, len(keys))


def test_policy_fades_out_past_the_knee():
    pol = SpecPolicy(knee_tokens=16, max_k=8)
    for _ in range(10):
        pol.record("good", 10, 7)
    assert pol.choose_k("good", batch_tokens=1) >= 4  # nearly free below the knee
    assert pol.choose_k("good", batch_tokens=64) <= 1  # full price past it
    for _ in range(40):
        pol.record("bad", 4, 0)
    assert pol.choose_k("bad", batch_tokens=1) == 0  # free drafts that never land are not worth a slot
    costed = SpecPolicy(knee_tokens=16, max_k=8, draft_cost=0.25)
    for _ in range(10):
        costed.record("bad", 4, 0)
    ks = [costed.choose_k("bad", batch_tokens=1) for _ in range(32)]
    assert ks.count(0) == 30 and ks.count(1) == 2  # a model drafter is switched off, with rare probes
    # Acceptance is conditional: 3 of 8 drafts accepted, then a rejection, is a = 3/4, not 3/8.
    for _ in range(50):
        pol.record("c", 8, 3)
    assert abs(pol.per_request["c"].rate() - 0.75) < 0.01
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0


def test_policy_keeps_the_drafter_that_lands():
    """auto: a self-draft that never lands neither switches off a request whose prompt lookup
    does, nor keeps drafting, for that request or, once it has failed often enough overall,
    for new ones."""
    pol = SpecPolicy(knee_tokens=16, max_k=8)
    pol.record("r", 4, 0, "self:8")
    assert pol.worth_drafting("r", "self:8") and pol.worth_drafting("new", "self:8")  # too little evidence
    for _ in range(9):
        pol.record("r", 4, 0, "self:8")
        pol.record("r", 4, 3, "ngram")
    assert pol.choose_k("r", batch_tokens=1) >= 2  # mixed rate is 0.39; ngram's own is 0.75
    assert not pol.worth_drafting("r", "self:8") and pol.worth_drafting("r", "ngram")
    assert not pol.worth_drafting("new", "self:8") and pol.worth_drafting("new", "ngram")
    assert pol.worth_drafting("new", "draft")  # a drafter with no record yet
    # The self-draft's per-token pass prices k only while it may still draft.
    auto = SpecPolicy(knee_tokens=16, max_k=8, draft_cost=0.25, costed_source="self:8")
    for _ in range(10):
        auto.record("a", 4, 3, "ngram")
    priced = auto.choose_k("a", batch_tokens=1)
    for _ in range(10):
        auto.record("a", 4, 0, "self:8")
    assert auto.choose_k("a", batch_tokens=1) > priced


def test_ngram_lookup():
    ng = NgramProposer()
    assert ng.lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert ng.lookup([1, 2, 3, 4], 3) == []
    assert ng.lookup([5, 1, 2, 3, 1], 2) == [2, 3]  # a single token is the shortest match
    assert ng.lookup([7, 8, 1, 7, 8, 2, 7, 8], 2) == [2, 7]  # the latest occurrence wins
    assert ng.lookup([4, 5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]  # a repeat runs on past the text's end


def test_draft_with_another_vocabulary_is_refused(models, tmp_path):
    other = tiny_config("llama", vocab_size=300)
    sd = random_state_dict(other)
    path = write_gguf(tmp_path / "other.gguf", other, sd, tokenizer=False)
    with pytest.raises(Exception):
        make_engine(models[0], speculative=f"draft:{path}")


def test_a_draft_as_large_as_the_target_is_not_run(models, caplog):
    """Each draft from a model as large as the target costs what the token it may save does:
    the policy says so, and the engine serves without it (plain output, nothing drafted)."""
    loaded, _ = models
    assert not SpecPolicy(knee_tokens=16, draft_cost=1.0).can_pay()
    assert SpecPolicy(knee_tokens=16, draft_cost=0.2).can_pay()
    with caplog.at_level("WARNING", logger="ridge.engine"):
        eng = make_engine(loaded, speculative=f"draft:{loaded.path}")
    assert "can never pay" in caplog.text and eng.proposer_name == "off"
    ps = prompts(loaded.config.vocab_size, [9, 30])
    assert run(eng, ps, greedy(8)) == run(make_engine(loaded), ps, greedy(8))


def test_policy_reads_the_knee_from_measured_steps():
    """Measured decode steps replace the ridge point's knee once they vary in size: a step whose
    fixed cost dwarfs its per-token cost makes drafts cheaper than the ridge point says."""
    pol = SpecPolicy(knee_tokens=16, max_k=8)
    for i in range(20):
        pol.observe_step(1 + i % 9, 0.027 + 0.0006 * (1 + i % 9))
    assert pol.knee() == 16  # too few steps yet
    for i in range(40):
        pol.observe_step(1 + i % 9, 0.027 + 0.0006 * (1 + i % 9))
    assert abs(pol.knee() - 45) < 1
    flat = SpecPolicy(knee_tokens=16)
    for _ in range(64):
        flat.observe_step(16, 0.04)
    assert flat.knee() == 16  # same-size steps carry no slope
    wild = SpecPolicy(knee_tokens=16)
    for i in range(64):
        wild.observe_step(1 + 8 * (i % 2), 0.03 + 1e-7 * (i % 2))
    assert wild.knee() == 16 * 8  # kept within range of the ridge point's
    for _ in range(10):
        pol.record("r", 4, 1)
    assert pol.choose_k("r", batch_tokens=1) > SpecPolicy(knee_tokens=16, max_k=8, per_request=pol.per_request,
                                                          totals=pol.totals).choose_k("r", batch_tokens=1)


def test_a_draft_that_agrees_with_the_target_has_every_draft_accepted(tmp_path):
    """The draft model's KV must hold every accepted token. The draft here is the target's
    first layer (its other layers add exactly zero), so its KV must equal the target's
    layer 0 at every position it has read past, and every draft is accepted. A round whose
    drafts were all accepted used to leave its last draft's position unwritten."""
    cfg = tiny_config("llama", max_position=512, num_layers=4)
    sd = random_state_dict(cfg, seed=5)
    for i in range(1, cfg.num_layers):
        sd[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        sd[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    dcfg = tiny_config("llama", max_position=512, num_layers=1)
    dsd = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    target = load_model(write_gguf(tmp_path / "target.gguf", cfg, sd), device="cpu", use_cache=False)
    draft = write_gguf(tmp_path / "draft.gguf", dcfg, dsd)
    eng = make_engine(target, speculative=f"draft:{draft}", ridge_point=100.0)
    ps = prompts(cfg.vocab_size, [7, 33, 70])
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, greedy(40))
    bs, checked = eng.kv_cache.block_size, 0
    want, have = eng.kv_cache.layers[0].k, eng.proposer.kv_cache.layers[0].k
    while eng.has_unfinished():
        eng.step()
        for r in eng.scheduler.running:
            # Every position before the last computed one has been read by a draft pass.
            pos = torch.arange(r.num_computed_tokens - 1)
            blocks = torch.tensor(eng.kv_cache_manager.block_ids(r.request_id))[pos // bs]
            torch.testing.assert_close(have[blocks, pos % bs], want[blocks, pos % bs], rtol=1e-4, atol=1e-5)
            checked += 1
    st = eng.stats()["speculative"]["total"]
    assert checked > 10 and st["drafted"] > 60 and st["accepted"] == st["drafted"], st
    assert_no_leak(eng)


def _reads_during(fn):
    """fn() -> (its result, how many times it read a tensor's values onto the host)."""
    count = [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__bool__", "__int__", "__float__")}

    def counted(orig):
        def f(self, *a, **kw):
            count[0] += 1
            return orig(self, *a, **kw)
        return f

    try:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, counted(orig))
        out = fn()
    finally:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)
    return out, count[0]


def test_a_step_verifies_every_request_at_once_and_reads_once():
    """16 speculating requests, greedy and sampled, prompt-lookup and model drafts: the
    verification queues on the device without reading it, and the step's one read returns
    every request's tokens, greedy ones exactly by the rule."""
    from ridge.engine.request import Request
    from ridge.engine.sampler import Sampler
    from ridge.engine.scheduler import ScheduledRequest
    from ridge.engine.speculative.verify import verify_batch

    V, g = 50, torch.Generator().manual_seed(0)
    items, row, want = [], 0, {}
    for i in range(16):
        k = 1 + i % 4
        sp = SamplingParams(max_tokens=8) if i % 2 else SamplingParams(max_tokens=8, temperature=0.8, seed=i)
        req = Request(f"r{i}", [1, 2, 3], sp)
        req.spec_token_ids = torch.randint(0, V, (k,), generator=g).tolist()
        s = ScheduledRequest(req, k + 1, [])
        s.num_spec_tokens = k
        if i % 4 == 2:  # a model draft, with its distribution
            s.draft_probs = torch.softmax(torch.randn(k, V, generator=g), dim=-1)
        items.append((s, row, k + 1))
        row += k + 1
    logits = torch.randn(row, V, generator=g)
    for s, first, n in items:  # greedy rows: make some drafts right, so acceptance varies
        if s.request.params.greedy:
            for j, d in enumerate(s.request.spec_token_ids[: n // 2]):
                logits[first + j, d] += 100.0
            best = logits[first:first + n].argmax(-1).tolist()
            drafts = s.request.spec_token_ids
            m = next((j for j, d in enumerate(drafts) if d != best[j]), len(drafts))
            want[s.request.request_id] = drafts[:m] + [best[m]]
    sampler = Sampler()
    verified, reads = _reads_during(lambda: verify_batch(logits, items, sampler))
    assert reads == 0
    from ridge.engine.sampler import SampledRows
    out = SampledRows(torch.empty(0, dtype=torch.int64), [], None, verified.values)
    _, reads = _reads_during(out.read)
    assert reads == 1
    got = verified.resolve(out.extra)
    assert set(got) == {s.request.request_id for s, _, _ in items}
    for s, _, n in items:
        toks = got[s.request.request_id]
        assert 1 <= len(toks) <= n and toks[:-1] == s.request.spec_token_ids[:len(toks) - 1]
    assert {r: got[r] for r in want} == want
