"""Structured output on tiny random models: the mechanics. Constraints through
admission, continuous batching, n > 1, preemption, aborts, overlap and
speculative decoding, with real engines and the real library (llguidance).
The schema set on the real model is tests/test_structured_smollm2.py."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine_utils import assert_no_leak, load_tiny, make_engine, prompts
from ridge.engine.request import Request
from ridge.engine.sampler import apply_token_bitmask
from ridge.errors import InvalidRequest
from ridge.engine.sampling_params import SamplingParams
from ridge.engine.scheduler import ScheduledRequest
from ridge.engine.speculative.proposers import Draft
from ridge.engine.structured.format import Constraint, parse_response_format
from ridge.engine.structured.step import fill_masks, prune_drafts, words

RX = r"(yes|no): [a-z]{2,6}( [0-9]{1,3}){1,3}\."
REPEAT = r"((yes|no) ){4,12}(yes|no)\."  # repetitive: prompt lookup finds matches in the output
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 500},
                         "tag": {"enum": ["red", "green"]},
                         "xs": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
          "required": ["ok", "n", "tag", "xs"], "additionalProperties": False,
          # A random model picks whitespace wherever it may: at most a space keeps outputs short.
          "x-guidance": {"whitespace_pattern": " ?"}}


def regex(rx: str) -> dict:
    return {"type": "regex", "regex": rx}


def schema(s: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": s}}


def params(fmt=None, n_tokens=200, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n_tokens, response_format=fmt, **kw)


def conforms(text: str, fmt: dict) -> bool:
    if fmt["type"] == "regex":
        return re.fullmatch(fmt["regex"], text) is not None
    try:
        jsonschema.validate(json.loads(text), fmt["json_schema"]["schema"])
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_all(eng, jobs: dict, requests: list | None = None) -> dict:
    """jobs: id -> (prompt, params). -> (id, sample index) -> (text, token ids).
    requests: gets the engine's Request of every sample."""
    for rid, (p, sp) in jobs.items():
        eng.add_request(rid, p, sp)
        if requests is not None:
            requests += eng.groups[rid]
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            text, toks = got.get((o.request_id, o.index), ("", []))
            got[o.request_id, o.index] = (text + o.new_text, toks + o.new_token_ids)
    return got


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model's products take microseconds: with two threads each one ends at a barrier,
    which costs a scheduler slice whenever another process holds a core (most of this file's
    time on a shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_tiny(tmp_path_factory, "structured")


@pytest.fixture(scope="module")
def ps(loaded):
    return prompts(loaded.config.vocab_size, [7, 19, 33, 12, 48, 5])


# -- the protocol's shapes -------------------------------------------------------
def test_response_format_shapes():
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == Constraint("json_schema", '{"type":"object"}')
    c = parse_response_format(schema({"type": "object", "properties": {"b": {}, "a": {}}}))
    assert c.text == '{"type":"object","properties":{"b":{},"a":{}}}'  # the schema's order is kept
    assert parse_response_format({"type": "json_schema", "json_schema": {}}).text == '{"type":"object"}'
    assert parse_response_format(regex("a+")) == Constraint("regex", "a+")
    assert parse_response_format({"type": "grammar", "grammar": "start: \"a\""}).kind == "grammar"
    for bad, says in [("json", "must be a map"), ({"type": "xml"}, ".type must be one of"),
                      ({"type": "regex"}, ".regex must be a non-empty string"),
                      ({"type": "regex", "regex": "a", "flags": 1}, "unknown field(s) flags"),
                      ({"type": "json_schema", "json_schema": {"schema": 3}}, "must be a JSON schema"),
                      ({"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}, "unknown field(s) x")]:
        with pytest.raises(InvalidRequest, match=re.escape(says)):
            SamplingParams(response_format=bad)
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        SamplingParams(response_format=regex("a"), ignore_eos=True)


def test_a_constraint_that_does_not_compile_is_refused_at_admission(loaded, ps):
    eng = make_engine(loaded)
    for fmt, says in [(regex("(ab"), "the regex does not compile"),
                      (schema({"type": "frobnicate"}), "the JSON schema does not compile"),
                      ({"type": "grammar", "grammar": "start: (\"a\""}, "the grammar does not compile")]:
        with pytest.raises(InvalidRequest, match=re.escape(f"response_format: {says}")):
            eng.add_request("bad", ps[0], params(fmt))
    assert not eng.has_unfinished() and not (eng.scheduler.waiting or eng.scheduler.running or eng.scheduler.loading)


def test_compiled_constraints_are_cached_per_constraint(loaded, ps):
    eng = make_engine(loaded)
    for i in range(3):
        eng.add_request(f"c{i}", ps[i], params(regex(RX), n_tokens=4))
    eng.add_request("other", ps[3], params(schema(SCHEMA), n_tokens=4))
    assert (eng.grammars.misses, eng.grammars.hits) == (2, 2)
    while eng.has_unfinished():
        eng.step()


# -- the sampler's one batched mask ----------------------------------------------
def test_apply_token_bitmask_matches_a_row_by_row_reference():
    g = torch.Generator().manual_seed(0)
    V = 77  # not a multiple of 32: the last word's spare bits are ignored
    logits = torch.randn(5, V, generator=g)
    allowed = torch.rand(3, V, generator=g) < 0.3
    padded = torch.zeros(3, 96, dtype=torch.bool)
    padded[:, :V] = allowed
    weights = (1 << torch.arange(32, dtype=torch.int64))
    bitmask = ((padded.view(3, 3, 32).long() * weights).sum(-1) & 0xFFFFFFFF)
    bitmask = torch.where(bitmask >= 1 << 31, bitmask - (1 << 32), bitmask).to(torch.int32)
    rows = torch.tensor([4, 0, 2])
    got = apply_token_bitmask(logits, bitmask, rows)
    want = logits.clone()
    for i, r in enumerate(rows.tolist()):
        want[r][~allowed[i]] = float("-inf")
    assert torch.equal(got, want)
    assert torch.equal(apply_token_bitmask(logits[[4, 0, 2]], bitmask), want[[4, 0, 2]])  # every row
    assert not torch.isinf(logits).any()  # a copy: the raw logits stay for logprobs


# -- generation ------------------------------------------------------------------
def test_outputs_conform_in_a_mixed_batch_and_plain_rows_are_untouched(loaded, ps):
    """Greedy and sampled (several seeds, n = 2), regex and schema, beside unconstrained
    requests whose outputs must equal their outputs alone."""
    plain = params(None, n_tokens=24, seed=5, temperature=0.9)
    alone = run_all(make_engine(loaded), {"u0": (ps[0], plain), "u1": (ps[1], params(None, n_tokens=24))})
    jobs = {"u0": (ps[0], plain), "u1": (ps[1], params(None, n_tokens=24))}
    fmts = [regex(RX), schema(SCHEMA)]
    for j, fmt in enumerate(fmts):
        jobs[f"g{j}"] = (ps[2 + j], params(fmt))
        for seed in (0, 1, 2):
            jobs[f"s{j}-{seed}"] = (ps[3 + seed], params(fmt, temperature=1.0, seed=seed, n=2))
    eng = make_engine(loaded)
    got = run_all(eng, jobs)
    assert got["u0", 0] == alone["u0", 0] and got["u1", 0] == alone["u1", 0]
    checked = 0
    for (rid, idx), (text, _) in got.items():
        if rid[0] in "gs":
            fmt = fmts[int(rid[1])]
            assert conforms(text, fmt), (rid, idx, text)
            checked += 1
    assert checked == 2 + 2 * 3 * 2
    assert got["s0-0", 0] != got["s0-0", 1]  # each sample its own matcher and its own draws
    assert_no_leak(eng)


@pytest.fixture(scope="module")
def greedy_jobs(ps):
    """Constrained greedy requests (and one free one), with long enough prompts to preempt."""
    jobs = {f"r{i}": (p * 3, params([regex(REPEAT), schema(SCHEMA), regex(RX)][i % 3], n_tokens=60))
            for i, p in enumerate(ps)}
    jobs["free"] = (ps[0], params(None, n_tokens=30))
    return jobs


@pytest.fixture(scope="module")
def greedy_ref(loaded, greedy_jobs):
    return run_all(make_engine(loaded), greedy_jobs)


def test_preemption_and_recompute_keep_the_matcher(loaded, greedy_jobs, greedy_ref):
    # 16 blocks of 16 cannot hold six requests of 15 to 144 prompt tokens and their outputs.
    eng = make_engine(loaded, num_kv_blocks=16, enable_prefix_caching=False)
    assert run_all(eng, greedy_jobs) == greedy_ref
    assert eng.scheduler.num_preemptions > 0
    assert_no_leak(eng)


def test_overlapped_steps_give_the_same_outputs(loaded, greedy_jobs, greedy_ref):
    eng = make_engine(loaded, async_scheduling=True)
    assert eng.async_scheduling
    assert run_all(eng, greedy_jobs) == greedy_ref
    assert_no_leak(eng)


@pytest.mark.parametrize("spec", ["ngram", "self:1"])
def test_speculative_decoding_under_a_constraint(loaded, ps, greedy_jobs, greedy_ref, spec):
    """Greedy equals non-speculative greedy token for token; sampled outputs conform; every
    matcher ends able to take its whole output (rejected drafts were rolled back)."""
    eng = make_engine(loaded, speculative=spec)
    # A lone sampled request first: the policy drafts for it whatever the drafter costs (at
    # batch 7 a self-draft of half the layers does not pay), and its drafts are verified
    # whole (a greedy request's random self-drafts are cut to nothing before verification).
    lone = run_all(eng, {"lone": (ps[0] + ps[0], params(regex(REPEAT), temperature=1.0, seed=7))})
    assert conforms(lone["lone", 0][0], regex(REPEAT))
    assert eng.stats()["speculative"]["total"]["drafted"] > 0
    assert run_all(eng, greedy_jobs) == greedy_ref
    sampled = {f"s{i}": (ps[3 + i], params(fmt, temperature=1.0, seed=i, n=2))
               for i, fmt in enumerate([regex(REPEAT), schema(SCHEMA), regex(RX)])}
    fmts = {k: sp.response_format for k, (_, sp) in sampled.items()}
    requests = []
    for (rid, idx), (text, _) in run_all(eng, sampled, requests).items():
        assert conforms(text, fmts[rid]), (rid, idx, text)
    assert len(requests) == 6
    for r in requests:  # what the matcher has not consumed yet (the last tokens) it still accepts
        r.matcher.sync(r.output_token_ids)
        assert not r.matcher.is_error and r.matcher.ll.is_accepting()
    assert_no_leak(eng)


def test_abort_a_constrained_request(loaded, ps):
    eng = make_engine(loaded)
    eng.add_request("a", ps[0], params(regex(REPEAT)))
    eng.add_request("b", ps[1], params(regex(RX), n=2, temperature=1.0, seed=3))
    outs = []
    for _ in range(4):
        outs += eng.step()
    assert eng.abort_request("b")
    while eng.has_unfinished():
        outs += eng.step()
    assert sum(o.request_id == "b" and str(o.finish_reason) == "abort" for o in outs) == 2
    assert re.fullmatch(REPEAT, "".join(o.new_text for o in outs if o.request_id == "a"))
    assert_no_leak(eng)


def test_drafts_are_cut_to_what_the_constraint_allows(loaded):
    eng = make_engine(loaded)
    tok = eng.tokenizer
    compiled = eng.grammars.compile(parse_response_format(regex("ab(cd)+")))
    req = Request("x", [5, 6], params(regex("ab(cd)+")), matcher=compiled.matcher())
    req.output_token_ids = tok.encode("ab", add_special_tokens=False)
    good, bad = tok.encode("cdcd", add_special_tokens=False), tok.encode("x", add_special_tokens=False)
    s = ScheduledRequest(req, 1, [])
    drafts = prune_drafts([s], {"x": Draft(good + bad + good, None, "ngram")})
    assert drafts["x"].token_ids == good
    assert req.matcher.num_tokens == 2  # synced to the output, drafts not consumed
    probs = torch.full((3, 5), 0.2)
    sampled = Request("y", [5], params(regex("ab(cd)+"), temperature=1.0), matcher=compiled.matcher())
    kept = prune_drafts([ScheduledRequest(sampled, 1, [])], {"y": Draft(bad * 3, probs, "self:1")})
    assert kept["y"].token_ids == bad * 3  # sampled model drafts: verification rejects them exactly


def test_masks_in_this_thread_equal_the_pool_s_with_and_without_drafts(loaded):
    """CPU engines fill masks in the engine's thread, GPU engines in llguidance's pool: the
    same rows either way, drafts included (a refused draft leaves the rows after it open)."""
    eng = make_engine(loaded)
    tok = eng.tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    fmts = [regex(REPEAT), regex(RX), schema(SCHEMA)]
    outputs = ["yes no ", "no: ab", '{"ok":true,']
    drafts = [enc("yes no"), enc("cd 12x"), []]

    def fill(parallel):
        items, row = [], 0
        for fmt, out, d in zip(fmts, outputs, drafts):
            m = eng.grammars.compile(parse_response_format(fmt)).matcher()
            m.sync(enc(out))
            items.append((m.ll, row, d))
            row += len(d) + 1
        bitmask = torch.full((row, words(eng.loaded.config.vocab_size)), -1, dtype=torch.int32)
        fill_masks(items, bitmask, parallel)
        return bitmask, items

    serial, items = fill(False)
    pooled, _ = fill(True)
    assert torch.equal(serial, pooled)
    restricted = (serial != -1).any(dim=1).tolist()
    for m, row, d in items:  # each matcher rolled back to its output: its drafts validate again
        valid = m.validate_tokens(d)
        assert restricted[row:row + len(d) + 1] == [True] * (valid + 1) + [False] * (len(d) - valid)
    assert 0 < items[1][0].validate_tokens(drafts[1]) < len(drafts[1])  # "x" is refused mid-draft


def test_logprobs_are_the_model_s_not_the_mask_s(loaded, ps):
    eng = make_engine(loaded)
    eng.add_request("d", ps[0], params(regex("[0-9]{8}"), logprobs=5))
    lps = []
    while eng.has_unfinished():
        lps += [lp for o in eng.step() for lp in (o.logprobs or [])]
    digits = set(eng.tokenizer.encode("0123456789", add_special_tokens=False))
    assert len(lps) == 9  # eight digits and EOS
    assert any(t not in digits for _, top in lps for t, _ in top)  # refused tokens still show


def test_one_constraint_asked_for_by_many_threads_at_once_compiles_once(loaded):
    """The socket thread and the engine thread (and gateway workers) may ask for the same new
    constraint at the same time: it is compiled once, and everyone gets that compilation."""
    import threading

    eng = make_engine(loaded)
    fmt = parse_response_format(schema({"type": "object", "required": [f"k{i}" for i in range(40)],
                                        "properties": {f"k{i}": {"type": "string", "pattern": f"^v{i}[a-z]{{2,9}}$"}
                                                       for i in range(40)}}))
    start, got = threading.Barrier(6), []

    def ask():
        start.wait()
        got.append(eng.grammars.compile(fmt))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 6 and all(g is got[0] for g in got)
    assert eng.grammars.misses == 1 and eng.grammars.hits + eng.grammars.misses <= 6
    bad = parse_response_format(regex("(unclosed"))
    for _ in range(2):  # a failure is not cached as in flight: it fails again, with its reason
        with pytest.raises(InvalidRequest, match="does not compile"):
            eng.grammars.compile(bad)


def test_a_response_format_is_parsed_once_per_request(loaded):
    """Admission parses it once; the engine's copies (max_tokens fitted to the context, one seed
    per sample) share that parse, and a copy's changed fields are checked again."""
    p = SamplingParams(max_tokens=8, temperature=0.7, seed=5, n=3, response_format=regex("ab(cd)+"))
    assert p.constraint() is p.constraint() and p.derive(max_tokens=3).constraint() is p.constraint()
    with pytest.raises(InvalidRequest, match="max_tokens"):
        p.derive(max_tokens=0)
    eng = make_engine(loaded)
    rid = eng.add_request("x", [5, 6, 7], p)
    samples = eng.groups[rid]
    assert [s.params.seed for s in samples] == [5, 6, 7]
    assert all(s.params.constraint() is p.constraint() for s in samples)
    eng.abort_request(rid)
    while eng.has_unfinished():
        eng.step()
    assert_no_leak(eng)
