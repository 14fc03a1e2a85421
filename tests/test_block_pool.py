"""The block pool on its own: no model, no tensors (as vLLM's tests/v1/core)."""
import pytest

from ridge.cache.block_hash import NONE_HASH
from ridge.cache.block_pool import BlockPool


def h(n: int) -> bytes:
    return n.to_bytes(16, "little")


def publish(pool: BlockPool, block: int, n: int) -> bool:
    """Publish block under hash n, as the block of tokens (n,) after the first parent."""
    return pool.cache_block(block, h(n), NONE_HASH, (n,))


def find(pool: BlockPool, n: int):
    return pool.get_cached_block(h(n), NONE_HASH, (n,))


def free_order(pool: BlockPool) -> list[int]:
    """Block ids in the free queue, head (evicted first) to tail."""
    out, b = [], pool.free_queue.head.next
    while b is not pool.free_queue.tail:
        out.append(b.block_id)
        b = b.next
    return out


def test_a_fresh_pool_is_all_free_in_id_order():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 0
    assert free_order(pool) == [0, 1, 2, 3]


def test_allocate_hands_out_distinct_blocks_with_one_reference():
    pool = BlockPool(5)
    got = pool.allocate(3)
    assert got == [0, 1, 2]
    assert [pool.blocks[i].ref_cnt for i in range(5)] == [1, 1, 1, 0, 0]
    assert pool.num_free_blocks == 2 and free_order(pool) == [3, 4]


def test_free_returns_blocks_to_the_tail_in_the_order_given():
    pool = BlockPool(4)
    a = pool.allocate(3)
    pool.free(a[::-1])  # a sequence frees its last block first
    assert free_order(pool) == [3, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_a_block_freed_twice_is_caught():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([b])


def test_exhaustion_refuses_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(ValueError, match="cannot allocate 2 blocks: 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1 and free_order(pool) == [2]
    assert pool.allocate(1) == [2] and pool.num_free_blocks == 0


def test_a_shared_block_is_free_only_after_its_last_reference():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    publish(pool, b, 111)
    pool.touch([b])  # a second request hits it
    assert pool.blocks[b].ref_cnt == 2
    pool.free([b])
    assert pool.num_free_blocks == 1 and b not in free_order(pool)
    pool.free([b])
    assert pool.num_free_blocks == 2 and free_order(pool) == [1, b]


def test_a_cached_free_block_stays_findable_until_it_is_handed_out_again():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    publish(pool, b, 111)
    pool.free([b])
    assert find(pool, 111) == b
    pool.allocate(1)  # the head: block 1, never cached
    assert find(pool, 111) == b
    pool.allocate(1)  # only block b is left: its prefix is evicted
    assert find(pool, 111) is None and pool.blocks[b].block_hash is None
    assert pool.num_cached_blocks == 0


def test_eviction_is_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for b in blocks:
        publish(pool, b, 100 + b)
    pool.free([2])
    pool.free([0])
    pool.free([3])
    pool.free([1])
    assert pool.allocate(2) == [2, 0]
    assert [find(pool, 100 + b) for b in range(4)] == [None, 1, None, 3]


def test_a_hit_takes_a_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    publish(pool, 2, 222)
    pool.free(blocks)
    pool.touch([2])
    assert pool.blocks[2].ref_cnt == 1
    assert free_order(pool) == [0, 1, 3] and pool.num_free_blocks == 3
    pool.free([2])  # used again just now: the last to be evicted
    assert free_order(pool) == [0, 1, 3, 2]


def test_the_first_block_published_under_a_hash_keeps_it():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    publish(pool, a, 111)
    publish(pool, b, 111)  # identical content computed twice: one copy is enough
    assert find(pool, 111) == a and pool.blocks[b].block_hash is None
    publish(pool, a, 222)  # already published
    assert pool.blocks[a].block_hash == h(111) and find(pool, 222) is None
    assert pool.num_cached_blocks == 1


def test_without_caching_nothing_is_published():
    pool = BlockPool(2, enable_caching=False)
    [b] = pool.allocate(1)
    publish(pool, b, 111)
    assert find(pool, 111) is None and pool.num_cached_blocks == 0


def test_a_hit_is_used_only_if_the_blocks_parent_and_tokens_are_the_requests():
    """The hash only finds a candidate (cache/block_hash.py): another block under the same hash,
    or the same tokens after another parent, is a miss."""
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    assert pool.cache_block(b, h(7), NONE_HASH, (1, 2, 3))
    assert pool.get_cached_block(h(7), NONE_HASH, (1, 2, 3)) == b
    assert pool.get_cached_block(h(7), NONE_HASH, (3, 2, 1)) is None
    assert pool.get_cached_block(h(7), h(1), (1, 2, 3)) is None
    assert not pool.cache_block(1, h(7), NONE_HASH, (3, 2, 1))  # the first block under a hash keeps it
    pool.free([b])
    pool.allocate(2)  # evicting it clears its identity with its hash
    assert pool.blocks[b].block_hash is None and pool.blocks[b].tokens is None and pool.blocks[b].parent is None
