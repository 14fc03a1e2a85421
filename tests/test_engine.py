"""The engine on a tiny model with the real block pool and scheduler.
fp32 KV throughout, so "same tokens" means exactly the same."""
from __future__ import annotations

import re

import pytest
import torch

from engine_utils import assert_no_leak, greedy, make_engine, prompts, run
from ridge.errors import InvalidRequest
from ridge.engine.sampling_params import SamplingParams
from ridge.models.loader import load_model
from tiny_models import make_tiny


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path, cfg, _ = make_tiny(tmp_path_factory.mktemp("engine"), "llama", max_position=512)
    return load_model(path, device="cpu", use_cache=False)


@pytest.fixture(scope="module")
def reference(loaded):
    """Greedy tokens of each prompt alone, whole prefill, big pool."""
    ps = prompts(loaded.config.vocab_size, [5, 17, 40, 129, 3, 64, 23, 90])
    eng = make_engine(loaded, prefill_chunk=256)
    out = {}
    for i, p in enumerate(ps):
        out[i] = run(eng, [p], greedy(24))["r0"]
    assert_no_leak(eng)
    return ps, out


def test_batched_equals_alone(loaded, reference):
    ps, ref = reference
    eng = make_engine(loaded)
    got = run(eng, ps, greedy(24))
    assert [got[f"r{i}"] for i in range(len(ps))] == [ref[i] for i in range(len(ps))]
    assert_no_leak(eng)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_whole_prefill(loaded, reference, chunk):
    ps, ref = reference
    eng = make_engine(loaded, prefill_chunk=chunk, enable_prefix_caching=False)
    got = run(eng, ps, greedy(24))
    assert [got[f"r{i}"] for i in range(len(ps))] == [ref[i] for i in range(len(ps))]
    assert_no_leak(eng)


def test_decodes_run_beside_prefill_chunks(loaded):
    ps = prompts(loaded.config.vocab_size, [4, 200])
    eng = make_engine(loaded, prefill_chunk=16)
    eng.add_request("short", ps[0], greedy(30))
    eng.step()
    eng.add_request("long", ps[1], greedy(2))
    mixed = 0
    while eng.has_unfinished():
        out = eng.scheduler.schedule()
        n = {s.request.request_id: s.num_scheduled_tokens for s in out.scheduled}
        if n.get("short") == 1 and n.get("long", 0) > 1:
            mixed += 1
        tokens, samples = eng.runner.launch(out).read()
        eng.scheduler.update(out, tokens)
        eng._postprocess(out, tokens, samples)
    assert mixed >= 10  # the long prompt's 13 chunks shared their steps with the decode
    assert_no_leak(eng)


def test_prefix_hit_same_tokens_and_skips_compute(loaded, reference):
    ps, ref = reference
    eng = make_engine(loaded)
    base = ps[3]  # 129 tokens: 8 full blocks
    run(eng, [base], greedy(24))
    before = eng.totals["prefill_tokens"]
    eng.add_request("again", base, greedy(24))
    toks, cached = [], 0
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
            cached = o.num_cached_tokens
    assert toks == ref[3]
    assert cached == 128 and eng.totals["prefill_tokens"] - before == 1
    assert eng.kv_cache_manager.prefix_hit_rate > 0
    assert_no_leak(eng)


def test_prefix_hit_on_shared_system_prompt(loaded):
    system = prompts(loaded.config.vocab_size, [48], seed=3)[0]
    a, b = system + [5, 6, 7], system + [9, 10]
    alone = run(make_engine(loaded, enable_prefix_caching=False), [b], greedy(10))["r0"]
    eng = make_engine(loaded)
    run(eng, [a], greedy(10))
    rid = eng.add_request("b", b, greedy(10))
    toks, cached = [], None
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
            cached = o.num_cached_tokens
    assert toks == alone and cached == 48
    assert_no_leak(eng)


def test_preemption_and_resume_give_same_tokens(loaded, reference):
    ps, ref = reference
    # 24 blocks of 16 cannot hold all eight requests at once: the newest are preempted.
    eng = make_engine(loaded, num_kv_blocks=24, enable_prefix_caching=False)
    got = run(eng, ps, greedy(24))
    assert eng.scheduler.num_preemptions > 0
    assert [got[f"r{i}"] for i in range(len(ps))] == [ref[i] for i in range(len(ps))]
    assert_no_leak(eng)


def test_preemption_with_prefix_caching(loaded, reference):
    ps, ref = reference
    eng = make_engine(loaded, num_kv_blocks=24)
    got = run(eng, ps, greedy(24))
    assert eng.scheduler.num_preemptions > 0
    assert [got[f"r{i}"] for i in range(len(ps))] == [ref[i] for i in range(len(ps))]
    assert_no_leak(eng)


