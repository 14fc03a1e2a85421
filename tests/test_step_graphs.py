"""Every step runs at a captured shape: pure decodes padded to a batch size,
mixed steps padded to a token count with the sequences padded to capacity.
On CPU the same padded buffers run eagerly; padding must change no real row
and write no cache slot, with the torch references and with the Triton
kernels (the interpreter), which is what a GPU replays."""
from __future__ import annotations

import pytest
import torch

from engine_utils import greedy, load_tiny, make_engine, prompts
from ridge.kernels import ops
from ridge.kernels.cuda_graph import GraphShape, ladder


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_tiny(tmp_path_factory, "graphs")


def test_shapes():
    assert ladder(20, (1, 2, 4), 8) == [1, 2, 4, 8, 16, 20]
    assert ladder(300, (16, 32, 64, 96), 128) == [16, 32, 64, 96, 128, 256, 300]


def _cache_bytes(eng):
    return [t.clone() for layer in eng.kv_cache.layers for t in (layer.k, layer.v)]


def _forward(eng, out, graph: bool):
    """-> (logits of the sample rows, cache after the step); the cache is restored after."""
    before = _cache_bytes(eng)
    r = eng.runner
    if graph:
        num = sum(s.num_scheduled_tokens for s in out.scheduled)
        shape = r.graphs.shape_for(len(out.scheduled), num, all(s.num_scheduled_tokens == 1 for s in out.scheduled))
        assert shape is not None
        batch = r.plan(out, graph=shape)
        assert batch.input_ids.shape[0] >= num
        hidden = r.graphs.run(shape, batch)
    else:
        batch = r.plan(out)
        hidden = r.model(batch.input_ids, batch.positions, batch.meta, r.kv_cache.layers)
    logits = r.model.compute_logits(hidden.index_select(0, batch.sample_rows))
    after = _cache_bytes(eng)
    for t, b in zip((t for layer in eng.kv_cache.layers for t in (layer.k, layer.v)), before):
        t.copy_(b)
    return logits, after, shape if graph else None


def _same_cache(got, ref):
    # Real slots hold the same values up to the products' rounding at another row count
    # (fp32 KV here); a slot the padding wrote would differ by the values' size.
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("triton", [False, True])
def test_padding_changes_nothing(loaded, triton):
    eng = make_engine(loaded, cuda_graph=True, max_num_seqs=5, prefill_chunk=40)
    ps = prompts(loaded.config.vocab_size, [6, 12, 11], seed=5)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, greedy(4))
    ctx = ops.use_triton() if triton else ops.use_triton(False)
    with ctx, torch.inference_mode():
        out = eng.scheduler.schedule()  # three whole prompts: 29 tokens, padded to 32
        ref, ref_cache, _ = _forward(eng, out, graph=False)
        got, got_cache, shape = _forward(eng, out, graph=True)
        assert shape == GraphShape("mixed", 32)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        _same_cache(got_cache, ref_cache)
        eng.scheduler.update(out, eng.runner.launch(out).read()[0])
        out = eng.scheduler.schedule()  # three decodes, padded to 4
        ref, ref_cache, _ = _forward(eng, out, graph=False)
        got, got_cache, shape = _forward(eng, out, graph=True)
        assert shape == GraphShape("decode", 4)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        _same_cache(got_cache, ref_cache)
