"""Paged attention: the Triton kernel under the interpreter against paged_attention_ref."""
import pytest
import torch
from kernel_utils import (poison_empty, HUGE_NUM_BLOCKS, assert_close, make_paged_batch, naive_attention,
                          poison_behind_window, sink_logits)

from ridge.kernels.attention import paged_attention_ref, paged_attention_triton
from ridge.kernels.kv_cache import FP8

pytestmark = pytest.mark.usefixtures(poison_empty.__name__)


def check(batch, num_splits=None, atol=None, window=None, softcap=None, sinks=None):
    scale = batch.q.shape[-1] ** -0.5
    args = (batch.q, batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale, batch.meta, scale)
    if window is not None:
        poison_behind_window(batch, window)  # a block read wholly behind the window shows as NaN
    expected = paged_attention_ref(*args, window=window, softcap=softcap, sinks=sinks)
    out = paged_attention_triton(*args, window=window, softcap=softcap, sinks=sinks, num_splits=num_splits)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    kw = {} if atol is None else dict(atol=atol, rtol=atol)
    assert_close(out, expected, **kw)


# Mixed steps: decodes (1), an odd prefill chunk (17) against earlier context, a
# fresh prompt (129 > one tile), and a chunk whose context is not block-aligned.
MIXED = dict(query_lens=[1, 17, 129, 1, 5], context_lens=[100, 40, 0, 255 - 1, 3])