def test_abort_mid_stream_frees_blocks(loaded):
    eng = make_engine(loaded)
    ps = prompts(loaded.config.vocab_size, [30, 30, 30])
    for i, p in enumerate(ps):
        eng.add_request(f"a{i}", p, greedy(100))
    for _ in range(5):
        eng.step()
    used = eng.kv_cache_manager.num_used_blocks
    assert eng.abort_request("a1")
    finals = [o for o in eng.step() if o.request_id == "a1"]
    assert finals and finals[0].finished and finals[0].finish_reason == "abort"
    assert eng.kv_cache_manager.num_used_blocks < used
    assert not eng.abort_request("a1")  # already gone
    eng.abort_request("a0"), eng.abort_request("a2")
    eng.step()
    assert_no_leak(eng)


def test_seeded_sample_same_alone_and_in_batch(loaded):
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    target = prompts(loaded.config.vocab_size, [12], seed=9)[0]
    alone = run(make_engine(loaded), [target], p)["r0"]
    others = prompts(loaded.config.vocab_size, [3, 30, 8, 50, 17, 5, 26], seed=10)
    mixed = [SamplingParams(max_tokens=25, temperature=1.0, seed=s, ignore_eos=True) for s in range(7)]
    eng = make_engine(loaded)
    got = run(eng, others[:4] + [target] + others[4:], mixed[:4] + [p] + mixed[4:])
    assert got["r4"] == alone
    assert_no_leak(eng)


def test_n_samples_share_prompt_blocks(loaded):
    eng = make_engine(loaded)
    prompt = prompts(loaded.config.vocab_size, [70], seed=4)[0]
    eng.add_request("multi", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=4, ignore_eos=True))
    cached, outs = {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.index, []).extend(o.new_token_ids)
            if o.finished:
                cached[o.index] = o.num_cached_tokens
    assert sorted(cached) == [0, 1, 2, 3] and all(len(v) == 8 for v in outs.values())
    assert sorted(cached.values()) == [0, 64, 64, 64]  # the 4 full prompt blocks, physically shared
    assert len({tuple(v) for v in outs.values()}) > 1
    assert_no_leak(eng)


def test_continuous_batching_admits_in_the_next_step(loaded):
    eng = make_engine(loaded, max_num_seqs=2)
    ps = prompts(loaded.config.vocab_size, [5, 5, 5])
    eng.add_request("short", ps[0], greedy(3))
    eng.add_request("long", ps[1], greedy(12))
    eng.add_request("queued", ps[2], greedy(3))
    step, finished_at, joined_at = 0, None, None
    while eng.has_unfinished():
        step += 1
        for o in eng.step():
            if o.request_id == "short" and o.finished:
                finished_at = step
        if joined_at is None and any(r.request_id == "queued" for r in eng.scheduler.running):
            joined_at = step
    assert joined_at == finished_at + 1  # the freed slot is filled by the very next step
    assert_no_leak(eng)


def test_stop_rules(loaded):
    eng = make_engine(loaded)
    p = prompts(loaded.config.vocab_size, [10], seed=11)[0]
    free = run(eng, [p], greedy(20))["r0"]
    stop_tok = free[5]
    got = run(eng, [p], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok]))["r0"]
    assert got == free[: free.index(stop_tok) + 1]
    text = eng.tokenizer.decode(free)
    needle = text[len(text) // 2: len(text) // 2 + 2]
    eng.add_request("s", p, SamplingParams(max_tokens=20, ignore_eos=True, stop=[needle]))
    out, reason = "", None
    while eng.has_unfinished():
        for o in eng.step():
            out += o.new_text
            reason = o.finish_reason or reason
    assert reason == "stop" and needle not in out and text.startswith(out)
    assert_no_leak(eng)


def test_logprobs_and_top_k_one_is_greedy(loaded):
    eng = make_engine(loaded)
    p = prompts(loaded.config.vocab_size, [10], seed=12)[0]
    g = run(eng, [p], greedy(8))["r0"]
    k1 = run(eng, [p], SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True))["r0"]
    assert g == k1
    eng.add_request("lp", p, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3))
    lps = []
    while eng.has_unfinished():
        for o in eng.step():
            lps += o.logprobs or []
    assert len(lps) == 4
    for (lp, top), tok in zip(lps, g):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-6 and lp <= 0


def test_admission_errors_do_not_stall_the_queue(loaded):
    eng = make_engine(loaded, num_kv_blocks=8, max_model_len=400)
    with pytest.raises(InvalidRequest, match="context"):
        eng.add_request("long", [5] * 400, greedy(4))
    with pytest.raises(InvalidRequest, match="never fit"):
        eng.add_request("huge", [5] * 100, greedy(200))
    with pytest.raises(InvalidRequest, match="empty"):
        eng.add_request("empty", [], greedy(4))
    with pytest.raises(InvalidRequest, match="token ids"):
        eng.add_request("oov", [10**9], greedy(4))
    with pytest.raises(InvalidRequest):
        SamplingParams(top_p=0)
    got = run(eng, [[5, 6, 7]], greedy(4))
    assert len(got["r0"]) == 4
    assert_no_leak(eng)


