"""One step's inputs: planned on the host with numpy, sent to the device in one copy.

A step's metadata (token ids, positions, slot mapping, block table, sequence
lengths, query offsets, the rows to sample) is a few kilobytes. Building it
with device tensors costs a launch per op and, for data-dependent shapes
(repeat_interleave, boolean masks), a host sync each; so it is built in numpy
into one pinned staging buffer and copied with a single non-blocking copy into
a device buffer whose addresses never change (CUDA graphs read them).

Two staging buffers alternate: the engine overlaps host and device, so the
host fills step N+1's while step N's copy may still be queued. Step N's
buffer is reused for N+2 only after N's sampled tokens were read, which
orders it after N's copy.

Padding (for a captured graph of a fixed size) must change nothing real:
padded tokens have slot -1 (the KV write skips them) and belong to one extra
padding sequence; padded sequences past it have no query tokens.

A model with several KV groups (sliding layers beside full ones: cache/manager.py)
gets a slot mapping and a block table per group past the first, the tables last."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ridge.kernels.metadata import AttentionMetadata

_FIELDS = (  # name, dtype, shape in (tokens, seqs, width) capacities; the block table last (send())
    ("input_ids", np.int64, lambda t, s, w: (t,)),
    ("positions", np.int64, lambda t, s, w: (t,)),
    ("slot_mapping", np.int64, lambda t, s, w: (t,)),
    ("sample_rows", np.int64, lambda t, s, w: (t,)),
    ("feed_dst", np.int64, lambda t, s, w: (s,)),  # rows whose token is the previous step's sample
    ("feed_src", np.int64, lambda t, s, w: (s,)),  # ... and which of its sampled rows
    ("seq_lens", np.int32, lambda t, s, w: (s,)),
    ("query_start_loc", np.int32, lambda t, s, w: (s + 1,)),
    ("block_table", np.int32, lambda t, s, w: (s, w)),
)


def _fields(num_groups: int) -> tuple:
    """_FIELDS with each further group's slot mapping before the tables and its table after them."""
    extra = range(1, num_groups)
    return (_FIELDS[:-1] + tuple((f"slot_mapping{g}", np.int64, _FIELDS[2][2]) for g in extra)
            + _FIELDS[-1:] + tuple((f"block_table{g}", np.int32, _FIELDS[-1][2]) for g in extra))


def _group_names(num_groups: int) -> list[tuple[str, str]]:
    """(slot mapping, block table) field names of each KV group."""
    return [("slot_mapping", "block_table")] + [(f"slot_mapping{g}", f"block_table{g}") for g in range(1, num_groups)]


class StepBuffers:
    """Device buffers at capacity (max tokens per step, max sequences + 1 padding
    sequence, max blocks per sequence) and their pinned host staging twins."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 num_groups: int = 1):
        self.max_tokens, self.max_seqs, self.width = max_tokens, max_seqs + 1, max_blocks_per_seq
        self.device = device
        self.groups = _group_names(num_groups)
        self.layout, off = {}, 0
        for name, dt, shape in _fields(num_groups):
            shp = shape(self.max_tokens, self.max_seqs, self.width)
            n = int(np.prod(shp)) * np.dtype(dt).itemsize
            self.layout[name] = (off, n, dt, shp)
            off += -(-n // 8) * 8
        self.nbytes = off
        cuda = device.type == "cuda"
        # On CPU the staging buffer is the device buffer: nothing to copy.
        self.staging = [torch.zeros(off, dtype=torch.uint8, pin_memory=cuda) for _ in range(2 if cuda else 1)]
        self.device_buf = torch.zeros(off, dtype=torch.uint8, device=device) if cuda else self.staging[0]
        self.host = [self._views_np(b) for b in self.staging]
        self.dev = {name: self.device_buf[o:o + n].view(_TORCH[dt]).view(shp)
                    for name, (o, n, dt, shp) in self.layout.items()}
        self._turn = 0

    def _views_np(self, buf: torch.Tensor) -> dict[str, np.ndarray]:
        raw = buf.numpy()
        return {name: raw[o:o + n].view(dt).reshape(shp) for name, (o, n, dt, shp) in self.layout.items()}

    def next_host(self) -> dict[str, np.ndarray]:
        self._turn = (self._turn + 1) % len(self.host)
        return self.host[self._turn]

    def send(self, num_seqs: int) -> None:
        """One non-blocking copy of the staging buffer just filled, up to the last block table's
        last used row (the tables are the last fields and the only large ones)."""
        if self.device_buf is not self.staging[self._turn]:
            off, _, _, _ = self.layout[self.groups[-1][1]]
            n = off + num_seqs * self.width * 4
            self.device_buf[:n].copy_(self.staging[self._turn][:n], non_blocking=True)

    def meta(self, T: int, S: int, seq_lens_host: list[int], query_lens_host: list[int]) -> AttentionMetadata:
        """The step's metadata over the device buffers: T tokens, S sequences, a view per group."""
        d, width = self.dev, self.width

        def one(slots: str, table: str) -> AttentionMetadata:
            return AttentionMetadata(slot_mapping=d[slots][:T], block_table=d[table][:S, :width],
                                     seq_lens=d["seq_lens"][:S], query_start_loc=d["query_start_loc"][:S + 1],
                                     seq_lens_host=seq_lens_host, query_lens_host=query_lens_host)
        meta = one(*self.groups[0])
        meta.groups = tuple(one(*names) for names in self.groups[1:])
        return meta


