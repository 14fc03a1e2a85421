"""Paged attention over a mixed batch (prefill chunks and decodes in one call).

Reference implementation in torch. It is the oracle for the Triton kernel and
ridge's C kernel (kernels/csrc/paged_attention.c), and the CPU path where that
kernel is unavailable, so it is written for CPU speed: every single-token query
(a decode) is handled in one batched call, and each multi-token query (a
prefill chunk) in one call of its own, O(batch) Python.

On CPU, kernels/ops.py takes ridge's C kernel (kernels/attention_native.py)
wherever the step's shapes fit it, and this reference otherwise.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kv_cache import FP8
from .metadata import AttentionMetadata


def check_window_softcap(window: int | None, softcap: float | None) -> None:
    """The arguments every backend takes: a sliding window of at least one key (the query's own),
    a soft-cap that is a positive finite number. Refused loudly, never run approximately."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"paged_attention: window must be an int >= 1 or None, got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"paged_attention: softcap must be a positive finite number or None, got {softcap!r}")


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Attention sinks (gpt-oss): None, or one float logit per query head on q's device."""
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point
                              or sinks.shape != (q.shape[1],) or sinks.device != q.device):
        raise ValueError(f"paged_attention: sinks must be a float tensor of shape ({q.shape[1]},) on {q.device} "
                         f"or None, got {sinks if not isinstance(sinks, torch.Tensor) else (sinks.shape, sinks.dtype)}")


def _first_key(pos: int, window: int | None) -> int:
    """The first key a query at position `pos` sees: transformers' sliding window keeps keys j
    with pos - window < j <= pos."""
    return 0 if window is None else max(0, pos - window + 1)


