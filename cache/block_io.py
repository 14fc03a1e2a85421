"""Whole KV blocks as flat byte rows: the unit the host and disk tiers store.

A block's row holds, for every cache that its id indexes (the target's and a
draft model's), layer by layer: K, V, and for FP8 the K and V scales, each at a
16-byte aligned offset. A host-tier slot is one row; a disk file's payload is one row.

On CPU the copies go through numpy views of the cache tensors: numpy copies on
one thread and releases the GIL, so a tier thread never opens an OpenMP team
(daemon/frontend/engine_loop.py: more OpenMP threads than cores throttle every step).
On CUDA they run on a side stream (CudaBlockIO)."""
from __future__ import annotations

import numpy as np
import torch

from .kv_cache import KVCache

ALIGN = 16


class BlockLayout:
    def __init__(self, caches: list[KVCache]):
        self.tensors = [t for c in caches for layer in c.layers if layer is not None  # None: an MLP block's
                        for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]
        self.sizes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.offsets, off = [], 0
        for size in self.sizes:
            self.offsets.append(off)
            off += -(-size // ALIGN) * ALIGN
        self.block_bytes = off
        self.device = self.tensors[0].device


class CpuBlockIO:
    """Copies between the paged cache and rows of a uint8 array [*, block_bytes]."""

    def __init__(self, layout: BlockLayout):
        self.layout = layout
        # [num_blocks, bytes of one block of that tensor], sharing the cache's memory
        self.views = [t.view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in layout.tensors]

    def save(self, block_ids: list[int], rows: np.ndarray, at) -> None:
        """rows[at[i]] = block block_ids[i]."""
        ids, at = np.asarray(block_ids), np.asarray(at)
        for v, off, size in zip(self.views, self.layout.offsets, self.layout.sizes):
            rows[at, off:off + size] = v[ids]

    def load(self, block_ids: list[int], rows: np.ndarray, at) -> None:
        """block block_ids[i] = rows[at[i]]."""
        ids, at = np.asarray(block_ids), np.asarray(at)
        for v, off, size in zip(self.views, self.layout.offsets, self.layout.sizes):
            v[ids] = rows[at, off:off + size]

    def fence(self):
        return None


class CudaBlockIO:
    """The same copies between device blocks and pinned host rows, on a side stream.

    Every copy first waits for the work already queued on the compute stream: a
    block saved was written by a step queued before, and a block loaded into may
    still be read or written by a step in flight (a request aborted mid-step).
    save() and load() return an event recorded after their copies; a step that
    overwrites a saved block, or reads a loaded one, is ordered after that event
    (Tiers: the compute stream waits on it, and loads are harvested only once done)."""

    def __init__(self, layout: BlockLayout):
        self.layout = layout
        self.device = layout.device
        self.stream = torch.cuda.Stream(self.device)
        self.flat = [t.view(torch.uint8).reshape(t.shape[0], -1) for t in layout.tensors]

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)

    def _runs(self, at):
        """Consecutive row runs: (first position, first row, length)."""
        start = 0
        for i in range(1, len(at) + 1):
            if i == len(at) or at[i] != at[i - 1] + 1:
                yield start, at[start], i - start
                start = i

    def save(self, block_ids: list[int], rows: torch.Tensor, at) -> torch.cuda.Event:
        return self._copy(block_ids, rows, list(at), save=True)

    def load(self, block_ids: list[int], rows: torch.Tensor, at) -> torch.cuda.Event:
        return self._copy(block_ids, rows, list(at), save=False)

    def _copy(self, block_ids: list[int], rows: torch.Tensor, at: list[int], save: bool) -> torch.cuda.Event:
        """Through a device staging buffer [n, block_bytes]: one gather or scatter per cache
        tensor on the device, one host copy per run of consecutive rows."""
        lay = self.layout
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            ids = self._ids(block_ids)
            stage = torch.empty((len(block_ids), lay.block_bytes), dtype=torch.uint8, device=self.device)
            if save:
                for f, off, size in zip(self.flat, lay.offsets, lay.sizes):
                    stage[:, off:off + size].copy_(f.index_select(0, ids))
            for i, r, k in self._runs(at):
                dst, src = (rows[r:r + k], stage[i:i + k]) if save else (stage[i:i + k], rows[r:r + k])
                dst.copy_(src, non_blocking=True)
            if not save:
                for f, off, size in zip(self.flat, lay.offsets, lay.sizes):
                    f.index_copy_(0, ids, stage[:, off:off + size])
            return self.fence()

    def fence(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


def block_io(layout: BlockLayout):
    return CudaBlockIO(layout) if layout.device.type == "cuda" else CpuBlockIO(layout)
