"""Every step replays a CUDA graph: pure-decode steps one captured per batch
size, mixed steps (prefill chunks beside decodes, drafts) one per token count.

Chosen over piecewise graphs (the model minus attention captured, attention
eager) because ridge's attention kernel already takes a whole varlen batch and
reads every length and offset on the device: with the sequence count padded
to capacity (padded sequences have no query tokens) and the tokens padded to
a ladder size (padded tokens form one extra sequence that writes nothing),
one graph covers any mix at that token count. Host lists only size the grid,
so they are frozen at capture at the largest context.

On CPU there is nothing to capture; enabled=True there runs the same padded
buffers eagerly, which is how tests check that padding changes nothing."""
from __future__ import annotations

import torch

from ridge.kernels.cuda_graph import GraphPool, GraphShape, ladder

from .step_batch import StepBatch, StepBuffers


class StepGraphs:
    def __init__(self, forward, bufs: StepBuffers, block_size: int, max_num_seqs: int, max_tokens: int,
                 max_seq_len: int, enabled: bool, num_kv_blocks: int | None = None):
        """forward(input_ids, positions, meta) -> hidden: the model over the KV cache."""
        self.forward, self.bufs, self.block_size = forward, bufs, block_size
        self.num_kv_blocks = num_kv_blocks or bufs.width  # warm-up reads stay inside the pool
        self.max_seq_len = min(max_seq_len, bufs.width * block_size)
        self.enabled = enabled
        self.decode_sizes = ladder(max_num_seqs, (1, 2, 4), 8)
        self.mixed_sizes = ladder(min(max_tokens, bufs.max_tokens), (16, 32, 64, 96), 128)
        self.device = bufs.device
        self.pool = GraphPool(self.device) if self.device.type == "cuda" else None
        self.captured = False

    def shape_for(self, num_seqs: int, num_tokens: int, pure_decode: bool) -> GraphShape | None:
        if not self.enabled or num_seqs >= self.bufs.max_seqs:
            return None
        if pure_decode and num_seqs <= self.decode_sizes[-1]:
            return GraphShape("decode", next(s for s in self.decode_sizes if s >= num_seqs))
        if num_tokens <= self.mixed_sizes[-1]:
            return GraphShape("mixed", next(s for s in self.mixed_sizes if s >= num_tokens))
        return None

    def run(self, shape: GraphShape, batch: StepBatch) -> torch.Tensor:
        """The step's hidden states, padded rows included."""
        if self.pool is None:
            return self.forward(batch.input_ids, batch.positions, batch.meta)
        assert self.captured, "capture() before the first step: it overwrites the static buffers"
        return self.pool.replay(shape)

    # -- capture (CUDA) ----------------------------------------------------------
    def _static(self, shape: GraphShape):
        d, S = self.bufs.dev, self.bufs.max_seqs
        if shape.kind == "decode":
            T = S = shape.size
            host_q = [1] * S
        else:
            T = shape.size
            host_q = [T] + [0] * (S - 1)
        return d["input_ids"][:T], d["positions"][:T], self.bufs.meta(T, S, [self.max_seq_len] * S, host_q)

    def _warm(self, shape: GraphShape) -> None:
        """Valid inputs at the largest context for an eager warm-up that writes nothing."""
        d, bs = self.bufs.dev, self.block_size
        width = self.bufs.width
        blocks = torch.arange(width, dtype=torch.int32, device=self.device) % self.num_kv_blocks
        for slots, table in self.bufs.groups:
            d[table].copy_(blocks.expand_as(d[table]))
            d[slots].fill_(-1)
        d["input_ids"].zero_()
        d["positions"].zero_()
        S = self.bufs.max_seqs
        if shape.kind == "decode":
            d["seq_lens"].fill_(self.max_seq_len)
            d["query_start_loc"].copy_(torch.arange(S + 1, dtype=torch.int32, device=self.device))
            return
        # Mixed: the tokens spread over sequences of at most one table row each.
        per = width * bs
        starts, lens, left = [0], [], shape.size
        while left:
            q = min(left, per)
            lens.append(max(q, min(self.max_seq_len, per)))
            starts.append(starts[-1] + q)
            left -= q
        lens += [0] * (S - len(lens))
        starts += [starts[-1]] * (S + 1 - len(starts))
        d["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        d["query_start_loc"].copy_(torch.tensor(starts, dtype=torch.int32))

    def capture(self, shapes: list[GraphShape] | None = None) -> None:
        """Every ladder shape by default (at the first step, or at start-up)."""
        shapes = shapes or [GraphShape("decode", s) for s in self.decode_sizes] + \
            [GraphShape("mixed", s) for s in self.mixed_sizes]
        self.pool.capture(shapes, self._warm, self.run_static)
        self.captured = True

    def run_static(self, shape: GraphShape) -> torch.Tensor:
        """The step on the static buffers as they stand, eagerly (capture, and checks
        that stage the buffers themselves)."""
        return self.forward(*self._static(shape))
