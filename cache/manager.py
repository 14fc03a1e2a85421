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
`poll_loads` reports it ready, with the loaded blocks published.

KV cache groups (kv_group.py, vLLM's hybrid allocator): a model whose layers slide over
a window beside full-attention ones keeps one block table per group and request, each
group over its own pool (engine/sizing.py sizes them). A hit must hold in every group,
and a sliding group gives back the blocks behind its window as the request advances
(`free_behind_window`). A model of full-attention layers alone has one group, with the
block ids of one shared table."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .block_hash import BlockChain, BlockHasher, HashFn, keyed_blake2b
from .kv_group import NULL, KVGroup
from .tiers import KVTiers, TierBlock


@dataclass(slots=True)
class Offloaded:
    """A request's blocks found in the tiers, from lookup until they are loaded."""
    token_ids: list[int]
    num_device_blocks: int  # the device hits before them
    blocks: list[TierBlock]
    chain: BlockChain


class ComputedBlocks(list):
    """A prefix hit over several KV groups: group 0's blocks (the list itself, what the
    scheduler counts and hands back), the other groups' in `others` (NULL where a sliding
    group needs no block)."""
    others: list


class KVCacheManager:
    def __init__(self, num_blocks: int | None, block_size: int, enable_caching: bool = True,
                 hash_fn: HashFn | None = None, groups: list[tuple[int | None, int]] | None = None):
        """groups: each KV group's (window, number of blocks), group 0 first, as
        ModelConfig.kv_groups() orders them and engine/sizing.py sizes them; None: one
        full-attention group of num_blocks (every layer shares one block table)."""
        self.block_size = block_size
        self.groups = [KVGroup(w, n, block_size, enable_caching) for w, n in (groups or [(None, num_blocks)])]
        self.main = self.groups[0]
        self.pool = self.main.pool  # group 0's: the figures below and the tiers are its
        self.sliding = [g for g in self.groups if g.window is not None]
        self.hasher = BlockHasher(hash_fn)
        self._hash_given = hash_fn is not None
        self.enable_caching = enable_caching
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

    @property
    def req_blocks(self) -> dict[str, list[int]]:
        return self.main.req_blocks

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Before any request. A disk tier's blocks are named by hashes under its key, so the
        chain is hashed with that key (unless a test gave its own hash function). Only a
        manager of one full-attention group keeps tiers (engine/kv_tiers.py)."""
        assert len(self.groups) == 1 and not self.sliding, "the KV tiers hold full-attention blocks only"
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
        hits = self.main.longest_hit(chain, usable) if len(self.groups) == 1 else self._group_hits(chain, usable)
        self.lookups[req_id] = (len(token_ids), len(hits), len(hits) < usable)
        return hits, len(hits) * self.block_size

    def _group_hits(self, chain: BlockChain, usable: int) -> ComputedBlocks:
        """The longest prefix every group can take (vLLM's HybridKVCacheCoordinator): a full
        group's hit is any prefix of its cached blocks, a sliding group's must end on a window
        of cached blocks, so the sliding groups look only as far as the full ones reach and
        are looked up again while one of them falls short of the others."""
        hits = [g.longest_hit(chain, usable) if g.window is None else None for g in self.groups]
        n = min((len(h) for h in hits if h is not None), default=usable)
        while True:
            for i, g in enumerate(self.groups):
                if g.window is not None and (hits[i] is None or len(hits[i]) > n):
                    hits[i] = g.longest_hit(chain, n)
            m = min(len(h) for h in hits)
            if m == n:
                break
            n = m
        out = ComputedBlocks(hits[0][:n])
        out.others = [h[:n] for h in hits[1:]]
        return out

    def shorten_hit(self, req_id: str, num_blocks: int) -> None:
        """The last lookup's hit is used only up to num_blocks blocks (a hybrid model's state
        checkpoint ends there: cache/state_cache.py); counted so when the request is admitted."""
        if req_id in self.lookups:
            queries, hits, missed = self.lookups[req_id]
            self.lookups[req_id] = (queries, min(hits, num_blocks), missed or num_blocks < hits)

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
    def _per_group(self, computed) -> list[list[int]]:
        if not computed:
            return [[] for _ in self.groups]
        assert len(self.groups) == 1 or isinstance(computed, ComputedBlocks), "hits come from get_computed_blocks"
        return [list(computed)] + (computed.others if len(self.groups) > 1 else [])

    def can_allocate(self, req_id: str, num_tokens: int, computed: list[int] = ()) -> bool:
        """Room for the request to hold num_tokens tokens in all, in every group?"""
        if len(self.groups) == 1:
            return self.main.blocks_needed(req_id, num_tokens, list(computed)) <= self.pool.num_free_blocks
        return all(g.blocks_needed(req_id, num_tokens, c) <= g.pool.num_free_blocks
                   for g, c in zip(self.groups, self._per_group(computed)))

    def allocate(self, req_id: str, num_tokens: int, computed: list[int] = ()) -> list[int]:
        """Blocks for num_tokens tokens in all -> group 0's; refused before anything is touched
        when can_allocate says no, so a caller that did not ask first still leaks nothing."""
        if not self.can_allocate(req_id, num_tokens, computed):
            raise ValueError(f"no room for {num_tokens} tokens of {req_id}: {self.pool.num_free_blocks} blocks free")
        if req_id in self.lookups:
            self._count_lookup(req_id)
        if computed:
            self.req_published[req_id] = 0  # the hits are published again by cache_blocks: a no-op each
        if len(self.groups) == 1:
            return self.main.allocate(req_id, num_tokens, list(computed))
        per = self._per_group(computed)
        for g, c in zip(self.groups[1:], per[1:]):
            g.allocate(req_id, num_tokens, c)
        return self.main.allocate(req_id, num_tokens, per[0])

    def block_row(self, req_id: str) -> np.ndarray:
        """Group 0's block ids as an int32 array (a view: valid until its next allocation)."""
        return self.main.row(req_id)

    def group_rows(self, req_id: str) -> tuple:
        """The other groups' rows, as block_row (empty with one group)."""
        return () if len(self.groups) == 1 else tuple(g.row(req_id) for g in self.groups[1:])

    def free_behind_window(self, req_id: str, num_computed_tokens: int) -> None:
        """Give back each sliding group's blocks that the request's next query (at
        num_computed_tokens) and every later one can no longer read; after cache_blocks,
        so that they go back published."""
        for g in self.sliding:  # none for a model of full-attention layers
            g.free_behind(req_id, num_computed_tokens)

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
            if blocks[i] != NULL and self.pool.cache_block(blocks[i], h, parent, tokens) and self.tiers is not None:
                published.append(TierBlock(h, parent, tokens, blocks[i]))
        for g in self.groups[1:]:
            own = g.req_blocks[req_id]
            for i in range(done, full):
                if own[i] != NULL:
                    g.pool.cache_block(own[i], chain.hashes[i], chain.parent(i), chain.tokens[i])
        self.req_published[req_id] = full
        if published:
            self.tiers.store(published, copy)

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Keep only the blocks that num_tokens need (rejected speculative tokens).
        Only tokens never published roll back: a published block may be another
        request's prefix hit, and the tokens recomputed in its place would differ."""
        published = self.req_published.get(req_id, 0) * self.block_size
        assert num_tokens >= published, f"{req_id}: truncating to {num_tokens} tokens cuts published blocks"
        keep = -(-num_tokens // self.block_size)
        for g in self.groups:
            g.truncate(req_id, keep)

    def free(self, req_id: str) -> None:
        self.abandon_offloaded(req_id)  # a load into its blocks finishes first
        self.lookups.pop(req_id, None)
        self.req_chains.pop(req_id, None)
        self.req_published.pop(req_id, None)
        for g in self.groups:
            g.free(req_id)

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

    def num_held_blocks(self, req_id: str) -> list[int]:
        """Blocks the request holds in each group."""
        return [g.num_held(req_id) for g in self.groups]

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
