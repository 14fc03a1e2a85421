"""Per-request KV allocations over the block pool, with prefix caching.

The scheduler asks `can_allocate` and then `allocate`, and gets back opaque
block-id lists for the runner's block table; only the pool sees ref counts and
hashes. Full blocks are published under a chained hash of (parent hash, token
ids) that starts from the request's cache salt (block_hash.py), so any request
sharing a prefix and a salt finds the same physical blocks, and a hit is used
only if the block's parent and tokens are the request's.

With KV tiers (tiers.py) the chain goes on past the device: a block the pool
evicted may still be in host RAM or on disk. Admission then asks
`get_offloaded_blocks` after `get_computed_blocks`, allocates device blocks for
those too, and `load_offloaded` copies them in while the request waits;
`poll_loads` reports it ready, with the loaded blocks published."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .block_hash import BlockChain, BlockHasher, HashFn, keyed_blake2b
from .block_pool import BlockPool
from .tiers import KVTiers, TierBlock


@dataclass(slots=True)
class Offloaded:
    """A request's blocks found in the tiers, from lookup until they are loaded."""
    token_ids: list[int]
    num_device_blocks: int  # the device hits before them
    blocks: list[TierBlock]
    chain: BlockChain


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, hash_fn: HashFn | None = None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.hasher = BlockHasher(hash_fn)
        self._hash_given = hash_fn is not None
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[int]] = {}
        # The same block ids as int32 arrays (capacity doubling; the list's length is the row's):
        # a step copies each request's row into the block table with one memcpy.
        self.req_rows: dict[str, np.ndarray] = {}
        self._mirrored: dict[str, int] = {}  # how many leading entries of each row match the list
        # Each request's chain (its own, kept on the request, or one made for a caller that
        # passes none), and how many of its blocks are published.
        self.req_chains: dict[str, BlockChain] = {}
        self.req_published: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached (on the device, or loaded from a tier)
        self.device_hits = self.device_misses = 0  # blocks
        # The last lookup of each request not yet admitted: counted once, when it is (a request
        # that waits for room is looked up again every step).
        self.lookups: dict[str, tuple[int, int, bool]] = {}
        self.tiers: KVTiers | None = None
        self.offloaded: dict[str, Offloaded] = {}

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Before any request. A disk tier's blocks are named by hashes under its key, so the
        chain is hashed with that key (unless a test gave its own hash function)."""
        if self.enable_caching and tiers.enabled:
            self.tiers = tiers
            self.pool.on_evict = tiers.evict
            if tiers.hash_key is not None and not self._hash_given:
                self.set_hash(keyed_blake2b(tiers.hash_key))

    def set_hash(self, hash_fn: HashFn) -> None:
        """Hash blocks with hash_fn from now on; only while nothing is published under the old one."""
        assert not self.pool.cached and not self.req_chains, "the block hash changes only before any request"
        self.hasher = BlockHasher(hash_fn)

    def chain(self, token_ids: list[int], salt: str = "") -> list[bytes]:
        """The hashes of token_ids' full blocks, for requests with this cache salt."""
        return self.hasher.chain(token_ids, self.block_size, self.hasher.root(salt))

    def _chain(self, req_id: str, token_ids: list[int], salt: str, chain: BlockChain | None,
               num_blocks: int) -> BlockChain:
        """The request's chain, hashed up to num_blocks blocks. chain: the request's own (kept
        across steps and preemptions); None: the manager keeps one while the request holds blocks."""
        if chain is None:
            chain = self.req_chains.get(req_id)
            if chain is None or chain.salt != salt:
                chain = BlockChain(salt)
        chain.extend(self.hasher, token_ids, self.block_size, num_blocks)
        return chain

    def _lookup_blocks(self, req_id, token_ids, salt, chain) -> tuple[BlockChain, int]:
        """-> (chain, how many full blocks a lookup may hit): the last token is always left to
        compute, because its logits pick the next token."""
        usable = (len(token_ids) - 1) // self.block_size
        return self._chain(req_id, token_ids, salt, chain, usable), usable

    # -- prefix cache -------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: list[int], salt: str = "",
                            chain: BlockChain | None = None) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks -> (block ids, tokens covered).
        chain: the request's BlockChain (its salt is `salt`), extended here."""
        if not self.enable_caching:
            return [], 0
        chain, usable = self._lookup_blocks(req_id, token_ids, salt, chain)
        hits = []
        for i in range(usable):
            block = self.pool.get_cached_block(chain.hashes[i], chain.parent(i), chain.tokens[i])
            if block is None:
                break
            hits.append(block)
        self.lookups[req_id] = (len(token_ids), len(hits), len(hits) < usable)
        return hits, len(hits) * self.block_size

    def _count_lookup(self, req_id: str) -> None:
        queries, hits, missed = self.lookups.pop(req_id, (0, 0, False))
        self.prefix_queries += queries
        self.prefix_hits += hits * self.block_size
        self.device_hits += hits
        self.device_misses += missed

    # -- KV tiers ---------------------------------------------------------------
    def get_offloaded_blocks(self, req_id: str, token_ids: list[int], num_device_blocks: int, salt: str = "",
                             chain: BlockChain | None = None) -> int:
        """After get_computed_blocks: how many more blocks of the chain the tiers hold. They are
        held for load_offloaded until the request is admitted, or abandon_offloaded."""
        if self.tiers is None:
            return 0
        chain, usable = self._lookup_blocks(req_id, token_ids, salt, chain)
        wanted = [TierBlock(chain.hashes[i], chain.parent(i), chain.tokens[i]) for i in range(num_device_blocks, usable)]
        found = self.tiers.lookup(wanted)
        if found:
            self.offloaded[req_id] = Offloaded(list(token_ids), num_device_blocks, found, chain)
        return len(found)

    def load_offloaded(self, req_id: str) -> None:
        """Copy the tier hits into the request's blocks that follow its device hits (allocated)."""
        off = self.offloaded[req_id]
        blocks = self.req_blocks[req_id][off.num_device_blocks:off.num_device_blocks + len(off.blocks)]
        self.tiers.start_load(req_id, off.blocks, blocks)

    def abandon_offloaded(self, req_id: str) -> None:
        off = self.offloaded.pop(req_id, None)
        if off is not None:
            self.tiers.cancel(req_id, off.blocks)

    def poll_loads(self) -> dict[str, int]:
        """Requests whose tier hits have arrived -> tokens now computed (device hits and the
        leading blocks that loaded); those blocks are published as prefix hits."""
        if self.tiers is None or not self.offloaded:
            return {}
        out = {}
        for req_id, n in self.tiers.poll().items():
            off = self.offloaded.pop(req_id)
            out[req_id] = (off.num_device_blocks + n) * self.block_size
            self.cache_blocks(req_id, off.token_ids, out[req_id], copy=False, salt=off.chain.salt, chain=off.chain)
            self.prefix_hits += n * self.block_size
        return out

    def wait_loads(self, timeout: float) -> None:
        if self.tiers is not None:
            self.tiers.wait(timeout)

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
        if req_id in self.lookups:
            self._count_lookup(req_id)
        if computed:
            assert not blocks, "prefix hits only at admission"
            self.pool.touch(computed)
            blocks.extend(computed)
            self.req_published[req_id] = 0  # the hits are published again by cache_blocks: a no-op each
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
        self._mirrored[req_id] = n

    def block_row(self, req_id: str) -> np.ndarray:
        """The request's block ids as an int32 array (a view: valid until its next allocation)."""
        return self.req_rows[req_id][:len(self.req_blocks[req_id])]

    def cache_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int, copy: bool = True,
                     salt: str = "", chain: BlockChain | None = None) -> None:
        """Publish the request's blocks that are now full and computed, and hand the new ones
        to the tiers (copy=False: they were loaded from there). salt and chain: the request's
        cache salt and BlockChain, the same its lookups were given."""
        if not self.enable_caching:
            return
        done = self.req_published.get(req_id, 0)
        blocks = self.req_blocks[req_id]
        full = min(num_computed_tokens // self.block_size, len(blocks))
        if full <= done:
            return
        chain = self.req_chains[req_id] = self._chain(req_id, token_ids, salt, chain, full)
        published = []
        for i in range(done, full):
            h, parent, tokens = chain.hashes[i], chain.parent(i), chain.tokens[i]
            if self.pool.cache_block(blocks[i], h, parent, tokens) and self.tiers is not None:
                published.append(TierBlock(h, parent, tokens, blocks[i]))
        self.req_published[req_id] = full
        if published:
            self.tiers.store(published, copy)

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Keep only the blocks that num_tokens need (rejected speculative tokens).
        Only tokens never published roll back: a published block may be another
        request's prefix hit, and the tokens recomputed in its place would differ."""
        published = self.req_published.get(req_id, 0) * self.block_size
        assert num_tokens >= published, f"{req_id}: truncating to {num_tokens} tokens cuts published blocks"
        blocks = self.req_blocks.get(req_id, [])
        keep = -(-num_tokens // self.block_size)
        if len(blocks) > keep:
            self.pool.free(blocks[keep:][::-1])
            del blocks[keep:]
            self._mirrored[req_id] = min(self._mirrored.get(req_id, 0), keep)

    def free(self, req_id: str) -> None:
        self.abandon_offloaded(req_id)  # a load into its blocks finishes first
        self.lookups.pop(req_id, None)
        blocks = self.req_blocks.pop(req_id, [])
        self.req_rows.pop(req_id, None)
        self._mirrored.pop(req_id, None)
        self.req_chains.pop(req_id, None)
        self.req_published.pop(req_id, None)
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