@pytest.mark.parametrize("kv_dtype", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
def test_mixed_batch(kv_dtype):
    check(make_paged_batch(**MIXED, num_heads=4, num_kv_heads=2, head_dim=64, kv_dtype=kv_dtype))


def test_fp32_model_exact():
    # The CPU model runs fp32: the kernel's fp32 dot must match tightly.
    check(make_paged_batch(**MIXED, num_heads=4, num_kv_heads=2, head_dim=64, kv_dtype=torch.float32,
                           q_dtype=torch.float32))


@pytest.mark.parametrize("head_dim", [128, 256])
def test_head_dims(head_dim):
    check(make_paged_batch([1, 9], [60, 30], num_heads=2, num_kv_heads=1, head_dim=head_dim, kv_dtype=FP8))


@pytest.mark.parametrize("heads", [(3, 3), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa8"])
def test_group_sizes(heads):
    # A group of 3 does not divide the tile's rows: rows past BLOCK_Q * GROUP stay masked.
    check(make_paged_batch([1, 13], [30, 20], num_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                           kv_dtype=FP8, block_size=32))


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k_decode(num_splits):
    # Flash-decoding: more splits than some sequences have tiles, so empty splits must merge away.
    check(make_paged_batch([1, 1, 1], [255, 70, 0], num_heads=4, num_kv_heads=2, head_dim=64, kv_dtype=FP8),
          num_splits=num_splits)


def test_split_k_with_prefill_chunk():
    check(make_paged_batch([1, 40], [200, 100], num_heads=2, num_kv_heads=1, head_dim=64, kv_dtype=torch.bfloat16),
          num_splits=3)


@pytest.mark.parametrize("kv_dtype", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
def test_block_ids_past_int32_offsets(kv_dtype):
    # block_id * block stride exceeds 2**31 elements: 32-bit offset arithmetic would wrap.
    check(make_paged_batch([1, 20], [50, 30], num_heads=2, num_kv_heads=1, head_dim=64, kv_dtype=kv_dtype,
                           num_blocks=HUGE_NUM_BLOCKS))


def test_block_size_larger_than_tile():
    check(make_paged_batch([1, 3], [300, 10], num_heads=2, num_kv_heads=1, head_dim=64, kv_dtype=FP8,
                           block_size=256))


def test_strided_q_from_fused_qkv():
    # The model passes q as a view into the fused qkv output (row stride > H * D).
    b = make_paged_batch([1, 6], [10, 4], num_heads=4, num_kv_heads=2, head_dim=64, kv_dtype=FP8)
    wide = torch.randn(b.q.shape[0], 8 * 64).to(b.q.dtype)
    wide[:, : 4 * 64] = b.q.reshape(b.q.shape[0], -1)
    b.q = wide[:, : 4 * 64].view(-1, 4, 64)
    assert not b.q.is_contiguous()
    check(b)


def test_empty_batch():
    b = make_paged_batch([1], [4], num_heads=2, num_kv_heads=1, head_dim=64, kv_dtype=FP8)
    out = paged_attention_triton(b.q[:0], b.k_cache, b.v_cache, b.k_scale, b.v_scale,
                                 type(b.meta).build([], [], [], []), 0.125)
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_mixes(seed):
    # Random step shapes: 1-6 sequences, decodes and chunks, fp16 or bf16 queries, any split count.
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (1,), generator=g))
    q_lens = [int(x) if x > 1 else 1 for x in torch.randint(-20, 60, (n,), generator=g)]
    ctx = [int(x) for x in torch.randint(0, 200, (n,), generator=g)]
    q_dtype = (torch.float16, torch.bfloat16)[seed % 2]
    check(make_paged_batch(q_lens, ctx, num_heads=4, num_kv_heads=1, head_dim=64, kv_dtype=FP8, q_dtype=q_dtype,
                           block_size=(16, 32, 64)[seed % 3], seed=seed), num_splits=seed)


def test_software_fp8_decode_path(monkeypatch):
    # Pre-sm_89 GPUs read the FP8 cache as raw bytes and decode in the kernel.
    import ridge.kernels.attention as attention

    monkeypatch.setattr(attention, "native_fp8", lambda t: False)
    check(make_paged_batch([1, 17], [40, 20], num_heads=4, num_kv_heads=2, head_dim=64, kv_dtype=FP8))


# Sliding windows (block 16, tile 128 under the interpreter): under a block, one block, over a
# block, over a tile (the KV loop starts past tile 0); decodes and chunks across both boundaries.
WINDOWED = dict(query_lens=[1, 17, 40, 1, 5], context_lens=[100, 40, 0, 200, 3])


@pytest.mark.parametrize("window,softcap,kv_dtype", [
    (7, None, torch.bfloat16), (16, 1.5, FP8), (33, None, FP8), (150, 1.5, torch.bfloat16), (None, 1.5, FP8)])
def test_window_softcap_mixed_batch(window, softcap, kv_dtype):
    check(make_paged_batch(**WINDOWED, num_heads=4, num_kv_heads=2, head_dim=64, kv_dtype=kv_dtype),
          window=window, softcap=softcap)


def test_window_softcap_fp32_against_naive():
    b = make_paged_batch(**WINDOWED, num_heads=4, num_kv_heads=2, head_dim=64, kv_dtype=torch.float32,
                         q_dtype=torch.float32)
    poison_behind_window(b, 20)
    out = paged_attention_triton(b.q, b.k_cache, b.v_cache, None, None, b.meta, 0.125, window=20, softcap=2.0)
    assert_close(out, naive_attention(b, 0.125, 20, 2.0).float(), torch.float32)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_window_split_k_decode(num_splits):
    # The splits share the tiles from the window's first: a split may hold none of them.
    check(make_paged_batch([1, 1, 1], [300, 70, 0], num_heads=4, num_kv_heads=2, head_dim=64, kv_dtype=FP8),
          num_splits=num_splits, window=150, softcap=30.0)


def test_window_bad_arguments_are_refused():
    b = make_paged_batch([1], [4], num_heads=2, num_kv_heads=1, head_dim=64, kv_dtype=FP8)
    with pytest.raises(ValueError, match="window"):
        paged_attention_triton(b.q, b.k_cache, b.v_cache, b.k_scale, b.v_scale, b.meta, 0.125, window=0)


# Attention sinks (gpt-oss): once after the KV loop, or in the merge of split-K partials.
@pytest.mark.parametrize("window,softcap,kv_dtype", [
    (None, None, torch.bfloat16), (None, None, FP8), (33, None, FP8), (150, 1.5, torch.bfloat16)])
def test_sinks_mixed_batch(window, softcap, kv_dtype):
    check(make_paged_batch(**WINDOWED, num_heads=8, num_kv_heads=2, head_dim=64, kv_dtype=kv_dtype),
          window=window, softcap=softcap, sinks=sink_logits(8))


@pytest.mark.parametrize("window", [None, 150])
def test_sinks_split_k_decode(window):
    # The sink enters the merge once, not once per split; a split that sees no key adds nothing.
    check(make_paged_batch([1, 1, 1], [300, 70, 0], num_heads=8, num_kv_heads=2, head_dim=64, kv_dtype=FP8),
          num_splits=3, window=window, sinks=sink_logits(8))


@pytest.mark.parametrize("window", [None, 20])
def test_sinks_fp32_against_naive(window):
    b = make_paged_batch(**WINDOWED, num_heads=8, num_kv_heads=4, head_dim=64, kv_dtype=torch.float32,
                         q_dtype=torch.float32)
    if window is not None:
        poison_behind_window(b, window)
    sinks = sink_logits(8)
    for splits in (1, 2):
        out = paged_attention_triton(b.q, b.k_cache, b.v_cache, None, None, b.meta, 0.125, window=window,
                                     sinks=sinks, num_splits=splits)
        assert_close(out, naive_attention(b, 0.125, window, None, sinks).float(), torch.float32)