def test_step_failure_fails_its_requests_and_engine_keeps_serving(loaded, caplog):
    """The failed request's error names an error id, not the exception; the log has both."""
    eng = make_engine(loaded)
    p = prompts(loaded.config.vocab_size, [10, 12])
    eng.add_request("doomed", p[0], greedy(5))
    forward = eng.model.forward
    eng.model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected fault"))
    outs = eng.step()
    eng.model.forward = forward
    assert outs and outs[0].finish_reason == "error"
    error_id = re.fullmatch(r"internal error; id ([0-9a-f]{12})", outs[0].error).group(1)
    (record,) = [r for r in caplog.records if error_id in r.getMessage()]
    assert record.exc_info and "injected fault" in caplog.text and "Traceback" in caplog.text
    assert len(run(eng, [p[1]], greedy(5))["r0"]) == 5
    assert_no_leak(eng)


def test_stats_report_the_pool(loaded):
    eng = make_engine(loaded)
    eng.add_request("x", [5, 6, 7, 8], greedy(40))
    eng.step()
    s = eng.stats()
    assert s["running"] == 1 and s["kv_blocks_used"] == 1
    assert s["kv_blocks_used"] + s["kv_blocks_free"] == s["kv_blocks_total"] == 256
    assert s["kv_bytes_per_token"] == 2 * loaded.config.num_layers * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    eng.abort_request("x")
    eng.step()
    assert_no_leak(eng)


def test_fp8_kv_engine_runs(loaded, reference):
    ps, ref = reference
    eng = make_engine(loaded, kv_dtype="fp8")
    assert eng.kv_cache.layers[0].k.dtype == torch.float8_e4m3fn
    got = run(eng, ps[:3], greedy(8))
    agree = sum(a == b for i in range(3) for a, b in zip(got[f"r{i}"], ref[i][:8]))
    assert agree >= 18  # a random tiny model has many near-ties; most tokens still agree
    assert_no_leak(eng)


def test_decode_graph_path_gives_same_tokens(loaded, reference):
    """The CUDA-graph runner's padded static buffers, replayed eagerly on CPU."""
    ps, ref = reference
    eng = make_engine(loaded, cuda_graph=True, max_num_seqs=8)
    assert eng.runner.graphs is not None
    got = run(eng, ps[:5], greedy(24))
    assert [got[f"r{i}"] for i in range(5)] == [ref[i] for i in range(5)]
    assert_no_leak(eng)


def test_one_model_step_through_the_triton_kernels(loaded, reference):
    """The Triton path under the interpreter, through the engine, for a short run."""
    from ridge.kernels import ops
    ps, ref = reference
    eng = make_engine(loaded)
    with ops.use_triton():
        got = run(eng, [ps[0], ps[2]], greedy(3))
    assert got["r0"] == ref[0][:3] and got["r1"] == ref[2][:3]
    assert_no_leak(eng)


def test_request_histograms_count_each_finished_sample(loaded):
    """The monitoring figures (docs/protocol.md §7.2): one observation per finished sample, one
    inter-token latency per token after the first, prefix-cache queries and hits in tokens."""
    eng = make_engine(loaded)
    ps = prompts(loaded.config.vocab_size, [20, 20])
    run(eng, ps, [greedy(10), SamplingParams(max_tokens=6, ignore_eos=True, n=2, seed=1)])
    eng.add_request("gone", ps[0], greedy(50))
    gone = sum(len(o.new_token_ids) for o in eng.step())
    eng.abort_request("gone")
    while eng.has_unfinished():
        eng.step()
    st = eng.stats()
    h = st["histograms"]
    assert st["finished"] == {"stop": 0, "length": 3, "abort": 1, "error": 0}
    assert h["e2e_s"]["count"] == h["prompt_tokens"]["count"] == h["queue_s"]["count"] == 4
    assert h["ttft_s"]["count"] == 3 + (gone > 0)
    assert h["generation_tokens"]["sum"] == 10 + 6 + 6 + gone
    assert h["itl_s"]["count"] == 9 + 5 + 5 + max(0, gone - 1)
    for hist in h.values():
        assert len(hist["counts"]) == len(hist["bounds"]) + 1 and sum(hist["counts"]) == hist["count"]
    assert st["prefix_cache"]["queries"] >= 3 * 20 and st["prefix_cache"]["hits"] >= 16  # "gone" reuses ps[0]
    assert_no_leak(eng)
