"""Per-request KV allocations over the block pool, with prefix caching.

The scheduler asks `can_allocate` and then `allocate`, and gets back opaque
block-id lists for the runner's block table; only the pool sees ref counts and
hashes. Full blocks are published under a chained hash of (parent hash, token
ids), so any request sharing a prefix finds the same physical blocks."""
from __future__ import annotations

from .block_pool import BlockPool

# The first block's parent. Not None: before Python 3.12 hash(None) is an address,
# so the same prompt would hash differently in every process.
NONE_HASH = 0


def chain_hashes(token_ids: list[int], block_size: int, parent: int = NONE_HASH, start: int = 0) -> list[int]:
    """Hashes of the full blocks of token_ids[start:], chained from `parent`.
    Python's tuple-of-int hash is deterministic across runs (no hash seed)."""
    out = []
    for i in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[i:i + block_size])))
        out.append(parent)
    return out


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    # -- prefix cache -------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: list[int]) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks -> (block ids, tokens covered).
        The last token is always left to compute: its logits pick the next token."""
        if not self.enable_caching:
            return [], 0
        usable = (len(token_ids) - 1) // self.block_size * self.block_size
        hits = []
        for h in chain_hashes(token_ids[:usable], self.block_size):
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += len(token_ids)
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # -- allocation ---------------------------------------------------------
    def _blocks_needed(self, req_id: str, num_tokens: int, computed: list[int]) -> int:
        have = len(self.req_blocks.get(req_id, ())) + len(computed)
        need = -(-num_tokens // self.block_size) - have
        revived = sum(1 for b in computed if self.pool.blocks[b].ref_cnt == 0)
        return max(need, 0) + revived

    def can_allocate(self, req_id: str, num_tokens: int, computed: list[int] = ()) -> bool:
        """Room for the request to hold num_tokens tokens in all?"""
        return self._blocks_needed(req_id, num_tokens, list(computed)) <= self.pool.num_free_blocks

    def allocate(self, req_id: str, num_tokens: int, computed: list[int] = ()) -> list[int]:
        """Blocks for num_tokens tokens in all; refused before anything is touched when
        can_allocate says no, so a caller that did not ask first still leaks nothing."""
        computed = list(computed)
        if not self.can_allocate(req_id, num_tokens, computed):
            raise ValueError(f"no room for {num_tokens} tokens of {req_id}: {self.pool.num_free_blocks} blocks free")
        blocks = self.req_blocks.setdefault(req_id, [])
        if computed:
            assert not blocks, "prefix hits only at admission"
            self.pool.touch(computed)
            blocks.extend(computed)
            self.req_hashes[req_id] = []  # re-derived by cache_blocks
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return blocks

    def cache_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Publish the request's blocks that are now full and computed."""
        if not self.enable_caching:
            return
        hashes = self.req_hashes.setdefault(req_id, [])
        blocks = self.req_blocks[req_id]
        full = min(num_computed_tokens // self.block_size, len(blocks))
        if full <= len(hashes):
            return
        new = chain_hashes(token_ids[: full * self.block_size], self.block_size,
                           hashes[-1] if hashes else NONE_HASH, len(hashes) * self.block_size)
        for i, h in enumerate(new, start=len(hashes)):
            self.pool.cache_block(blocks[i], h)
        hashes.extend(new)

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Keep only the blocks that num_tokens need (rejected speculative tokens).
        Only tokens never published roll back: a published block may be another
        request's prefix hit, and the tokens recomputed in its place would differ."""
        published = len(self.req_hashes.get(req_id, ())) * self.block_size
        assert num_tokens >= published, f"{req_id}: truncating to {num_tokens} tokens cuts published blocks"
        blocks = self.req_blocks.get(req_id, [])
        keep = -(-num_tokens // self.block_size)
        if len(blocks) > keep:
            self.pool.free(blocks[keep:][::-1])
            del blocks[keep:]

    def free(self, req_id: str) -> None:
        blocks = self.req_blocks.pop(req_id, [])
        self.req_hashes.pop(req_id, None)
        self.pool.free(blocks[::-1])

    def block_ids(self, req_id: str) -> list[int]:
        return self.req_blocks.get(req_id, [])

    # -- figures --------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
