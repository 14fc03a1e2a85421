"""Paged attention through ridge's C kernel (kernels/csrc/paged_attention.c), paged_attention_ref's
contract: every query of up to NATIVE_MAX_Q tokens (decodes, speculative verification, short
chunks) reads K/V in place through the block table; longer chunks go through the reference's
per-chunk SDPA, whose blocked products are faster there (docs/benchmarks.md), except in a
batch-invariant step (AttentionMetadata.batch_invariant), where the kernel takes every query.

fits() states what the kernel takes; kernels/ops.py asks it and runs the reference elsewhere."""
from __future__ import annotations

import torch

from . import native
from .attention import _attend_chunks, _chunks, _starts, check_sinks, check_window_softcap
from .kv_cache import FP8, NATIVE_KV
from .metadata import AttentionMetadata

NATIVE_MAX_Q = 64  # longer queries run faster through SDPA's blocked products (docs/benchmarks.md)
# The kernel's fixed limits (MAXG, MAXD, BS_MAX in paged_attention.c): a GQA group, a head size
# (a multiple of 16) and a block size past them are refused there.
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 64


def fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
         v_scale: torch.Tensor | None, meta: AttentionMetadata, window: int | None = None,
         softcap: float | None = None, sinks: torch.Tensor | None = None) -> bool:
    """Whether the C kernel takes this call: the library built, fp32 queries, an fp32, bf16 or FP8
    cache (FP8 with its fp16 scales), contiguous, head shapes within its limits, sinks (if any)
    contiguous fp32. Any window and softcap: the kernel takes both (paged_attention_native checks
    their values)."""
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if sinks is not None and not (isinstance(sinks, torch.Tensor) and sinks.dtype == torch.float32
                                  and sinks.is_contiguous()):
        return False
    if (native.library() is None or q.dtype != torch.float32 or NATIVE_KV.get(k_cache.dtype) is None
            or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or meta.num_seqs >= 1 << 20):
        return False
    if k_cache.dtype == FP8 and (k_scale is None or v_scale is None
                                 or not k_scale.dtype == v_scale.dtype == torch.float16):
        return False
    return (kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and head_dim % 16 == 0
            and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK_SIZE and k_cache.shape[-1] == head_dim)


class _NativePlan:
    """What the C kernel's caller needs about one step's batch, once per step (every layer shares
    the metadata): the queries too long for the kernel, its scratch, the metadata's pointers."""

    def __init__(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor):
        starts = _starts(meta.query_lens_host)
        self.meta, self.starts, self.block_size, self.device = meta, starts, k_cache.shape[1], q.device
        self._chunks: dict = {}  # window -> the long queries' chunks (sliding and full layers share a step)
        table, seq_lens, loc = meta.block_table, meta.seq_lens, meta.query_start_loc
        assert table.dtype == seq_lens.dtype == loc.dtype == torch.int32 and table.is_contiguous(), "int32 metadata"
        assert q.shape[0] == starts[-1], (q.shape, starts[-1])
        self.work = torch.empty(q.shape[0] * k_cache.shape[2], dtype=torch.int64)
        self.batch = (table.data_ptr(), table.stride(0), seq_lens.data_ptr(), loc.data_ptr(), meta.num_seqs,
                      k_cache.shape[1])
        self.tail = (self.work.data_ptr(), torch.get_num_threads())
        # Bidirectional runs (meta.spans): each query's key end, which the kernel reads in place of p + 1.
        self.key_ends = meta.key_ends()
        self.key_end = None if self.key_ends is None else self.key_ends.data_ptr()
        # Batch-invariant: every query through the kernel, whose per-row arithmetic is the same at
        # any chunk length; SDPA's blocked products round a row by the chunk it is in.
        self.max_q = 2 ** 31 - 1 if meta.batch_invariant else NATIVE_MAX_Q

    def chunks(self, window: int | None) -> list[tuple]:
        got = self._chunks.get(window)
        if got is None:
            got = self._chunks[window] = [] if self.meta.batch_invariant else \
                _chunks(self.meta, self.meta.block_table, self.starts, self.block_size, NATIVE_MAX_Q, self.device,
                        window)
        return got


def paged_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                           meta: AttentionMetadata, softmax_scale: float, window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention_ref's contract, for a call that fits()."""
    check_window_softcap(window, softcap)
    check_sinks(sinks, q)
    num_tokens, num_heads, head_dim = q.shape
    fp8 = k_cache.dtype == FP8
    plan = meta.state_for(_NativePlan, (k_cache.shape[1], k_cache.shape[2], num_tokens), q, k_cache)
    q = q.contiguous()
    out = torch.empty_like(q)
    rc = native.library().paged_attention(
        q.data_ptr(), num_tokens, num_heads, k_cache.shape[2], head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
        k_scale.data_ptr() if fp8 else None, v_scale.data_ptr() if fp8 else None, NATIVE_KV[k_cache.dtype],
        *plan.batch, softmax_scale, 0 if window is None else min(window, 2 ** 31 - 1), softcap or 0.0,
        None if sinks is None else sinks.data_ptr(), plan.key_end, plan.max_q, out.data_ptr(), *plan.tail)
    if rc != 0:
        raise RuntimeError(f"paged_attention: shapes past the C kernel's limits ({q.shape}, {k_cache.shape}); "
                           "fits() should have refused them")
    chunks = plan.chunks(window)
    if chunks:
        _attend_chunks(q, k_cache, v_cache, k_scale, v_scale, chunks, softmax_scale, out, softcap, sinks)
    return out
