"""Shared pieces of the kernel tests: paged caches filled through the reference
writer, block tables at high block ids, NaN poisoning and per-dtype tolerances."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from ridge.kernels.kv_cache import FP8, write_kv_ref
from ridge.kernels.metadata import AttentionMetadata

# Tolerances for comparing a kernel with its reference, per output dtype. bf16 allows
# two ulps: the interpreter truncates fp32 -> bf16 stores instead of rounding.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

# Just past 2**31 elements for tiny heads (16 tokens x 1 head x 64 dims per block):
# offsets computed in int32 wrap around. torch.empty leaves the pages unallocated,
# so only the blocks a test touches cost memory.
HUGE_NUM_BLOCKS = (1 << 31) // (16 * 64) + 4096


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) so that an element a kernel forgets to write shows."""
    if t.dtype.is_floating_point and t.dtype != FP8:
        t.fill_(float("nan"))
    return t


@pytest.fixture
def poison_empty(monkeypatch):
    """Every float torch.empty / empty_like during the test comes back NaN-filled (cheap
    sizes only), so an output element a kernel never writes surfaces as NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return poison(t) if t.numel() < (1 << 26) else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, **kw) -> None:
    tol = dict(TOL[dtype or expected.dtype])
    tol.update(kw)
    assert not actual.isnan().any(), "NaN in the output: an element was not written"
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    meta: AttentionMetadata


def make_paged_batch(query_lens: list[int], context_lens: list[int], *, num_heads: int, num_kv_heads: int,
                     head_dim: int, kv_dtype: torch.dtype, q_dtype: torch.dtype = torch.bfloat16,
                     block_size: int = 16, num_blocks: int | None = None, seed: int = 0) -> PagedBatch:
    """Sequences whose whole context (earlier tokens and this step's) is already in
    the cache, written by write_kv_ref at random blocks among the highest ids."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    needed = sum(math.ceil(L / block_size) for L in seq_lens)
    num_blocks = num_blocks or needed + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.empty(shape, dtype=kv_dtype), torch.empty(shape, dtype=kv_dtype)
    fp8 = kv_dtype == FP8
    # The reference reads whole blocks: unowned slots must hold finite values.
    k_scale = torch.ones(shape[:3], dtype=torch.float16) if fp8 else None
    v_scale = torch.ones(shape[:3], dtype=torch.float16) if fp8 else None
    if num_blocks * block_size * num_kv_heads * head_dim < (1 << 24):
        # Large values in slots no sequence owns: a key read past seq_len shows.
        for t in (k_cache, v_cache):
            t.copy_(torch.full(shape, 100.0).to(kv_dtype))
    free = (num_blocks - 1 - torch.randperm(needed + 7, generator=g)).tolist()
    tables = []
    for L in seq_lens:
        blocks = [free.pop() for _ in range(math.ceil(L / block_size))]
        tables.append(blocks)
        pos = torch.arange(L)
        kv_slots = torch.tensor(blocks, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        k = torch.randn(L, num_kv_heads, head_dim, generator=g).to(q_dtype)
        v = torch.randn(L, num_kv_heads, head_dim, generator=g).to(q_dtype)
        write_kv_ref(k, v, k_cache, v_cache, k_scale, v_scale, kv_slots)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(q_dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, [-1] * num_tokens)
    return PagedBatch(q, k_cache, v_cache, k_scale, v_scale, meta)


def poison_behind_window(batch: PagedBatch, window: int) -> None:
    """NaN into every cached block wholly behind the window of its sequence's first query (what
    a freed block may hold once reused): an attention that reads one returns NaN. FP8 caches get
    NaN scales, which any dequantization carries."""
    bs = batch.k_cache.shape[1]
    meta = batch.meta
    for i, (n, L) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        behind = meta.block_table[i, :max(0, L - n - window + 1) // bs].long()
        for cache, scale in ((batch.k_cache, batch.k_scale), (batch.v_cache, batch.v_scale)):
            if scale is not None:
                scale[behind] = float("nan")
            else:
                cache[behind] = float("nan")


def naive_attention(batch: PagedBatch, softmax_scale: float, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of every paged attention: one query at a time, in float64, over the keys its
    position sees (transformers' rule: p - window < j <= p), each read through the block table.
    sinks [H]: transformers' gpt-oss rule, each head's sink a last logit in the softmax, then dropped."""
    q, meta = batch.q, batch.meta
    bs, hkv = batch.k_cache.shape[1], batch.k_cache.shape[2]
    group = q.shape[1] // hkv

    def read(cache, scale, blocks, offsets):  # -> [keys, H, D], each KV head repeated for its group
        x = cache[blocks, offsets].double()
        if scale is not None:
            x = x * scale[blocks, offsets].double()[..., None]
        return x.repeat_interleave(group, dim=1)

    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i, (n, L) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        for p in range(L - n, L):
            keys = torch.arange(0 if window is None else max(0, p - window + 1), p + 1)
            blocks, offsets = meta.block_table[i, keys // bs].long(), keys % bs
            k, v = read(batch.k_cache, batch.k_scale, blocks, offsets), read(batch.v_cache, batch.v_scale, blocks, offsets)
            s = torch.einsum("hd,khd->hk", q[row].double(), k) * softmax_scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if sinks is not None:
                p = torch.softmax(torch.cat([s, sinks.double()[:, None]], dim=-1), dim=-1)[:, :-1]
            else:
                p = torch.softmax(s, dim=-1)
            out[row] = torch.einsum("hk,khd->hd", p, v)
            row += 1
    return out


def sink_logits(num_heads: int) -> torch.Tensor:
    """gpt-oss-like sinks [H] fp32 that exercise every case: one above every score (the softmax's
    max moves to it), one far below (no share), the rest about the scores' size."""
    base = torch.tensor([6.0, -30.0, 0.5, -1.5, 2.0, 0.0, 1.0, -0.5])
    return base.repeat(math.ceil(num_heads / len(base)))[:num_heads].contiguous()
