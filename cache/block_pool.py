"""The block pool: the only owner of free blocks, reference counts and block hashes.

Free blocks sit in one doubly linked queue in eviction order. A freed block
goes to the tail, so the head is the least recently used; a block that still
holds a cached prefix stays findable by its hash until it is handed out again.
A prefix hit on a free block takes it out of the middle of the queue in O(1).
Handing a cached block out again evicts its prefix: `on_evict` (the KV tiers)
gets the evicted blocks first, while their bytes are still there.

A cached block keeps its identity beside its hash, its parent's hash and its
token ids, and a lookup that finds the hash uses the block only if both equal
the request's (block_hash.py: the rule of a hit)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    parent: bytes | None = None  # while cached: the parent's hash and the block's tokens
    tokens: tuple | None = None
    prev: "Block | None" = field(default=None, repr=False)
    next: "Block | None" = field(default=None, repr=False)


class FreeQueue:
    """Doubly linked list with sentinels: O(1) popleft, append and remove."""

    def __init__(self, blocks: list[Block]):
        self.head, self.tail = Block(-1), Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, b: Block) -> None:
        last = self.tail.prev
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.size += 1

    def remove(self, b: Block) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.size -= 1

    def popleft(self) -> Block:
        assert self.size > 0, "no free blocks"
        b = self.head.next
        self.remove(b)
        return b


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.on_evict = None  # called with [(block id, hash, parent, tokens)] before those blocks are reused

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.size

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get_cached_block(self, block_hash: bytes, parent: bytes, tokens: tuple) -> int | None:
        """The cached block under block_hash, if it is this very block (its parent and tokens)."""
        b = self.cached.get(block_hash)
        if b is None or b.tokens != tokens or b.parent != parent:
            return None
        return b.block_id

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), reviving free ones."""
        for i in block_ids:
            b = self.blocks[i]
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.free_queue.size:
            raise ValueError(f"cannot allocate {n} blocks: {self.free_queue.size} free")
        out, evicted = [], []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:  # evict the cached prefix it held
                del self.cached[b.block_hash]
                evicted.append((b.block_id, b.block_hash, b.parent, b.tokens))
                b.block_hash = b.parent = b.tokens = None
            b.ref_cnt = 1
            out.append(b.block_id)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each. Callers pass blocks tail-first, so that a
        sequence's last blocks are evicted before the prefix they extend."""
        for i in block_ids:
            b = self.blocks[i]
            assert b.ref_cnt > 0, f"block {i} freed twice"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache_block(self, block_id: int, block_hash: bytes, parent: bytes, tokens: tuple) -> bool:
        """Publish a full, computed block under its chained hash; -> whether it is new."""
        if not self.enable_caching:
            return False
        b = self.blocks[block_id]
        if b.block_hash is not None or block_hash in self.cached:
            return False  # already published, or a block under the same hash is
        b.block_hash, b.parent, b.tokens = block_hash, parent, tokens
        self.cached[block_hash] = b
        return True

