"""Paged attention (torch reference, the CPU path) against contiguous attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_utils import assert_close, make_paged_batch, naive_attention, poison_behind_window, sink_logits

from ridge.kernels import attention_native, native, ops
from ridge.kernels.attention import paged_attention_ref
from ridge.kernels.attention_native import NATIVE_MAX_Q
from ridge.kernels.kv_cache import write_kv_ref
from ridge.kernels.metadata import AttentionMetadata


def contiguous_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Plain causal attention over one whole sequence, the oracle for paging.
    q: [T, H, D]; k, v: [T, Hkv, D]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


H, HKV, D, BS = 4, 2, 16, 16


def paged_setup(lengths, query_lens, num_blocks=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
    kc = torch.zeros(num_blocks, BS, HKV, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    ks = vs = None
    if dtype == torch.float8_e4m3fn:
        ks = torch.ones(num_blocks, BS, HKV, dtype=torch.float16)
        vs = torch.ones_like(ks)
    seqs, tables = [], []
    for L in lengths:
        nb = -(-L // BS)
        table = [perm.pop() for _ in range(nb)]
        q = torch.randn(L, H, D, generator=g)
        k = torch.randn(L, HKV, D, generator=g)
        v = torch.randn(L, HKV, D, generator=g)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(L)])
        write_kv_ref(k, v, kc, vc, ks, vs, slots)
        seqs.append((q, k, v))
        tables.append(table)
    q_all = torch.cat([q[L - n:] for (q, _, _), L, n in zip(seqs, lengths, query_lens)])
    meta = AttentionMetadata.build(query_lens, lengths, tables, [0] * sum(query_lens))
    return seqs, q_all, kc, vc, ks, vs, meta


@pytest.mark.parametrize("lengths,query_lens", [
    ([50], [50]),  # whole prefill
    ([1, 17, 129, 33], [1, 1, 1, 1]),  # decodes
    ([129, 40, 5, 64], [1, 18, 5, 1]),  # mixed: decode, chunk after context, prefill, decode
])
def test_paged_equals_contiguous(lengths, query_lens):
    seqs, q_all, kc, vc, ks, vs, meta = paged_setup(lengths, query_lens)
    out = paged_attention_ref(q_all, kc, vc, ks, vs, meta, D ** -0.5)
    start = 0
    for (q, k, v), L, n in zip(seqs, lengths, query_lens):
        ref = contiguous_attention_ref(q, k, v, D ** -0.5)[L - n:]
        torch.testing.assert_close(out[start:start + n], ref, atol=1e-5, rtol=1e-5)
        start += n


def test_fp8_cache_is_close():
    lengths, qlens = [129, 40, 7], [1, 18, 7]
    seqs, q_all, kc, vc, ks, vs, meta = paged_setup(lengths, qlens, dtype=torch.float8_e4m3fn)
    out = paged_attention_ref(q_all, kc, vc, ks, vs, meta, D ** -0.5)
    start = 0
    for (q, k, v), L, n in zip(seqs, lengths, qlens):
        ref = contiguous_attention_ref(q, k, v, D ** -0.5)[L - n:]
        torch.testing.assert_close(out[start:start + n], ref, atol=0.08, rtol=0.08)
        start += n


def test_write_kv_quantizes_per_token_head_and_skips_padding():
    kc = torch.zeros(4, BS, HKV, D, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(4, BS, HKV, dtype=torch.float16)
    vs = torch.zeros_like(ks)
    k = torch.randn(3, HKV, D) * torch.tensor([0.01, 1.0, 300.0])[:, None, None]
    write_kv_ref(k, k, kc, vc, ks, vs, torch.tensor([5, -1, 40]))
    assert ks.view(-1, HKV)[[5, 40]].float().sub(k[[0, 2]].abs().amax(-1) / 448).abs().max() < 1e-2 * k[2].abs().max() / 448
    deq = kc.view(-1, HKV, D)[40].float() * ks.view(-1, HKV)[40].float()[:, None]
    torch.testing.assert_close(deq, k[2], atol=0, rtol=2 ** -4)
    assert ks.view(-1, HKV)[6:40].abs().sum() == 0  # the padding token (-1) wrote nothing


# Sliding windows and soft-capping. Block 16; windows smaller than a block, equal, larger, and
# none. The batch mixes decodes and chunks whose contexts cross block and window boundaries.
WINDOWS = [1, 7, 16, 33, None]
WINDOWED = dict(query_lens=[1, 17, 40, 1, 5, 1], context_lens=[100, 40, 0, 47, 3, 15])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("window", WINDOWS)
def test_reference_window_softcap_against_naive(window, softcap, kv_dtype):
    batch = make_paged_batch(**WINDOWED, num_heads=4, num_kv_heads=2, head_dim=32, kv_dtype=kv_dtype,
                             q_dtype=torch.float32)
    if window is not None:
        poison_behind_window(batch, window)
    scale = 32 ** -0.5
    out = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale, batch.meta,
                              scale, window=window, softcap=softcap)
    assert_close(out, naive_attention(batch, scale, window, softcap).float(), torch.float32)


def test_reference_layers_of_two_windows_share_one_step():
    # Gemma alternates sliding and full layers over one step's metadata: each gets its own mask.
    batch = make_paged_batch(**WINDOWED, num_heads=2, num_kv_heads=1, head_dim=16, kv_dtype=torch.float32,
                             q_dtype=torch.float32)
    args = (batch.q, batch.k_cache, batch.v_cache, None, None, batch.meta, 0.25)
    for window in (8, None, 8, 20):
        assert_close(paged_attention_ref(*args, window=window), naive_attention(batch, 0.25, window).float())


def test_softcap_bounds_the_scores():
    # Huge scores: capped at +-2 the weights stay within e^4 of each other, uncapped one key wins.
    batch = make_paged_batch([1], [30], num_heads=1, num_kv_heads=1, head_dim=16, kv_dtype=torch.float32,
                             q_dtype=torch.float32)
    batch.q *= 1000
    args = (batch.q, batch.k_cache, batch.v_cache, None, None, batch.meta, 0.25)
    capped = paged_attention_ref(*args, softcap=2.0)
    assert_close(capped, naive_attention(batch, 0.25, None, 2.0).float())
    assert not torch.allclose(capped, paged_attention_ref(*args), atol=1e-2)


@pytest.mark.parametrize("window,softcap", [(0, None), (-3, None), (2.0, None), (True, None),
                                            (None, 0.0), (None, -1.0), (None, float("inf")), (None, "50")])
def test_bad_window_or_softcap_is_refused(window, softcap):
    batch = make_paged_batch([1], [4], num_heads=1, num_kv_heads=1, head_dim=16, kv_dtype=torch.float32)
    with pytest.raises(ValueError, match="window|softcap"):
        ops.paged_attention(batch.q, batch.k_cache, batch.v_cache, None, None, batch.meta, 0.25,
                            window=window, softcap=softcap)


# ridge's C kernel (the CPU path where the library builds) with windows and soft-capping.
needs_cc = pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")


def _attention_forms() -> list[int]:
    lib = native.library()
    return [1] + ([2] if lib is not None and lib.paged_attention_wide() else [])


@pytest.fixture(params=_attention_forms(), ids=lambda c: {1: "generic", 2: "avx512"}[c])
def attention_form(request):
    """The C kernel's generic form (the AVX2 and baseline clones), and its AVX-512 one (keys in
    the lanes) where this build and CPU run it: each test of the kernel runs both."""
    lib = native.library()
    if lib is None:
        yield request.param
        return
    was = lib.paged_attention_isa(request.param)
    try:
        yield request.param
    finally:
        lib.paged_attention_isa(was)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("window", [1, 7, 16, 33, None])
def test_paged_attention_cpu_window_softcap_matches_the_reference(window, softcap, dtype, attention_form):
    """Windows smaller than a block (16), equal, larger and none, over decodes, short chunks (the C
    kernel) and one past NATIVE_MAX_Q (the reference's chunk path), contexts across block and
    window boundaries; the blocks wholly behind each window hold NaN, so reading one fails."""
    batch = make_paged_batch([1, 17, NATIVE_MAX_Q + 9, 1, 5, 1], [100, 40, 30, 47, 3, 15], num_heads=6,
                             num_kv_heads=2, head_dim=32, kv_dtype=dtype, q_dtype=torch.float32)
    if window is not None:
        poison_behind_window(batch, window)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale, batch.meta, 32 ** -0.5)
    assert attention_native.fits(*args[:6], window=window, softcap=softcap)
    out = ops.paged_attention(*args, window=window, softcap=softcap)
    assert_close(out, naive_attention(batch, args[-1], window, softcap).float(), torch.float32)
    assert_close(out, paged_attention_ref(*args, window=window, softcap=softcap), torch.float32)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", [(16, 1, 128, 16), (6, 3, 80, 8), (4, 4, 256, 64),
                                                           (9, 3, 64, 16)])
def test_paged_attention_cpu_shapes_match_the_reference(heads, kv_heads, head_dim, block, dtype, attention_form):
    """A GQA group of 16 heads (the kernel's most), an odd count of 16-column chunks (80), the
    widest head (256) and block sizes under, at and over 16 keys, over decodes and short chunks
    whose contexts end anywhere in a block."""
    batch = make_paged_batch([1, 1, 7, 1, 3], [200, 31, 50, 1, 16], num_heads=heads, num_kv_heads=kv_heads,
                             head_dim=head_dim, kv_dtype=dtype, q_dtype=torch.float32, block_size=block)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale, batch.meta, head_dim ** -0.5)
    assert attention_native.fits(*args[:6])
    out = ops.paged_attention(*args)
    assert_close(out, naive_attention(batch, args[-1]).float(), torch.float32)
    assert_close(out, paged_attention_ref(*args), torch.float32)


@needs_cc
@pytest.mark.parametrize("window", [100, 600, None])
def test_paged_attention_cpu_window_on_long_decodes(window, attention_form):
    """Decodes at several windows' length with blocks of 32: the kernel starts at the window; past
    512 keys (SPLIT) a query runs as parts, from the window's start to multiples of 512, merged."""
    batch = make_paged_batch([1, 1, 1, 2], [1000, 257, 64, 1600], num_heads=4, num_kv_heads=1, head_dim=64,
                             kv_dtype=torch.bfloat16, q_dtype=torch.float32, block_size=32)
    if window is not None:
        poison_behind_window(batch, window)
    args = (batch.q, batch.k_cache, batch.v_cache, None, None, batch.meta, 0.125)
    for softcap in (None, 30.0):
        assert_close(ops.paged_attention(*args, window=window, softcap=softcap),
                     naive_attention(batch, 0.125, window, softcap).float(), torch.float32)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_a_long_querys_parts_do_not_depend_on_its_batch(dtype, attention_form):
    """A long query's split into parts depends on its keys alone: its rows are the same bits alone
    and beside other sequences (deterministic mode's batch invariance), and match the oracle."""
    lens, ctx = [1, 1, 3], [1500, 40, 700]
    batch = make_paged_batch(lens, ctx, num_heads=6, num_kv_heads=2, head_dim=64, kv_dtype=dtype,
                             q_dtype=torch.float32, block_size=16)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale)
    together = ops.paged_attention(*args, batch.meta, 0.125)
    assert_close(together, naive_attention(batch, 0.125).float(), torch.float32)
    m = batch.meta
    tables = [m.block_table[i, : -(-(c + n) // 16)].tolist() for i, (n, c) in enumerate(zip(lens, ctx))]
    row = 0
    for n, c, table in zip(lens, ctx, tables):
        alone = AttentionMetadata.build([n], [c + n], [table], [-1] * n)
        got = ops.paged_attention(batch.q[row:row + n], *args[1:], alone, 0.125)
        assert torch.equal(got, together[row:row + n])
        row += n


# Attention sinks (gpt-oss): a per-head logit in the softmax's denominator, with windows and without.
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (16, None), (33, 1.5), (None, 1.5)])
def test_reference_sinks_against_naive(window, softcap, kv_dtype):
    batch = make_paged_batch(**WINDOWED, num_heads=8, num_kv_heads=2, head_dim=32, kv_dtype=kv_dtype,
                             q_dtype=torch.float32)
    if window is not None:
        poison_behind_window(batch, window)
    sinks, scale = sink_logits(8), 32 ** -0.5
    out = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale, batch.meta,
                              scale, window=window, softcap=softcap, sinks=sinks)
    assert_close(out, naive_attention(batch, scale, window, softcap, sinks).float(), torch.float32)
    plain = naive_attention(batch, scale, window, softcap).float()
    assert not torch.allclose(out[:, 0], plain[:, 0], atol=1e-2)  # a sink above every score takes a share
    assert_close(out[:, 1], plain[:, 1], torch.float32)  # one far below takes none


@pytest.mark.parametrize("window", [None, 5])
def test_reference_sinks_match_transformers_gpt_oss(window):
    """transformers' own gpt-oss attention (eager, its sink rule and sliding mask) on one contiguous
    sequence, against the paged reference over the same keys written to the cache."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    lengths = [23]
    seqs, q_all, kc, vc, ks, vs, meta = paged_setup(lengths, lengths)
    q, k, v = seqs[0]
    sinks = sink_logits(H)
    pos = torch.arange(23)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(1, 1, 23, 23).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=H // HKV, sinks=sinks, training=False)
    expected, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], mask, D ** -0.5)
    out = paged_attention_ref(q_all, kc, vc, ks, vs, meta, D ** -0.5, window=window, sinks=sinks)
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sinks", [torch.zeros(3), torch.zeros(4, dtype=torch.int32), [0.0] * 4],
                         ids=["shape", "dtype", "list"])
def test_bad_sinks_are_refused(sinks):
    batch = make_paged_batch([1], [4], num_heads=4, num_kv_heads=2, head_dim=16, kv_dtype=torch.float32,
                             q_dtype=torch.float32)
    with pytest.raises(ValueError, match="sinks"):
        ops.paged_attention(batch.q, batch.k_cache, batch.v_cache, None, None, batch.meta, 0.25, sinks=sinks)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (7, None), (16, 1.5), (33, None), (None, 1.5)])
def test_paged_attention_cpu_sinks_match_the_reference(window, softcap, dtype, attention_form):
    """The C kernel's sinks over decodes and short chunks, and the reference's chunk path past
    NATIVE_MAX_Q, against the naive oracle; a window of 1 sees only the query's own key."""
    batch = make_paged_batch([1, 17, NATIVE_MAX_Q + 9, 1, 5, 1], [100, 40, 30, 47, 3, 15], num_heads=8,
                             num_kv_heads=2, head_dim=32, kv_dtype=dtype, q_dtype=torch.float32)
    if window is not None:
        poison_behind_window(batch, window)
    sinks = sink_logits(8)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale, batch.meta, 32 ** -0.5)
    kw = dict(window=window, softcap=softcap, sinks=sinks)
    assert attention_native.fits(*args[:6], **kw)
    out = ops.paged_attention(*args, **kw)
    assert_close(out, naive_attention(batch, args[-1], window, softcap, sinks).float(), torch.float32)
    assert_close(out, paged_attention_ref(*args, **kw), torch.float32)


@needs_cc
@pytest.mark.parametrize("window", [128, None])
def test_paged_attention_cpu_sinks_on_long_decodes(window, attention_form):
    batch = make_paged_batch([1, 1, 1], [1000, 257, 64], num_heads=4, num_kv_heads=1, head_dim=64,
                             kv_dtype=torch.bfloat16, q_dtype=torch.float32, block_size=32)
    if window is not None:
        poison_behind_window(batch, window)
    args = (batch.q, batch.k_cache, batch.v_cache, None, None, batch.meta, 0.125)
    sinks = sink_logits(4)
    assert_close(ops.paged_attention(*args, window=window, sinks=sinks),
                 naive_attention(batch, 0.125, window, None, sinks).float(), torch.float32)
