"""Bidirectional runs in paged attention (AttentionMetadata.spans: Gemma 3's image tokens see each
other both ways): the torch reference, ridge's C kernel and the Triton kernel (interpreter)
against a float64 oracle written from transformers' rule: a key is visible if inside the window
AND (causal OR in the query's run)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_utils import assert_close, make_paged_batch, poison_behind_window

from ridge.kernels import attention_native, ops
from ridge.kernels.attention import paged_attention_ref
from ridge.kernels.attention_native import paged_attention_native
from ridge.kernels.metadata import AttentionMetadata

# Mixed steps: decodes, chunks against earlier context, runs at a chunk's start, middle and end,
# two runs in one chunk, a one-token run, and a chunk longer than the C kernel's NATIVE_MAX_Q
# (its long queries go through the reference's chunks).
QUERY_LENS = [1, 17, 40, 1, 90, 6]
CONTEXT_LENS = [30, 40, 3, 70, 0, 11]
SPANS = [(), ((45, 52),), ((3, 10), (20, 33), (42, 43)), (), ((5, 85),), ((11, 17),)]


def spanned(batch):
    meta = batch.meta
    return dataclasses.replace(batch, meta=dataclasses.replace(meta, spans=tuple(SPANS), states={}))


def naive(batch, scale: float, window: int | None, softcap: float | None = None) -> torch.Tensor:
    q, meta = batch.q, batch.meta
    bs, hkv = batch.k_cache.shape[1], batch.k_cache.shape[2]
    group = q.shape[1] // hkv
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i, (n, L) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        for p in range(L - n, L):
            run = next(((a, b) for a, b in meta.spans[i] if a <= p < b), None)
            keys = [j for j in range(L) if (window is None or j > p - window)
                    and (j <= p or (run is not None and run[0] <= j < run[1]))]
            keys = torch.tensor(keys)
            blocks, offsets = meta.block_table[i, keys // bs].long(), keys % bs
            k = batch.k_cache[blocks, offsets].double().repeat_interleave(group, dim=1)
            v = batch.v_cache[blocks, offsets].double().repeat_interleave(group, dim=1)
            s = torch.einsum("hd,khd->hk", q[row].double(), k) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[row] = torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), v)
            row += 1
    return out


def batch_of(kv_dtype=torch.float32, head_dim: int = 32, heads: int = 4, kv_heads: int = 2):
    return spanned(make_paged_batch(QUERY_LENS, CONTEXT_LENS, num_heads=heads, num_kv_heads=kv_heads,
                                    head_dim=head_dim, kv_dtype=kv_dtype, q_dtype=torch.float32, block_size=8))


def test_key_ends():
    meta = AttentionMetadata.build([4, 3], [6, 3], [[0], [1]], [-1] * 7, spans=[((3, 5),), ((0, 3),)])
    assert meta.key_ends_host() == [3, 5, 5, 6, 3, 3, 3]
    assert meta.key_ends().tolist() == [3, 5, 5, 6, 3, 3, 3]
    with pytest.raises(AssertionError, match="outside its step's queries"):
        AttentionMetadata.build([2], [6], [[0]], [-1] * 2, spans=[((3, 5),)]).key_ends_host()


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (13, 1.5)])
def test_reference_against_naive(window, softcap):
    b = batch_of()
    if window is not None:
        poison_behind_window(b, window)
    got = paged_attention_ref(b.q, b.k_cache, b.v_cache, None, None, b.meta, 0.2, window=window, softcap=softcap)
    assert_close(got, naive(b, 0.2, window, softcap).float(), torch.float32)


@pytest.mark.parametrize("window,softcap,kv_dtype", [(None, None, torch.float32), (6, None, torch.float32),
                                                     (13, 1.5, torch.bfloat16)])
def test_native_kernel_against_the_reference(window, softcap, kv_dtype):
    b = batch_of(kv_dtype)
    args = (b.q, b.k_cache, b.v_cache, None, None, b.meta, 0.2)
    assert attention_native.fits(*args[:6], window=window, softcap=softcap), "the C kernel is built here"
    if window is not None:
        poison_behind_window(b, window)
    want = paged_attention_ref(*args, window=window, softcap=softcap)
    assert_close(paged_attention_native(*args, window=window, softcap=softcap), want, torch.float32)
    got = paged_attention_native(*args, window=window, softcap=softcap)
    assert_close(got, want, torch.float32)
    # against a causal step through the same kernel: exactly the rows that see later keys differ
    causal = dataclasses.replace(b.meta, spans=None, states={})
    plain = paged_attention_native(b.q, b.k_cache, b.v_cache, None, None, causal, 0.2, window=window,
                                   softcap=softcap)
    positions = [p for n, L in zip(QUERY_LENS, b.meta.seq_lens_host) for p in range(L - n, L)]
    later = torch.tensor(b.meta.key_ends_host()) > torch.tensor(positions) + 1
    assert torch.equal(plain[~later], got[~later])
    assert (plain[later] - got[later]).abs().amax(dim=(1, 2)).min() > 1e-4


def test_ops_routes_spans_on_cpu():
    b = batch_of()
    got = ops.paged_attention(b.q, b.k_cache, b.v_cache, None, None, b.meta, 0.2, window=9)
    assert_close(got, naive(b, 0.2, 9).float(), torch.float32)


@pytest.mark.parametrize("window,softcap,kv_dtype,splits", [(None, None, torch.float32, None),
                                                            (6, 1.5, torch.float32, None),
                                                            (13, None, torch.bfloat16, 2)])
def test_triton_kernel_against_the_reference(window, softcap, kv_dtype, splits):
    """Under the interpreter (tests/conftest.py): odd query lengths, runs across its query tiles,
    a split context merged."""
    from ridge.kernels.attention import paged_attention_triton

    b = batch_of(kv_dtype, head_dim=48, heads=6, kv_heads=2)
    if window is not None:
        poison_behind_window(b, window)
    args = (b.q, b.k_cache, b.v_cache, None, None, b.meta, 0.2)
    want = paged_attention_ref(*args, window=window, softcap=softcap)
    got = paged_attention_triton(*args, window=window, softcap=softcap, num_splits=splits)
    assert_close(got, want, torch.float32)