def _attend(q, k, v, mask, scale, softcap=None, sinks=None):
    # q: [B, H, Tq, D]; k, v: [B, Hkv, L, D]; mask: [B, 1, Tq, L] bool (True = attend); sinks: [H]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    # SDPA can neither cap the scores nor add a sink: they are formed here, in fp32 (Gemma 2's
    # s = c * tanh(s / c), on the scaled scores, before the mask). Head h reads KV head h // group,
    # as enable_gqa does.
    b, h, tq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(b, hkv, h // hkv, tq, d)
    s = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, G, Tq, L]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:  # gpt-oss: the sink joins the softmax as one more logit (its max included) that carries no value
        z = sinks.float().view(1, hkv, h // hkv, 1, 1).expand(b, -1, -1, tq, 1)
        p = torch.softmax(torch.cat([s, z], dim=-1), dim=-1)[..., :-1]
    o = torch.matmul(p, v.float().unsqueeze(2))  # [B, Hkv, G, Tq, D]
    return o.view(b, h, tq, d).to(q.dtype)


class _RefPlan:
    """What the reference needs about one step's batch, built once per step (every layer
    shares the metadata): 30 layers rebuilding index and mask tensors cost more than the
    attention arithmetic itself at decode on CPU. The window-dependent parts are built once per
    window the step's layers use (Gemma alternates sliding and full layers)."""

    def __init__(self, meta: AttentionMetadata, block_size: int, device: torch.device):
        self.meta, self.block_size, self.device = meta, block_size, device
        qlens = meta.query_lens_host
        self.starts = _starts(qlens)
        self.decodes = [i for i, n in enumerate(qlens) if n == 1]
        self.table = meta.block_table.to(device)
        self.all_decode = len(self.decodes) == len(qlens)
        self.decode_rows = None if self.all_decode else torch.tensor([self.starts[i] for i in self.decodes],
                                                                      device=device)
        self._windows: dict = {}

    def for_window(self, window: int | None) -> tuple:
        """(decode, chunks) for this window: the decodes' gather and mask, one batched call;
        multi-token queries (prefill chunks, speculative verification), one call each."""
        got = self._windows.get(window)
        if got is None:
            got = self._windows[window] = (self._decode(window),
                                           _chunks(self.meta, self.table, self.starts, self.block_size, 1,
                                                   self.device, window))
        return got

    def _decode(self, window: int | None):
        """Each decode reads its own blocks from the first one inside its window: rows shorter than
        the widest repeat their last block (masked), so no row reads a block behind its window or
        past its context (such table entries may point at a freed or reused block)."""
        if not self.decodes:
            return None
        bs, device = self.block_size, self.device
        lens = [self.meta.seq_lens_host[i] for i in self.decodes]
        first = torch.tensor([_first_key(L - 1, window) // bs for L in lens], device=device)
        last = torch.tensor([(L - 1) // bs for L in lens], device=device)
        nb = int((last - first).max()) + 1
        cols = first[:, None] + torch.arange(nb, device=device)  # [Bd, nb]
        table = self.table if self.all_decode else self.table[torch.tensor(self.decodes, device=device)]
        blocks = table.gather(1, torch.minimum(cols, last[:, None])).long().reshape(-1)  # [Bd * nb]
        pos = (cols[:, :, None] * bs + torch.arange(bs, device=device)).reshape(len(lens), -1)  # [Bd, nb * bs]
        end = torch.tensor(lens, device=device)[:, None]
        mask = pos < end
        if window is not None:
            mask &= pos >= end - window
        return len(lens), nb * bs, blocks, mask[:, None, None, :]


def _starts(query_lens: list[int]) -> list[int]:
    """Each query's first row in the flattened batch, and the total (query_start_loc, on the host)."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


def _chunks(meta: AttentionMetadata, table: torch.Tensor, starts: list[int], block_size: int,
            longer_than: int, device: torch.device, window: int | None = None) -> list[tuple]:
    """(start, n, keys, blocks, mask) of each query longer than `longer_than` tokens: its blocks
    from the first inside the window of its first token (`keys` keys from that block's start),
    and the causal, windowed mask over them; a query inside a bidirectional run (meta.spans)
    also sees the run's later keys."""
    out = []
    ends = meta.key_ends_host()
    for i, n in enumerate(meta.query_lens_host):
        if n > longer_than:
            L = meta.seq_lens_host[i]
            first = _first_key(L - n, window) // block_size
            blocks = table[i, first:math.ceil(L / block_size)].long()
            q_pos = torch.arange(L - n, L, device=device)[:, None]
            k_pos = torch.arange(first * block_size, L, device=device)[None, :]
            if ends is not None and meta.spans[i]:  # causal OR the same run: keys before the query's run end
                mask = k_pos < torch.tensor(ends[starts[i]:starts[i] + n], device=device)[:, None]
            else:
                mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            out.append((starts[i], n, L - first * block_size, blocks, mask[None, None]))
    return out


def _attend_chunks(q, k_cache, v_cache, k_scale, v_scale, chunks, softmax_scale, out, softcap=None,
                   sinks=None) -> None:
    for start, n, keys, blocks, mask in chunks:
        k = _gather(k_cache, k_scale, blocks, q.dtype, 1, keys)  # [1, Hkv, keys, D]
        v = _gather(v_cache, v_scale, blocks, q.dtype, 1, keys)
        qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        out[start:start + n] = _attend(qi, k, v, mask, softmax_scale, softcap, sinks)[0].transpose(0, 1)


def _gather(cache, scale, blocks, dtype, rows: int, length: int):
    """blocks [rows * nb] -> [rows, Hkv, length, D] in `dtype`, FP8 dequantized."""
    hkv, d = cache.shape[2], cache.shape[3]
    x = cache.index_select(0, blocks).view(rows, -1, hkv, d)[:, :length]
    if scale is not None and cache.dtype == FP8:
        s = scale.index_select(0, blocks).view(rows, -1, hkv)[:, :length]
        x = x.to(dtype) * s.to(dtype).unsqueeze(-1)
    else:
        x = x.to(dtype)
    return x.transpose(1, 2)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                        meta: AttentionMetadata, softmax_scale: float, window: int | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] -> out [T, H, D]. Query token j of a sequence with q_len n and
    context length L sits at position p = L - n + j and sees keys 0 .. p, or with a sliding
    window keys p - window < key <= p; inside a bidirectional run [a, b) of meta.spans, keys up
    to b - 1 instead of p (still after p - window). softcap: scores s (scaled) become softcap * tanh(s / softcap)
    before the mask (Gemma 2). sinks [H]: head h's softmax is over its scores and sinks[h], whose
    share goes to no value (gpt-oss): out = sum_j e^s_j v_j / (sum_j e^s_j + e^sinks[h]).
    All single-token queries (decodes) go through one batched call."""
    check_window_softcap(window, softcap)
    check_sinks(sinks, q)
    num_tokens, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    assert k_cache.shape[-1] == head_dim and num_heads % k_cache.shape[2] == 0
    assert num_tokens == sum(meta.query_lens_host)
    plan = meta.state_for(_RefPlan, block_size, block_size, q.device)
    decode, chunks = plan.for_window(window)
    if decode is not None:
        rows, length, blocks, mask = decode
        k = _gather(k_cache, k_scale, blocks, q.dtype, rows, length)  # [Bd, Hkv, L, D]
        v = _gather(v_cache, v_scale, blocks, q.dtype, rows, length)
        qd = q if plan.all_decode else q[plan.decode_rows]
        o = _attend(qd.unsqueeze(2), k, v, mask, softmax_scale, softcap, sinks).squeeze(2)  # [Bd, H, D]
        if plan.all_decode:
            return o
    out = torch.empty_like(q)
    if decode is not None:
        out[plan.decode_rows] = o
    _attend_chunks(q, k_cache, v_cache, k_scale, v_scale, chunks, softmax_scale, out, softcap, sinks)
    return out


# ---------------------------------------------------------------------------
# Triton: one varlen launch over the whole mixed batch.
#
# Grid (q_block, kv_head, split). A program owns BLOCK_Q query tokens of one
# sequence times all GROUP query heads that share one KV head, so K/V are read
# once per group (GQA without repetition). Rows of the [BLOCK_M, D] Q tile are
# (token, head) pairs: row m = token m // GROUP, head m % GROUP. K/V tiles are
# gathered through the block table with int64 offsets and FP8 dequantized in
# registers: the K scale multiplies the scores, the V scale the probabilities,
# so the dots run on raw fp8 values cast to the dot dtype. With num_splits > 1
# each program covers a slice of the context (flash-decoding) and a second
# kernel merges the partial softmaxes. With a sliding window a program's KV loop
# starts at the tile holding its first query's first key and loads nothing
# before that key: a block wholly behind the window is never read (it may have
# been freed and reused). Attention sinks enter once, after the last tile (or in
# the merge), as one more key of score sinks[h] and value 0. Bidirectional runs
# (meta.spans) give each query its own key end (meta.key_ends()) in place of its
# position + 1; a program's KV loop runs to the largest of its queries'.

from .triton_utils import (capability, cdiv, interpreting, jit, native_fp8, next_pow2, num_sms,  # noqa: E402
                           pick_config, tl)

LOG2E = 1.4426950408889634


@jit
def _e4m3_bits_to_f32(bits):
    # float8_e4m3fn from raw uint8 for GPUs without hardware e4m3 (pre-sm_89):
    # normal: (1 + m/8) * 2^(e-7) is exactly fp32 bits sign | (e + 120) << 23 | m << 20;
    # subnormal (e == 0): m * 2^-9. NaN (0x7f) is never written by the quantizer.
    b = bits.to(tl.uint32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    sign = (b & 0x80) << 24
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    return tl.where(e == 0, tl.where(sign != 0, -sub, sub), normal)


@jit
def _load_f32(ptr, mask, FP8_MODE: tl.constexpr):
    # FP8_MODE 0: any float dtype; 1: float8e4nv; 2: uint8 bits of e4m3fn.
    # Masked lanes become 0 after the cast (a NaN there would survive p = 0 in the PV dot).
    x = tl.load(ptr, mask=mask)
    if FP8_MODE == 2:
        y = _e4m3_bits_to_f32(x)
    else:
        y = x.to(tl.float32)
    return tl.where(mask, y, 0.0)


@jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): saturates to +-1 at both ends (e^2x -> inf or 0) without a NaN.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@jit
def _find_seq(query_start_loc, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    # Sequence i owns q blocks starting at query_start_loc[i] // BLOCK_Q + i: a
    # binary search over device data, so no host list decides correctness.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@jit
def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, sinks_ptr, out_ptr, part_acc, part_m, part_l,
        block_table, seq_lens, query_start_loc, key_end_ptr, num_seqs, num_tokens, num_splits, qk_scale, window,
        softcap,
        stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SPLIT: tl.constexpr, FP8_MODE: tl.constexpr, DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr,
        SINKS: tl.constexpr, SPANS: tl.constexpr):
    # window: keys p - window < j <= p (the host passes a bound past any context for none);
    # SPANS: a query inside a bidirectional run sees keys up to key_end_ptr[token] - 1 instead of p
    # (AttentionMetadata.key_ends), still after p - window;
    # softcap: Gemma 2's cap times log2(e), as the scores here are in log2 units. SINKS: a
    # per-head logit joins the denominator (after the merge where the context is split).
    q_block, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = _find_seq(query_start_loc, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # tokens before this chunk; query j sits at position context + j

    m_rows = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + m_rows // GROUP
    head = kv_head * GROUP + m_rows % GROUP
    row_ok = (m_rows // GROUP < BLOCK_Q) & (tok < q_len)
    q_pos = context + tok
    d = tl.arange(0, DIM_P)
    d_ok = d < HEAD_DIM
    q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    dot_ty = tl.float32 if DOT_F32 else q_ptr.dtype.element_ty
    q = q.to(dot_ty)

    if SPANS:
        k_lim = tl.load(key_end_ptr + q_start + tok, mask=row_ok, other=0)
        key_hi = tl.max(tl.where(row_ok, k_lim, 0), axis=0)
    else:
        k_lim = q_pos + 1
        key_hi = context + tl.minimum(q_len, (local + 1) * BLOCK_Q)
    kv_start, kv_end, t_lo, t_hi = _key_tiles(seq_len, key_hi, context, local, window, num_splits, split,
                                              BLOCK_Q, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P], tl.float32)
    table_row = block_table + seq.to(tl.int64) * stride_bt
    for tile in range(t_lo, t_hi):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = (n < kv_end) & (n >= kv_start)
        block = tl.load(table_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + n % BLOCK_SIZE  # [N] int64: no 32-bit overflow on big caches
        kv_off = block * stride_cb + (n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _load_f32(k_ptr + kv_off[:, None] + d[None, :], kv_mask, FP8_MODE)  # [N, D]
        s = tl.dot(q, tl.trans(k.to(dot_ty)))  # [M, N] fp32
        if FP8_MODE != 0:
            s = s * tl.load(ks_ptr + slot * NUM_KV_HEADS + kv_head, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        s = s * qk_scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        sees = (n[None, :] < k_lim[:, None]) & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(n_ok[None, :] & sees, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split may see no key for a row
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_f32(v_ptr + kv_off[:, None] + d[None, :], kv_mask, FP8_MODE)
        if FP8_MODE != 0:
            p = p * tl.load(vs_ptr + slot * NUM_KV_HEADS + kv_head, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v.to(dot_ty))
        m_i = m_new

    row = (q_start + tok).to(tl.int64) * (NUM_KV_HEADS * GROUP) + head  # (token, head) in [T, H]
    _store_rows(acc, m_i, l_i, row, head, row_ok, d, d_ok, sinks_ptr, out_ptr, part_acc, part_m, part_l,
                num_splits, split, HEAD_DIM, SPLIT, SINKS)


@jit
def _key_tiles(seq_len, key_hi, context, local, window, num_splits, split,
               BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """-> (kv_start, kv_end, first tile, end tile) of this program's split. key_hi: past the last
    key any of its queries sees (causal: its last query's position + 1; further in a run); with a
    window its first query sees none before kv_start."""
    kv_end = tl.minimum(seq_len, key_hi)
    kv_start = tl.maximum(context + local * BLOCK_Q - window + 1, 0)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    first_tile = kv_start // BLOCK_N
    per_split = tl.cdiv(num_tiles - first_tile, num_splits)
    t_lo = first_tile + split * per_split
    return kv_start, kv_end, t_lo, tl.minimum(t_lo + per_split, num_tiles)


@jit
def _store_rows(acc, m_i, l_i, row, head, row_ok, d, d_ok, sinks_ptr, out_ptr, part_acc, part_m, part_l,
                num_splits, split, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, SINKS: tl.constexpr):
    """The output rows, or with the context split this split's partial sums for the merge."""
    out_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        if SINKS:
            acc, l_i = _add_sink(acc, m_i, l_i, sinks_ptr, head, row_ok)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows past a window see no key
        tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = row * num_splits + split
        tl.store(part_acc + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(part_m + part, m_i, mask=row_ok)
        tl.store(part_l + part, l_i, mask=row_ok)


@jit
def _add_sink(acc, m, l, sinks_ptr, head, ok):
    # The sink as one more key of score z (log2 units) and value 0: the max moves to max(m, z),
    # the denominator gains 2^(z - max). No key seen (m = -inf) leaves acc = 0.
    z = tl.load(sinks_ptr + head, mask=ok, other=0.0).to(tl.float32) * 1.4426950408889634
    top = tl.maximum(m, z)
    alpha = tl.exp2(m - top)
    return acc * alpha[:, None], l * alpha + tl.exp2(z - top)


@jit
def _merge_splits_kernel(part_acc, part_m, part_l, out_ptr, sinks_ptr, num_splits, num_heads,
                         HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, SPLITS_P: tl.constexpr, SINKS: tl.constexpr):
    # One (token, head) row: out = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s [+ 2^(z - M)]),
    # M the largest m_s (and sink z).
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS_P)
    s_ok = s < num_splits
    d = tl.arange(0, DIM_P)
    m = tl.load(part_m + row * num_splits + s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l + row * num_splits + s, mask=s_ok, other=0.0)
    big = tl.max(m, axis=0)
    if SINKS:
        z = tl.load(sinks_ptr + row % num_heads).to(tl.float32) * 1.4426950408889634
        big = tl.maximum(big, z)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - big))
    acc = tl.load(part_acc + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    denom = tl.sum(l * w, axis=0)
    if SINKS:
        denom += tl.exp2(z - big)
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _attn_candidates(t: torch.Tensor, decode: bool, head_dim: int, group: int) -> list[dict]:
    """Tile candidates. Decode: the fewest rows a dot allows (16), long K tiles.
    Prefill: square-ish tiles; smaller at head_dim 256, and off Hopper (less shared memory)."""
    rows = max(16, next_pow2(group))
    if interpreting(t):  # few large tiles: each interpreted loop step costs milliseconds
        return [dict(BLOCK_M=max(rows, 64 if not decode else rows), BLOCK_N=128, num_warps=4, num_stages=1)]
    small = head_dim > 128 or capability(t) < (9, 0)
    if decode:
        ns = (32, 64) if head_dim > 128 else (64, 128)
        return [dict(BLOCK_M=rows, BLOCK_N=n, num_warps=w, num_stages=s) for n in ns for w in (4, 8) for s in (2, 3)]
    ms = (64,) if small else (64, 128)
    return [dict(BLOCK_M=max(rows, m), BLOCK_N=n, num_warps=w, num_stages=2)
            for m in ms for n in ((32, 64) if small else (64,)) for w in (4, 8)]


def _num_splits(q: torch.Tensor, programs: int, max_seq_len: int) -> int:
    # Flash-decoding: split the context when the grid would leave SMs idle, keeping
    # at least 512 keys per split so the merge stays cheap.
    target = 2 * num_sms(q)
    if interpreting(q) or programs >= target or max_seq_len < 1024:
        return 1
    return max(1, min(cdiv(target, programs), max_seq_len // 512, 32))


def _check_inputs(q, k_cache, v_cache, k_scale, v_scale, meta, sinks):
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(-1) == 1 and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    assert k_cache.shape[-1] == head_dim and num_heads % num_kv_heads == 0, (q.shape, k_cache.shape)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k_cache.dtype == v_cache.dtype and block_size & (block_size - 1) == 0, "block_size: a power of 2"
    if k_cache.dtype == torch.float8_e4m3fn:
        assert k_scale is not None and v_scale is not None, "an FP8 cache needs its scales"
        for s in (k_scale, v_scale):
            assert s.shape == k_cache.shape[:3] and s.dtype == torch.float16 and s.is_contiguous()
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    assert meta.block_table.dtype == torch.int32 and meta.block_table.stride(-1) == 1
    assert meta.query_start_loc.shape == (meta.seq_lens.shape[0] + 1,)
    assert sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()), "sinks: contiguous fp32"
    for t in (k_cache, meta.block_table, meta.seq_lens, meta.query_start_loc):
        assert t.device == q.device, "all attention inputs on one device"


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                           meta: AttentionMetadata, softmax_scale: float, window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None, *,
                           num_splits: int | None = None) -> torch.Tensor:
    """Same contract as paged_attention_ref. Host lists (max query/seq length) only size
    the grid; lengths, offsets and blocks are read on the device. num_splits overrides
    the flash-decoding heuristic (tests)."""
    check_window_softcap(window, softcap)
    check_sinks(sinks, q)
    _check_inputs(q, k_cache, v_cache, k_scale, v_scale, meta, sinks)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = meta.seq_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    fp8_mode = 0 if not fp8 else (1 if native_fp8(q) else 2)
    kc, vc = (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if fp8_mode == 2 else (k_cache, v_cache)
    ks, vs = (k_scale, v_scale) if fp8 else (q, q)  # unused pointers still need a tensor
    sk = q if sinks is None else sinks
    decode = meta.max_query_len <= 1
    key_ends = meta.key_ends()  # bidirectional runs (meta.spans), or None: causal
    cands = _attn_candidates(q, decode, head_dim, group)
    # The keys one query reads: its window at most, plus the chunk's other queries.
    keys = meta.max_seq_len if window is None else min(meta.max_seq_len, window + meta.max_query_len)
    splits = num_splits or _num_splits(q, (num_tokens // max(1, cands[0]["BLOCK_M"] // group) + num_seqs)
                                       * num_kv_heads, keys)
    parts = [torch.empty(n, dtype=torch.float32, device=q.device)
             for n in (num_tokens * num_heads * splits * head_dim, num_tokens * num_heads * splits,
                       num_tokens * num_heads * splits)] if splits > 1 else [out, out, out]

    def launch(cfg: dict) -> None:
        block_q = cfg["BLOCK_M"] // group
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
        _paged_attn_kernel[grid](
            q, kc, vc, ks, vs, sk, out, *parts, meta.block_table, meta.seq_lens, meta.query_start_loc,
            meta.seq_lens if key_ends is None else key_ends, num_seqs, num_tokens, splits, softmax_scale * LOG2E,
            min(window or 1 << 30, 1 << 30),
            (softcap or 1.0) * LOG2E, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_table.stride(0),
            num_kv_heads, group, head_dim, next_pow2(head_dim), cfg["BLOCK_M"], block_q, cfg["BLOCK_N"],
            k_cache.shape[1], splits > 1, fp8_mode, interpreting(q) or q.dtype == torch.float32, softcap is not None,
            sinks is not None, key_ends is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    key = (decode, head_dim, group, str(k_cache.dtype), str(q.dtype), k_cache.shape[1], splits > 1,
           softcap is not None, key_ends is not None)
    launch(pick_config("paged_attention", key, cands, q, launch))
    if splits > 1:
        _merge_splits_kernel[(num_tokens * num_heads,)](*parts, out, sk, splits, num_heads, head_dim,
                                                        next_pow2(head_dim), max(2, next_pow2(splits)),
                                                        sinks is not None)
    return out
