"""One KV cache group's blocks: the layers that share a block table (full attention, or
sliding layers of one window), their block pool, and each request's block list.

As vLLM's hybrid KV cache manager (v1/core/single_type_kv_cache_manager.py): a request's
list keeps one entry per logical block, so a block's index is its position // block_size in
every group. A sliding group's entries wholly behind the window of the request's next query
are NULL: their blocks went back to the pool, still published, to the tail of its free queue,
where a later prefix hit may revive them. The attention kernels never read a block (nor its
table entry) wholly behind a query's window, so the int32 row holds block 0 there."""
from __future__ import annotations

import numpy as np

from .block_hash import BlockChain
from .block_pool import BlockPool

NULL = -1  # a logical block whose KV this group no longer holds (behind the window)


class KVGroup:
    def __init__(self, window: int | None, num_blocks: int, block_size: int, enable_caching: bool):
        self.window, self.block_size = window, block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[int]] = {}
        # The same block ids as int32 arrays (capacity doubling; the list's length is the row's):
        # a step copies each request's row into the block table with one memcpy.
        self.req_rows: dict[str, np.ndarray] = {}
        self._mirrored: dict[str, int] = {}  # how many leading entries of each row match the list
        self._behind: dict[str, int] = {}  # sliding: how many leading entries are NULL

    # -- prefix cache -----------------------------------------------------------
    def longest_hit(self, chain: BlockChain, max_blocks: int) -> list[int]:
        """The most leading blocks of chain (at most max_blocks) that a request may take as
        computed. Full attention: every one of them cached. Sliding: the next query (at
        hit * block_size) reads the keys of the window before it, so the hit's last
        cdiv(window - 1, block) blocks must be cached, and the blocks before them are NULL
        (vLLM's SlidingWindowManager.find_longest_cache_hit)."""
        get = self.pool.get_cached_block
        if self.window is None:
            hits = []
            for i in range(max_blocks):
                b = get(chain.hashes[i], chain.parent(i), chain.tokens[i])
                if b is None:
                    break
                hits.append(b)
            return hits
        need = -(-(self.window - 1) // self.block_size)
        hits, run = [NULL] * max_blocks, 0
        if need == 0:
            return hits
        for i in range(max_blocks - 1, -1, -1):
            b = get(chain.hashes[i], chain.parent(i), chain.tokens[i])
            if b is None:
                run = 0
                continue
            hits[i] = b
            run += 1
            if run >= need:
                return hits[:i + run]
        return hits[:run]  # the leading blocks: a window that starts before position 0

    # -- allocation -------------------------------------------------------------
    def blocks_needed(self, req_id: str, num_tokens: int, computed: list[int]) -> int:
        have = len(self.req_blocks.get(req_id, ())) + len(computed)
        need = -(-num_tokens // self.block_size) - have
        revived = sum(1 for b in computed if b != NULL and self.pool.blocks[b].ref_cnt == 0)
        return max(need, 0) + revived

    def allocate(self, req_id: str, num_tokens: int, computed: list[int]) -> list[int]:
        blocks = self.req_blocks.setdefault(req_id, [])
        if computed:
            assert not blocks, "prefix hits only at admission"
            if self.window is None:
                self.pool.touch(computed)
            else:
                self.pool.touch([b for b in computed if b != NULL])
                self._behind[req_id] = next((i for i, b in enumerate(computed) if b != NULL), len(computed))
            blocks.extend(computed)
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        if self._mirrored.get(req_id, -1) != len(blocks):  # most decode steps add no block
            self._mirror(req_id, blocks)
        return blocks

    def _mirror(self, req_id: str, blocks: list[int]) -> None:
        row, n = self.req_rows.get(req_id), len(blocks)
        have = 0 if row is None else row.shape[0]
        if n > have:
            grown = np.empty(max(n, 2 * have, 16), dtype=np.int32)
            if row is not None:
                grown[:have] = row
            self.req_rows[req_id] = row = grown
        # Rows past a truncation hold stale ids: rewrite from the first block that may differ.
        start = min(self._mirrored.get(req_id, 0), n)
        row[start:n] = blocks[start:]
        if self.window is not None:
            np.maximum(row[start:n], 0, out=row[start:n])  # NULL reads as block 0, never read
        self._mirrored[req_id] = n

    def row(self, req_id: str) -> np.ndarray:
        """The request's block ids as an int32 array (a view: valid until its next allocation)."""
        return self.req_rows[req_id][:len(self.req_blocks[req_id])]

    def free_behind(self, req_id: str, num_computed_tokens: int) -> None:
        """Sliding: give back the blocks wholly behind the window of the query at
        num_computed_tokens (the request's next), oldest first: the next query reads keys
        from num_computed_tokens - window + 1 on, and no later query reads earlier ones."""
        blocks = self.req_blocks.get(req_id)
        if not blocks:
            return
        first = min(max(num_computed_tokens - self.window + 1, 0) // self.block_size, len(blocks))
        start = self._behind.get(req_id, 0)
        if first <= start:
            return
        freed = [b for b in blocks[start:first] if b != NULL]
        blocks[start:first] = [NULL] * (first - start)
        row = self.req_rows.get(req_id)
        if row is not None:
            row[start:min(first, self._mirrored.get(req_id, 0))] = 0
        self._behind[req_id] = first
        self.pool.free(freed[::-1])  # tail-first, as every free; earlier frees are evicted first

    def truncate(self, req_id: str, keep: int) -> None:
        """Keep the first `keep` logical blocks."""
        blocks = self.req_blocks.get(req_id, [])
        if len(blocks) > keep:
            self.pool.free([b for b in blocks[keep:][::-1] if b != NULL])
            del blocks[keep:]
            self._mirrored[req_id] = min(self._mirrored.get(req_id, 0), keep)
            if self._behind.get(req_id, 0) > keep:
                self._behind[req_id] = keep

    def free(self, req_id: str) -> None:
        blocks = self.req_blocks.pop(req_id, [])
        self.req_rows.pop(req_id, None)
        self._mirrored.pop(req_id, None)
        if self._behind.pop(req_id, None) is not None:
            blocks = [b for b in blocks if b != NULL]
        self.pool.free(blocks[::-1])

    def num_held(self, req_id: str) -> int:
        """Blocks the request holds in this group (its NULL entries hold none)."""
        blocks = self.req_blocks.get(req_id, ())
        return len(blocks) - self._behind.get(req_id, 0) if self.window is not None else len(blocks)
