"""llama.cpp's samplers (ridge/engine/sampler_chain.py) against independent implementations:
transformers' logits processors where one exists, else a reference written here from the
definition in llama.cpp's documentation (tools/server/README.md, src/llama-sampling.cpp's comments),
naive on purpose and sharing no code with the implementation."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper)

from engine_utils import assert_no_leak, load_tiny, make_engine, prompts, run
from ridge.engine.request import Request
from ridge.engine.sampler import Sampler
from ridge.engine.sampler_chain import adjust_logits
from ridge.engine.sampling_params import SamplingParams
from ridge.errors import InvalidRequest

V = 64


def req(params: SamplingParams, tokens=(), prompt=(1, 2, 3)) -> Request:
    r = Request("r", list(prompt), params)
    for t in tokens:
        r.append_output(t)
    return r


def logits(seed: int, n: int = 1) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs[0] > 0).flatten().tolist())


# -- against transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("last_n", [-1, 4])
def test_repeat_penalty_is_transformers_over_the_window(last_n):
    prompt, out = [5, 6, 7, 8, 5, 9], [10, 6, 11]
    x = logits(0)
    got = adjust_logits(x.clone(), [req(SamplingParams(repetition_penalty=1.3, repeat_last_n=last_n), out, prompt)])
    ids = prompt + out
    window = ids if last_n < 0 else ids[-last_n:]  # llama.cpp's repeat_last_n: the last n tokens only
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([window]), x.clone())
    torch.testing.assert_close(got, want)


def test_presence_and_frequency_are_openais_over_the_output():
    out = [4, 4, 4, 9, 12]
    x = logits(1)
    got = adjust_logits(x.clone(), [req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), out, [4, 30])])
    want = x.clone()
    for t in set(out):  # OpenAI: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
        want[0, t] -= out.count(t) * 0.25 + 0.5
    torch.testing.assert_close(got, want)


def test_logit_bias_is_transformers_sequence_bias():
    x = logits(2)
    bias = {3: 2.5, 40: -7.0}
    got = adjust_logits(x.clone(), [req(SamplingParams(logit_bias=bias))])
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[1, 2, 3]]), x.clone())
    torch.testing.assert_close(got, want)
    banned = adjust_logits(x.clone(), [req(SamplingParams(logit_bias={7: float("-inf")}))])
    assert banned[0, 7] == float("-inf") and banned.argmax() != 7


@pytest.mark.parametrize("seed", range(4))
def test_typical_p_is_transformers(seed):
    x = logits(seed)
    got = Sampler().probs(x, [req(SamplingParams(temperature=0.7, typical_p=0.6))])
    want = TypicalLogitsWarper(0.6)(None, TemperatureLogitsWarper(0.7)(None, x.clone()))
    assert kept(got) == set(torch.nonzero(torch.isfinite(want[0])).flatten().tolist())
    torch.testing.assert_close(got, torch.softmax(want, -1))


@pytest.mark.parametrize("seed", range(4))
def test_an_order_of_top_k_top_p_min_p_then_temperature_is_transformers_in_that_order(seed):
    x = logits(seed)
    p = SamplingParams(temperature=1.5, top_k=20, top_p=0.8, min_p=0.05,
                       samplers=["top_k", "top_p", "min_p", "temperature"])
    got = Sampler().probs(x, [req(p)])
    y = x.clone()
    for w in (TopKLogitsWarper(20), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05), TemperatureLogitsWarper(1.5)):
        y = w(None, y)
    torch.testing.assert_close(got, torch.softmax(y, -1))


def test_without_the_new_samplers_a_row_takes_the_plain_path_bit_for_bit():
    """A request with none of them gives the same probabilities alone and beside one that has them."""
    x = logits(5, 2)
    plain = req(SamplingParams(temperature=0.9, top_p=0.9, min_p=0.02))
    s = Sampler()
    alone = s.probs(x[:1], [plain])
    mixed = s.probs(x, [plain, req(SamplingParams(temperature=0.9, typical_p=0.5, top_n_sigma=1.0))])
    assert torch.equal(alone[0], mixed[0])


# -- against llama.cpp's definitions, written here ----------------------------------------------
def ref_dry(tokens, mult, base, allowed, breakers):
    """For each candidate t: the longest n such that the last n tokens, none a breaker, followed by
    t occur earlier in the context; penalty mult * base ** (n - allowed) when n >= allowed."""
    out = {}
    L = len(tokens)
    for n in range(1, L):
        tail = tokens[L - n:]
        if any(t in breakers for t in tail):
            break
        for start in range(0, L - n):
            if tokens[start:start + n] == tail and start + n < L:
                t = tokens[start + n]
                out[t] = max(out.get(t, 0), n)
    return {t: mult * base ** (n - allowed) for t, n in out.items() if n >= allowed}


@pytest.mark.parametrize("tokens,breakers", [
    ([1, 2, 3, 4, 1, 2, 3], set()),
    ([7, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], set()),
    ([1, 2, 3, 5, 1, 2, 3], {2}),  # the breaker cuts the repeat to the last token
    ([4, 4, 4, 4, 4], set()),
    ([1, 2, 3, 4, 5], set()),
])
def test_dry_is_its_definition(tokens, breakers):
    p = SamplingParams(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, dry_breaker_ids=frozenset((b,) for b in breakers))
    x = logits(6)
    got = adjust_logits(x.clone(), [req(p, prompt=tokens)])
    want = x.clone()
    for t, pen in ref_dry(tokens, 0.8, 1.75, 2, breakers).items():
        want[0, t] -= pen
    torch.testing.assert_close(got, want)


def ref_dry_sequences(tokens, mult, base, allowed, sequences):
    """llama.cpp's DRY (llama_sampler_dry_apply) with breakers as token sequences (head, *tail),
    naive: the newest head followed by one of its tails ends the repeat's room (rep_limit); each
    earlier end's match with the newest tokens, capped there, scores the token after it; a token
    that is a breaker by itself is spared; the exponent is capped at int(log(FLT_MAX) / log(base))."""
    L = len(tokens)
    if L < 2 or L <= allowed:
        return {}
    limit = L
    for i in range(L):  # i tokens after the head
        head = tokens[L - 1 - i]
        fits = [len(seq) - 1 for seq in sequences
                if seq[0] == head and len(seq) - 1 <= i and list(seq[1:]) == tokens[L - i:L - i + len(seq) - 1]]
        if fits:
            limit = i - max(fits)
            break
    if limit < allowed:
        return {}
    best = {}
    for end in range(L - 1):
        m = 0
        while m < limit and end - m >= 0 and tokens[end - m] == tokens[L - 1 - m]:
            m += 1
        if m >= allowed:
            best[tokens[end + 1]] = max(best.get(tokens[end + 1], 0), m)
    cap = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    single = {seq[0] for seq in sequences if len(seq) == 1}
    return {t: mult * base ** (min(n - allowed, cap) if cap > 0 else n - allowed)
            for t, n in best.items() if t not in single}


@pytest.mark.parametrize("tokens,sequences,base", [
    ([1, 2, 3, 4, 5, 6, 1, 2, 3], {(5, 6)}, 1.75),  # a breaker before the repeat: no cut
    ([1, 2, 5, 7, 1, 2, 5], {(5, 6)}, 1.75),  # 5 without its 6 breaks nothing
    ([1, 2, 5, 6, 9, 1, 2, 5, 6], {(5, 6)}, 1.75),  # the newest tokens spell the breaker
    ([3, 4, 5, 6, 3, 4, 8, 3, 4], {(5, 6)}, 1.75),
    ([1, 2, 5, 6, 7, 1, 2, 5, 6, 7, 1, 2], {(5,), (5, 6, 7)}, 1.75),  # the longest tail that fits
    ([1, 2, 9, 4, 1, 2], {(9,)}, 1.75),  # 9 extends the repeat but is a breaker: spared
    ([4, 4, 4, 4, 4, 4], set(), 1e30),  # the exponent's cap
])
def test_dry_with_breakers_of_several_tokens_is_llama_cpps(tokens, sequences, base):
    p = SamplingParams(dry_multiplier=0.8, dry_base=base, dry_allowed_length=2, dry_breaker_ids=frozenset(sequences))
    x = logits(6).double()
    got = adjust_logits(x.clone(), [req(p, prompt=tokens)])
    want = x.clone()
    for t, pen in ref_dry_sequences(tokens, 0.8, base, 2, sequences).items():
        want[0, t] -= pen
    torch.testing.assert_close(got, want)


def test_a_breaker_spanning_tokens_is_found_as_llama_cpp_finds_it(tmp_path):
    """get_overlapping_token_sequences: "am:" is in no token of the tiny byte-level vocabulary; a token
    ending in its start ("a", " a") heads it, followed by the tokens of the rest ("m", ":")."""
    from ridge.daemon import protocol as P
    from ridge.daemon.cli.config import defaults
    from ridge.daemon.cli.serve import limits
    from ridge.daemon.frontend.validate import Validator
    from ridge.tokenizer import Tokenizer
    from tiny_models import write_tokenizer_files

    write_tokenizer_files(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    v = Validator(tok, tok.vocab_size, 256, 16, 64, limits(defaults(), 256))
    one = {text: ids[0] for text in ("a", " a", "m", ":", "an", "\n") if len(ids := tok.encode(text, False)) == 1}
    assert len(one) == 6
    body = {"prompt": "x", "params": {"max_tokens": 1, "dry_multiplier": 0.8, "dry_sequence_breakers": ["am:", "\n"]}}
    seqs = v.generate(P.Envelope("generate", "g", body, 2)).params.dry_breaker_ids
    assert {(one["a"], one["m"], one[":"]), (one[" a"], one["m"], one[":"]), (one["\n"],)} <= seqs
    heads = {s[0] for s in seqs}
    assert one[":"] not in heads and one["an"] not in heads and one["m"] not in heads
    # every sequence spells the breaker across its tokens' texts, from a token's end
    for head, *tail in seqs:
        text, rest = tok.decode([head], False), tok.decode(tail, False)
        assert "\n" in text if not tail else any(text.endswith(b[:len(b) - len(rest)]) and b.endswith(rest)
                                                for b in ("am:",))


def test_top_n_sigma_is_its_definition():
    x = logits(7)
    x[0, :5] = float("-inf")  # masked by a grammar: not part of the statistics
    got = Sampler().probs(x, [req(SamplingParams(temperature=1.0, top_n_sigma=1.0))])
    fin = x[0][torch.isfinite(x[0])].double().numpy()
    floor = fin.max() - 1.0 * fin.std()  # population std, as llama.cpp
    assert kept(got) == {i for i in range(V) if x[0, i] >= floor}


def test_xtc_removes_the_top_choices_but_the_least_of_them():
    x = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05] + [0.0] * (V - 5)]))
    p = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.12, seed=0)
    got = Sampler().probs(x, [req(p)])
    assert kept(got) == {2, 3, 4}  # 0.4 and 0.3 go; 0.15, the least at or above 0.12, stays
    one = Sampler().probs(x, [req(p.derive(xtc_threshold=0.35))])  # one token above: nothing removed
    assert kept(one) == {0, 1, 2, 3, 4}


def ref_mirostat(p_sorted: np.ndarray, mu: float, tau: float, eta: float, version: int, token_rank: int, V: int):
    """-> (the kept count, mu after drawing the token at token_rank of the sorted distribution)."""
    if version == 2:
        k = max(1, int(np.sum(-np.log2(p_sorted) <= mu)))
    else:
        num = sum(math.log((i + 2) / (i + 1)) * math.log(p_sorted[i] / p_sorted[i + 1]) for i in range(99))
        den = sum(math.log((i + 2) / (i + 1)) ** 2 for i in range(99))
        s = num / den
        eps = s - 1
        k = max(1, int((eps * 2 ** mu / (1 - V ** -eps)) ** (1 / s)))
    q = p_sorted[:k] / p_sorted[:k].sum()
    return k, mu - eta * (-math.log2(q[token_rank]) - tau)


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_keeps_and_moves_mu_as_defined(version):
    Vb = 256
    x = torch.randn(1, Vb, generator=torch.Generator().manual_seed(version)) * 2
    p = SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=3.0, mirostat_eta=0.2, seed=11)
    r = Request("m", [1, 2], p)
    s = Sampler()
    for _ in range(4):
        mu = 2 * 3.0 if r.mirostat_mu is None else float(r.mirostat_mu)
        probs = s.probs(x, [r])
        r.mirostat_mu = torch.tensor(mu)  # probs() made mu on its first call: draw against the same
        tok = s.sample(x, [r], positions=[len(r.all_token_ids)]).read().token_ids[0]
        order = torch.softmax(x[0].double(), -1).sort(descending=True)
        k, want_mu = ref_mirostat(order.values.numpy(), mu, 3.0, 0.2, version, order.indices.tolist().index(tok), Vb)
        assert len(kept(probs)) == k and tok in order.indices[:k].tolist()
        assert float(r.mirostat_mu) == pytest.approx(want_mu, rel=1e-4, abs=1e-4)
        r.append_output(tok)


# -- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("repeat_last_n", -2), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("typical_p", 1.5),
    ("mirostat", 3), ("mirostat_tau", -1.0), ("dry_base", 0.5), ("dry_allowed_length", -1),
    ("dry_penalty_last_n", -5), ("dry_sequence_breakers", []), ("xtc_probability", 2.0), ("xtc_threshold", -0.1),
    ("top_n_sigma", float("nan")), ("logit_bias", {3: float("nan")}), ("samplers", ["top_k", "tfs"]),
])
def test_a_bad_value_is_refused_naming_its_field(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams.from_dict({field: value})


def test_the_stateful_samplers_never_speculate_the_stateless_do():
    for p in (dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(dry_multiplier=0.8),
              dict(mirostat=2, temperature=1.0), dict(xtc_probability=0.5), dict(logit_bias={1: 2.0})):
        assert SamplingParams(**p).plain_decoding, p
    for p in (dict(typical_p=0.5), dict(top_n_sigma=1.0), dict(samplers=["top_k", "temperature"]), {}):
        assert not SamplingParams(**p).plain_decoding, p


# -- the gateways ----------------------------------------------------------------------------------
def test_the_openai_route_passes_llama_servers_names():
    from ridge.daemon.gateway.openai_api import llama_samplers
    from ridge.daemon.gateway.schemas import Sampling

    p: dict = {}
    llama_samplers(Sampling(repeat_penalty=1.2, logit_bias={"15": 1.5}, dry_multiplier=0.8, mirostat=2,
                            samplers=["top_k", "temperature"]), p)
    assert p == {"repetition_penalty": 1.2, "repeat_last_n": 64, "logit_bias": [[15, 1.5]], "dry_multiplier": 0.8,
                 "mirostat": 2, "samplers": ["top_k", "temperature"]}
    p = {}
    llama_samplers(Sampling(logit_bias=[["hello", False], [3, -1]]), p)
    assert p == {"logit_bias": [["hello", False], [3, -1]]}


def test_the_ollama_route_applies_ollamas_defaults():
    from ridge.daemon.gateway.ollama_api import sampling
    from ridge.daemon.gateway.ollama_schemas import Options

    model = {"max_model_len": 128}
    p = sampling(None, None, model)
    assert p["repetition_penalty"] == 1.1 and p["repeat_last_n"] == 64
    p = sampling(Options(repeat_penalty=1.0, mirostat=2, mirostat_tau=4.0, typical_p=0.9), None, model)
    assert p["repetition_penalty"] == 1.0 and p["mirostat"] == 2 and p["mirostat_tau"] == 4.0 and p["typical_p"] == 0.9


# -- the engine: structured output and speculation --------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(tmp_path_factory, "samplers")


PENALTIES = [dict(repetition_penalty=1.3, repeat_last_n=16), dict(presence_penalty=1.0, frequency_penalty=0.5),
             dict(dry_multiplier=1.0, dry_allowed_length=1), dict(logit_bias={5: 3.0})]


@pytest.mark.parametrize("kw", PENALTIES, ids=["repeat", "presence", "dry", "bias"])
def test_greedy_with_penalties_is_the_same_with_and_without_speculation(tiny, kw):
    ps = prompts(tiny.model.cfg.vocab_size, [12, 30, 7], seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True, **kw)
    plain = make_engine(tiny)
    want = run(plain, ps, params)
    spec = make_engine(tiny, speculative="ngram")
    got = run(spec, ps, params)
    assert got == want
    assert_no_leak(spec)
    # The penalty changed the output (else the test proves nothing).
    assert run(make_engine(tiny), ps, SamplingParams(max_tokens=24, ignore_eos=True)) != want


def test_seeded_llama_samplers_repeat_and_compose_with_a_grammar(tiny):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=5, typical_p=0.9, xtc_probability=0.5, mirostat=0,
                       top_n_sigma=2.0, repetition_penalty=1.2, response_format={"type": "regex", "regex": "[ab]+"})
    ps = [[1, 2, 3, 4]]
    a = run(make_engine(tiny), ps, p)
    b = run(make_engine(tiny), ps, p)
    assert a == b and a["r0"]
    eos = set(tiny.tokenizer.eos_token_ids)
    assert re.fullmatch("[ab]+", tiny.tokenizer.decode([t for t in a["r0"] if t not in eos]))  # the mask held
