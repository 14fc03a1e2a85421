"""Overlapped steps (async scheduling): the host plans step N+1 while step N runs,
and a sampled token reaches the next step on the device. On CPU the engine runs
the same code with async_scheduling=True, so every rule is checked here:
outputs equal the synchronous engine's token for token, stops take effect a
step late without a token too many reaching a client, and nothing leaks."""
from __future__ import annotations

import pytest
import torch

from engine_utils import assert_no_leak, greedy, load_tiny, make_engine, prompts, run
from ridge.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_tiny(tmp_path_factory, "overlap")


@pytest.fixture(scope="module")
def ps(loaded):
    return prompts(loaded.config.vocab_size, [5, 17, 40, 129, 3, 64, 23, 90], seed=3)


def finals(engine, ps, params) -> dict:
    """-> request id -> (tokens, finish reason, text), asserting one final output each."""
    plist = params if isinstance(params, list) else [params] * len(ps)
    ids = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, plist))]
    got = {(i, k): [[], None, ""] for i in ids for k in range(plist[0].n)}
    while engine.has_unfinished():
        for o in engine.step():
            g = got[(o.request_id, o.index)]
            assert g[1] is None, f"{o.request_id} got output after it finished"
            g[0] += o.new_token_ids
            g[2] += o.new_text
            if o.finished:
                g[1] = o.finish_reason
    return {k: tuple(map(lambda x: tuple(x) if isinstance(x, list) else x, v)) for k, v in got.items()}


def both(loaded, ps, params, **kw):
    sync = finals(make_engine(loaded, async_scheduling=False, **kw), ps, params)
    eng = make_engine(loaded, async_scheduling=True, **kw)
    assert eng.async_scheduling
    over = finals(eng, ps, params)
    assert_no_leak(eng)
    return sync, over


@pytest.mark.parametrize("graphs", [False, True])
def test_overlap_equals_sync_greedy(loaded, ps, graphs):
    sync, over = both(loaded, ps, greedy(20), cuda_graph=graphs)
    assert over == sync


def test_stop_tokens_take_effect_a_step_late_but_nothing_extra_reaches_clients(loaded, ps):
    ref = run(make_engine(loaded), ps, greedy(20))
    # Stop each request at a token it really produces, at various depths.
    params = [SamplingParams(max_tokens=20, stop_token_ids=[ref[f"r{i}"][(3 * i) % 20]]) for i in range(len(ps))]
    sync, over = both(loaded, ps, params)
    assert over == sync
    for i in range(len(ps)):
        toks, reason, _ = over[(f"r{i}", 0)]
        cut = ref[f"r{i}"].index(params[i].stop_token_ids[0]) + 1
        assert list(toks) == ref[f"r{i}"][:cut] and reason == "stop"


def test_overlap_with_preemption(loaded, ps):
    # A pool this small preempts running requests; preempted ones resume by recompute.
    sync, over = both(loaded, ps[:6], greedy(40), num_kv_blocks=14, max_num_seqs=6)
    assert over == sync


def test_overlap_n2_seeded_sampling_and_logprobs(loaded, ps):
    params = SamplingParams(max_tokens=12, n=2, temperature=0.8, top_p=0.9, top_k=20, seed=7, logprobs=2,
                            ignore_eos=True)
    sync, over = both(loaded, ps[:4], params)
    assert over == sync
    assert any(over[(f"r{i}", 0)][0] != over[(f"r{i}", 1)][0] for i in range(4))


def test_repetition_penalty_reads_the_whole_history(loaded, ps):
    params = [greedy(16, repetition_penalty=1.3), greedy(16)] * 2
    sync, over = both(loaded, ps[:4], params)
    assert over == sync


def test_abort_while_a_step_is_in_flight(loaded, ps):
    eng = make_engine(loaded, async_scheduling=True)
    for i in range(3):
        eng.add_request(f"r{i}", ps[i], greedy(30))
    seen = {f"r{i}": [] for i in range(3)}
    finished = {}
    for _ in range(6):
        for o in eng.step():
            seen[o.request_id] += o.new_token_ids
    assert eng.in_flight is not None
    eng.abort_request("r1")
    n_before = len(seen["r1"])
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id not in finished, "output after the final one"
            seen[o.request_id] += o.new_token_ids
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert finished == {"r1": "abort", "r0": "length", "r2": "length"}
    assert len(seen["r1"]) == n_before and len(seen["r0"]) == len(seen["r2"]) == 30
    assert_no_leak(eng)


# Tensor methods that make the host wait for the device (numpy() is not among them: a device
# tensor has none, so only host tensors, pinned buffers for instance, call it).
_SYNCS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")


class _NoSync:
    """Within the block, a listed Tensor method called from ridge's own code raises:
    on a GPU each would stall the host until the device catches up."""

    def __enter__(self):
        import sys
        self.saved = {m: getattr(torch.Tensor, m) for m in _SYNCS}
        self.calls = []
        for name, fn in self.saved.items():
            def guard(t, *a, _fn=fn, _name=name, **k):
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if caller.startswith("ridge.") and self.armed:
                    self.calls.append(f"{caller}: Tensor.{_name}")
                    raise AssertionError(f"host sync in {caller}: Tensor.{_name}")
                return _fn(t, *a, **k)
            setattr(torch.Tensor, name, guard)
        self.armed = True
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)


def test_no_host_sync_while_a_step_is_planned_and_launched(loaded, ps):
    """The GPU path (Triton kernels, here under the interpreter) through the runner: only
    StepHandle.read() may wait for the device."""
    from ridge.kernels import ops
    # No disk tier: blocks an earlier test left there would be loaded at admission instead.
    eng = make_engine(loaded, async_scheduling=True, cuda_graph=True, max_num_seqs=4, kv_disk=False)
    params = [greedy(3), SamplingParams(max_tokens=3, temperature=0.7, top_k=5, min_p=0.05, seed=1, logprobs=1)]
    for i, p in enumerate(params):
        eng.add_request(f"r{i}", ps[i][:20], p)
    with ops.use_triton():
        first = eng.scheduler.schedule()  # a mixed step (both prefills)
        with _NoSync() as guard:
            h1 = eng.runner.launch(first)
            second = eng.scheduler.schedule()  # decodes fed from the first step's samples
            h2 = eng.runner.launch(second)
            guard.armed = False
        assert not guard.calls
        eng.scheduler.update(first, h1.read()[0])
        eng.scheduler.update(second, h2.read()[0])
    assert all(len(r.output_token_ids) == 2 for r in eng.scheduler.running)
