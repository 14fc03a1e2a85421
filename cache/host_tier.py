"""The host tier: copies of KV blocks in host RAM (pinned on CUDA), LRU, keyed by
the same chained block hash as the device pool's prefix cache. Each slot keeps
its block's parent hash and tokens, and a hit must match both (block_hash.py).

One uint8 array of slots [num_slots, block_bytes]; on CPU its pages are only
committed when first written. The engine thread alone adds and drops entries;
the tier threads only read slots, and a slot they read is pinned (not reused)
until they are done. Pins are taken and dropped under the lock."""
from __future__ import annotations

import threading
from collections import OrderedDict
from itertools import islice

import numpy as np
import torch


class HostTier:
    def __init__(self, num_slots: int, block_bytes: int, pin_memory: bool = False):
        self.num_slots, self.block_bytes = num_slots, block_bytes
        self.buf = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self.rows: np.ndarray = self.buf.numpy()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self.ident: list[tuple | None] = [None] * num_slots  # slot -> (parent hash, tokens)
        self.free = list(range(num_slots - 1, -1, -1))
        self.pins = [0] * num_slots
        self.lock = threading.Lock()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    @property
    def used_bytes(self) -> int:
        return len(self.index) * self.block_bytes

    def get(self, block_hash: bytes, parent: bytes, tokens: tuple) -> int | None:
        """The slot of a hit (this very block: its parent and tokens), now the most recently used."""
        slot = self.index.get(block_hash)
        if slot is None or self.ident[slot] != (parent, tokens):
            return None
        self.index.move_to_end(block_hash)
        return slot

    def reserve(self, n: int) -> list[int]:
        """Up to n slots to fill, dropping the least recently used unpinned entries."""
        out = []
        with self.lock:
            while len(out) < n and self.free:
                out.append(self.free.pop())
            if len(out) < n:
                unpinned = (h for h, s in self.index.items() if not self.pins[s])
                for h in list(islice(unpinned, n - len(out))):
                    out.append(self.index.pop(h))
        return out

    def insert(self, block_hash: bytes, slot: int, parent: bytes, tokens: tuple) -> None:
        self.index[block_hash] = slot
        self.ident[slot] = (parent, tokens)

    def pin(self, slots: list[int]) -> None:
        with self.lock:
            for s in slots:
                self.pins[s] += 1

    def unpin(self, slots: list[int]) -> None:
        with self.lock:
            for s in slots:
                self.pins[s] -= 1