_TORCH = {np.int64: torch.int64, np.int32: torch.int32}


@dataclass
class StepBatch:
    """One step on the device. Tensors past the real sizes are padding."""
    input_ids: torch.Tensor  # [num_padded_tokens]
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num sample rows] rows of the hidden states to turn into logits
    num_tokens: int  # real tokens
    last_row: dict  # id(scheduled request) -> its last row
    sample_spans: list  # per scheduled request: (first row in logits, count)
    feed: tuple  # (dst rows, src rows) device views, or None: rows that take the previous step's samples
    feed_requests: list  # request ids whose last input token is the previous step's sample


def plan_step(out, block_size: int, bufs: StepBuffers, include_spec: bool = True,
              graph=None, prev_rows: dict | None = None) -> StepBatch:
    """Fill the next staging buffer from the scheduler's plan and send it.

    graph: the captured shape the step will replay (kernels/cuda_graph.GraphShape), or None.
    prev_rows: request id -> row of its token among the previous step's samples, for
    requests whose last input token is not on the host yet (overlapped steps)."""
    h = bufs.next_host()
    scheduled = out.scheduled
    nseq = len(scheduled)
    qlens = np.empty(nseq, dtype=np.int64)
    starts = np.empty(nseq, dtype=np.int64)
    ids = h["input_ids"]
    bt = h["block_table"]
    group_tables = [h[table] for _, table in bufs.groups[1:]]
    feed_dst, feed_src, feed_reqs = [], [], []
    sample_rows, spans = [], []
    row = 0
    for i, s in enumerate(scheduled):
        r = s.request
        n = s.num_scheduled_tokens - (0 if include_spec else s.num_spec_tokens)
        have = r.all_token_ids[s.start: s.start + n]
        known = len(r.all_token_ids)
        if include_spec and s.num_spec_tokens and s.start + n > known:  # the drafts follow the known tokens
            have += r.spec_token_ids[max(0, s.start - known): s.start + n - known]
        ids[row:row + len(have)] = have
        if len(have) < n:  # the last input is the previous step's sample, still on the device
            assert len(have) == n - 1 and prev_rows is not None, "only the latest sample may be unknown"
            feed_dst.append(row + n - 1)
            feed_src.append(prev_rows[r.request_id])
            feed_reqs.append(r.request_id)
        qlens[i], starts[i] = n, s.start
        row_ids = s.block_row if s.block_row is not None else s.block_ids
        bt[i, :len(row_ids)] = row_ids
        for table, g_row in zip(group_tables, s.group_rows):
            table[i, :len(g_row)] = g_row
        row += n
        k = 1 + s.num_spec_tokens if s.samples else 0
        spans.append((len(sample_rows), k))
        sample_rows.extend(range(row - k, row))
    num_tokens = row
    cu = np.cumsum(qlens)
    seq_of = np.repeat(np.arange(nseq), qlens)
    pos = np.arange(num_tokens) - np.repeat(cu - qlens, qlens) + starts[seq_of]
    h["positions"][:num_tokens] = pos
    for slots, table in bufs.groups:
        h[slots][:num_tokens] = h[table][seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
    seq_lens = h["seq_lens"]
    seq_lens[:nseq] = starts + qlens
    qsl = h["query_start_loc"]
    qsl[0] = 0
    qsl[1:nseq + 1] = cu
    host_q, host_s = qlens.tolist(), seq_lens[:nseq].tolist()
    if graph is None:
        T, S = num_tokens, nseq
    elif graph.kind == "decode":
        T = S = _pad_decode(h, bufs.groups, nseq, graph.size, host_q, host_s)
    else:
        T, S = graph.size, bufs.max_seqs
        _pad_mixed(h, bufs.groups, num_tokens, nseq, T, S, block_size, host_q, host_s)
    h["sample_rows"][:len(sample_rows)] = sample_rows
    nf = len(feed_dst)
    h["feed_dst"][:nf] = feed_dst
    h["feed_src"][:nf] = feed_src
    bufs.send(S)
    d = bufs.dev
    meta = bufs.meta(T, S, host_s, host_q)
    ends = cu.tolist()
    return StepBatch(d["input_ids"][:T], d["positions"][:T], meta, d["sample_rows"][:len(sample_rows)],
                     num_tokens, {id(s): e - 1 for s, e in zip(scheduled, ends)}, spans,
                     (d["feed_dst"][:nf], d["feed_src"][:nf]) if nf else None, feed_reqs)


def _pad_decode(h, groups, nseq: int, size: int, host_q: list, host_s: list) -> int:
    """A decode graph of `size` sequences: each padded one is one token over one key in
    block 0 that writes nothing."""
    h["input_ids"][nseq:size] = 0
    h["positions"][nseq:size] = 0
    for slots, table in groups:
        h[slots][nseq:size] = -1
        h[table][nseq:size, 0] = 0
    h["seq_lens"][nseq:size] = 1
    h["query_start_loc"][nseq + 1:size + 1] = np.arange(nseq + 1, size + 1)
    host_q += [1] * (size - nseq)
    host_s += [1] * (size - nseq)
    return size


def _pad_mixed(h, groups, num_tokens: int, nseq: int, T: int, S: int, block_size: int, host_q: list,
               host_s: list) -> None:
    """A mixed graph of T tokens over S sequences: the padded tokens form one extra
    sequence over block 0 that writes nothing; the sequences after it have no queries."""
    extra, used = T - num_tokens, nseq
    qsl = h["query_start_loc"]
    if extra:
        h["input_ids"][num_tokens:T] = 0
        h["positions"][num_tokens:T] = np.arange(extra)
        for slots, table in groups:
            h[slots][num_tokens:T] = -1
            h[table][nseq, : -(-extra // block_size)] = 0
        h["seq_lens"][nseq] = extra
        qsl[nseq + 1] = T
        host_q.append(extra)
        host_s.append(extra)
        used += 1
    h["seq_lens"][used:S] = 0
    qsl[used + 1:S + 1] = T
    host_q += [0] * (S - used)
    host_s += [0] * (S - used)


def token_meta(items, positions: list[int], block_size: int, device) -> AttentionMetadata:
    """One query token for each scheduled request at its position (a drafting pass), over
    every KV group's table: group 0's block ids and the others' rows (ScheduledRequest)."""
    lens, qlens = [p + 1 for p in positions], [1] * len(items)

    def over(tables) -> AttentionMetadata:
        slots = [int(t[p // block_size]) * block_size + p % block_size for t, p in zip(tables, positions)]
        return AttentionMetadata.build(qlens, lens, tables, slots, device)
    meta = over([s.block_ids for s in items])
    if items and items[0].group_rows:
        meta.groups = tuple(over([s.group_rows[g] for s in items]) for g in range(len(items[0].group_rows)))
    return meta
