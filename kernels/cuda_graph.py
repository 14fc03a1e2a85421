"""CUDA-graph replay for pure-decode steps (every request adds exactly one token).

A decode step launches a few hundred small kernels; replaying a captured graph
removes their launch cost, which dominates at small batch. Graphs are captured
for a fixed set of batch sizes; a step of B tokens replays the smallest size
>= B with the rows past B padded so they touch nothing:
  slot_mapping = -1 (the KV write skips them), seq_len = 1, block 0, token 0.
Mixed (prefill) steps, and batches above the largest size, run eagerly.

Usage (the engine):
    runner = DecodeGraphRunner(lambda ids, pos, meta: model(ids, pos, meta, cache.layers),
                               max_batch=64, max_blocks_per_seq=cache_blocks_per_seq,
                               max_seq_len=max_model_len, device=device)
    runner.capture()                      # once, after weights and KV cache exist
    if runner.can_run(meta):
        hidden = runner.run(input_ids, positions, meta)   # a view: consume it before the next run
    else:
        hidden = model(input_ids, positions, meta, cache.layers)

Rules:
  - Capture needs the Triton kernels: the torch references plan on host lists
    and copy them to the device, which a graph cannot record.
  - The attention grid (q blocks, flash-decoding splits) is frozen at capture,
    sized for max_seq_len; the kernels read real lengths from the device, so any
    shorter context replays correctly.
  - Capture warms each size up eagerly first (lazy init, kernel tuning) with
    every row at max_seq_len over blocks 0.. (reads only: no slot is written).
  - On CPU the runner is off (can_run is False). enabled=True on CPU replays the
    same padded static buffers eagerly, which lets tests check the padding.
"""
from __future__ import annotations

from typing import Callable

import torch

from .metadata import AttentionMetadata


def default_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8 up to max_batch."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch] + list(range(8, max_batch + 1, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphRunner:
    def __init__(self, model_forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 max_batch: int, sizes: list[int] | None = None, *, max_blocks_per_seq: int, max_seq_len: int,
                 device: torch.device | str = "cuda", enabled: bool | None = None):
        """model_forward(input_ids [S], positions [S], meta) -> [S, ...]: one decode step of S
        sequences, with the KV cache bound inside (a closure)."""
        self.forward = model_forward
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda" if enabled is None else enabled
        self.sizes = sorted({s for s in (sizes or default_sizes(max_batch)) if 0 < s <= max_batch})
        self.max_batch, self.max_seq_len = self.sizes[-1], max_seq_len
        n, dev = self.max_batch, self.device
        # Static inputs: the graphs read these addresses; run() copies each step into them.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        # Host lists only size grids: every row is planned for the longest context.
        return AttentionMetadata(self.slot_mapping[:size], self.block_table[:size], self.seq_lens[:size],
                                 self.query_start_loc[:size + 1], [self.max_seq_len] * size, [1] * size)

    def _step(self, size: int) -> torch.Tensor:
        return self.forward(self.input_ids[:size], self.positions[:size], self._meta(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, in one shared memory pool. No-op on CPU."""
        if not self.enabled or self.device.type != "cuda" or self._graphs:
            return
        width = self.block_table.shape[1]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.seq_lens.fill_(self.max_seq_len)  # needs max_seq_len <= width * block_size
            self.block_table.copy_(torch.arange(width, dtype=torch.int32, device=self.device))  # broadcast rows
            self._step(size)  # warm-up: lazy init and tuning, outside the graph
            torch.cuda.synchronize(self.device)
            self.seq_lens.fill_(1)
            self.block_table.zero_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._step(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, meta_or_num_tokens: AttentionMetadata | int) -> bool:
        """True for a pure-decode step that fits the largest captured size."""
        if not self.enabled:
            return False
        if isinstance(meta_or_num_tokens, AttentionMetadata):
            meta = meta_or_num_tokens
            if not meta.is_pure_decode or meta.block_table.shape[1] > self.block_table.shape[1]:
                return False
            num_tokens = meta.num_seqs
        else:
            num_tokens = meta_or_num_tokens
        return 0 < num_tokens <= self.max_batch

    def _size_for(self, num_tokens: int) -> int:
        return next(s for s in self.sizes if s >= num_tokens)

    def _stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        b, width = input_ids.shape[0], meta.block_table.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_table[:b, :width].copy_(meta.block_table)
        # Padding rows: write nothing, attend to one key in block 0.
        self.input_ids[b:size].zero_()
        self.positions[b:size].zero_()
        self.slot_mapping[b:size].fill_(-1)
        self.seq_lens[b:size].fill_(1)
        self.block_table[b:size].zero_()

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One pure-decode step of B = input_ids.shape[0] sequences -> the first B output rows.
        The result is a view of a static buffer, overwritten by the next run."""
        assert self.can_run(meta) and input_ids.shape[0] == meta.num_seqs, "not a capturable decode step"
        b = input_ids.shape[0]
        size = self._size_for(b)
        if self.device.type == "cuda" and not self._graphs:
            self.capture()
        self._stage(input_ids, positions, meta, size)
        if size in self._graphs:
            self._graphs[size].replay()
            return self._outputs[size][:b]
        return self._step(size)[:b]  # CPU, enabled for tests: the same padded buffers, eagerly
