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

from .block_hash import BlockHasher, HashFn, keyed_blake2b
from .block_pool import BlockPool
from .tiers import KVTiers, TierBlock


@dataclass(slots=True)
class Offloaded:
    """A request's blocks found in the tiers, from lookup until they are loaded."""
    token_ids: list[int]
    num_device_blocks: int  # the device hits before them
    blocks: list[TierBlock]
    salt: str


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, hash_fn: HashFn | None = None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.hasher = BlockHasher(hash_fn)
        self._hash_given = hash_fn is not None
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached (on the device, or loaded from a tier)
        self.device_hits = self.device_misses = 0  # blocks
        # The last lookup of each request not yet admitted: counted once, when it is (a request
        # that waits for room is looked up again every step).
        self.lookups: dict[str, tuple[int, int, bool]] = {}
        self.tiers: KVTiers | None = None
        self.offloaded: dict[str, Offloaded] = {}
        # The last lookup's blocks, by (salt, tokens): the tiers' lookup follows the device's, and a
        # request waiting for room is looked up again every step, with the same tokens.
        self._last_blocks: tuple | None = None

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
        assert not self.pool.cached and not self.req_hashes, "the block hash changes only before any request"
        self.hasher = BlockHasher(hash_fn)
        self._last_blocks = None

    def chain(self, token_ids: list[int], salt: str = "") -> list[bytes]:
        """The hashes of token_ids' full blocks, for requests with this cache salt."""
        return self.hasher.chain(token_ids, self.block_size, self.hasher.root(salt))

    def _blocks_of(self, token_ids: list[int], salt: str) -> tuple[list[bytes], list[bytes], list[tuple]]:
        """The full blocks of token_ids but the last token: (hashes, parents, tokens)."""
        last = self._last_blocks
        if last is not None and last[0] == salt and last[1] == token_ids:
            return last[2]
        blocks = self._hash_blocks(token_ids, salt)
        self._last_blocks = (salt, list(token_ids), blocks)
        return blocks

    def _hash_blocks(self, token_ids: list[int], salt: str) -> tuple[list[bytes], list[bytes], list[tuple]]:
        bs = self.block_size
        root = self.hasher.root(salt)
        hashes = self.hasher.chain(token_ids[:(len(token_ids) - 1) // bs * bs], bs, root)
        tokens = [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(len(hashes))]
        return hashes, [root] + hashes[:-1], tokens

    # -- prefix cache -------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: list[int], salt: str = "") -> tuple[list[int], int]:
        """Longest cached prefix of full blocks -> (block ids, tokens covered).
        The last token is always left to compute: its logits pick the next token."""
        if not self.enable_caching:
            return [], 0
        hits = []
        hashes, parents, tokens = self._blocks_of(token_ids, salt)
        for h, parent, toks in zip(hashes, parents, tokens):
            block = self.pool.get_cached_block(h, parent, toks)
            if block is None:
                break
            hits.append(block)
        self.lookups[req_id] = (len(token_ids), len(hits), len(hits) < len(hashes))
        return hits, len(hits) * self.block_size

    def _count_lookup(self, req_id: str) -> None:
        queries, hits, missed = self.lookups.pop(req_id, (0, 0, False))
        self.prefix_queries += queries
        self.prefix_hits += hits * self.block_size
        self.device_hits += hits
        self.device_misses += missed

    # -- KV tiers ---------------------------------------------------------------
    def get_offloaded_blocks(self, req_id: str, token_ids: list[int], num_device_blocks: int, salt: str = "") -> int:
        """After get_computed_blocks: how many more blocks of the chain the tiers hold. They are
        held for load_offloaded until the request is admitted, or abandon_offloaded."""
        if self.tiers is None:
            return 0
        hashes, parents, tokens = self._blocks_of(token_ids, salt)
        chain = [TierBlock(*b) for b in zip(hashes, parents, tokens)][num_device_blocks:]
        found = self.tiers.lookup(chain)
        if found:
            self.offloaded[req_id] = Offloaded(list(token_ids), num_device_blocks, found, salt)
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
            self.cache_blocks(req_id, off.token_ids, out[req_id], copy=False, salt=off.salt)
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
            self.req_hashes[req_id] = []  # re-derived by cache_blocks
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return blocks

    def cache_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int, copy: bool = True,
                     salt: str = "") -> None:
        """Publish the request's blocks that are now full and computed, and hand the new ones
        to the tiers (copy=False: they were loaded from there). salt: the request's cache salt,
        the same its lookups were given."""
        if not self.enable_caching:
            return
        hashes = self.req_hashes.setdefault(req_id, [])
        blocks = self.req_blocks[req_id]
        full = min(num_computed_tokens // self.block_size, len(blocks))
        if full <= len(hashes):
            return
        bs = self.block_size
        parent = hashes[-1] if hashes else self.hasher.root(salt)
        new = self.hasher.chain(token_ids[: full * bs], bs, parent, len(hashes) * bs)
        published = []
        for i, h in enumerate(new, start=len(hashes)):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            if self.pool.cache_block(blocks[i], h, parent, tokens) and self.tiers is not None:
                published.append(TierBlock(h, parent, tokens, blocks[i]))
            parent = h
        hashes.extend(new)
        if published:
            self.tiers.store(published, copy)

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
        self.abandon_offloaded(req_id)  # a load into its blocks finishes first
        self.lookups.pop(req_id, None)
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
