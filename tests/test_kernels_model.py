"""Whole model steps through ops.use_triton() (the interpreter) against the reference
path, the decode graph runner's padding, the dispatch rules and the config cache."""
import math

import pytest
import torch
from tiny_models import make_tiny

from ridge.cache.kv_cache import KVCache
from ridge.kernels import ops
from ridge.kernels.cuda_graph import DecodeGraphRunner, default_sizes
from ridge.kernels.metadata import AttentionMetadata
from ridge.kernels.triton_utils import ConfigCache
from ridge.models.oneshot import prompt_logits
from ridge.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, cfg, _ = make_tiny(tmp_path_factory.mktemp("tiny"))
    return load_model(path, device="cpu", quantize=True, use_cache=False, show_progress=False).model


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32"])
def test_prompt_step_through_triton(tiny, kv_dtype):
    ids = list(range(3, 44))
    expected = prompt_logits(tiny, ids, kv_dtype=kv_dtype)
    with ops.use_triton():
        got = prompt_logits(tiny, ids, kv_dtype=kv_dtype)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def decode_batch(model, lens, kv_dtype="fp8", block_size=16):
    """Prefill each sequence with the reference, then build one decode step of all of them."""
    nb_each = math.ceil((max(lens) + 1) / block_size)
    cache = KVCache(model.cfg, nb_each * len(lens) + 1, block_size, kv_dtype)
    tables = [list(range(1 + i * nb_each, 1 + (i + 1) * nb_each)) for i in range(len(lens))]
    g = torch.Generator().manual_seed(1)
    for table, n in zip(tables, lens):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        meta = AttentionMetadata.build([n], [n], [table], slots)
        model(torch.randint(3, 200, (n,), generator=g), torch.arange(n), meta, cache.layers)
    slots = [t[n // block_size] * block_size + n % block_size for t, n in zip(tables, lens)]
    meta = AttentionMetadata.build([1] * len(lens), [n + 1 for n in lens], tables, slots)
    return cache, torch.randint(3, 200, (len(lens),), generator=g), torch.tensor(lens), meta


def test_decode_step_through_graph_runner_padding(tiny):
    # On CPU, enabled=True replays the padded static buffers eagerly: the padded rows
    # (slot -1, seq_len 1) must neither write the cache nor change the real rows.
    lens = [5, 30, 17]
    cache, ids, pos, meta = decode_batch(tiny, lens)
    ref_cache, *_ = decode_batch(tiny, lens)
    expected = tiny(ids, pos, meta, ref_cache.layers)
    runner = DecodeGraphRunner(lambda i, p, m: tiny(i, p, m, cache.layers), max_batch=8, sizes=[1, 4, 8],
                               max_blocks_per_seq=meta.block_table.shape[1] + 2, max_seq_len=64,
                               device="cpu", enabled=True)
    assert runner.can_run(meta) and not runner.can_run(9) and runner._size_for(3) == 4
    with ops.use_triton():
        got = runner.run(ids, pos, meta)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    for a, b in zip(cache.layers, ref_cache.layers):  # block 0 (the padding's) untouched
        assert torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8))
        assert torch.equal(a.k_scale, b.k_scale)


def test_graph_runner_off_on_cpu():
    runner = DecodeGraphRunner(lambda *a: None, max_batch=16, max_blocks_per_seq=4, max_seq_len=64, device="cpu")
    assert not runner.can_run(1)
    assert default_sizes(20) == [1, 2, 4, 8, 16, 20]
    mixed = AttentionMetadata.build([1, 3], [5, 3], [[0], [1]], [0, 1, 2, 3])
    assert not DecodeGraphRunner(lambda *a: None, 4, max_blocks_per_seq=4, max_seq_len=64, device="cpu",
                                 enabled=True).can_run(mixed)


def test_dispatch_rules():
    x = torch.zeros(2, 8)
    assert ops._pick("rms_norm", ops.rms_norm_ref, x) is ops.rms_norm_ref  # CPU default: reference
    with ops.use_triton():
        assert ops._pick("rms_norm", ops.rms_norm_ref, x).__name__ == "rms_norm_triton"
        with ops.use_triton(False):
            assert ops._pick("rms_norm", ops.rms_norm_ref, x) is ops.rms_norm_ref
    assert ops._FORCE is None


def test_config_cache_round_trip(tmp_path):
    cache = ConfigCache(tmp_path / "cfg.json")
    cache.put("attn|H200|sm90|key", {"BLOCK_N": 64})
    assert ConfigCache(tmp_path / "cfg.json").get("attn|H200|sm90|key") == {"BLOCK_N": 64}
    assert ConfigCache(tmp_path / "missing.json").get("x") is None
