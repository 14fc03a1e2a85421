"""The KV cache manager over a real block pool: no model, no tensors (as vLLM's tests/v1/core).

Block size 4 throughout, so a prompt of 10 tokens fills two blocks and starts a third."""
import hashlib
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ridge.cache.block_hash import keyed_blake2b
from ridge.cache.manager import KVCacheManager

BS = 4


def computed(kv: KVCacheManager, req_id: str, token_ids: list[int], num_tokens: int | None = None) -> list[int]:
    """Allocate for token_ids and mark the first num_tokens of them computed, as the scheduler does."""
    blocks = kv.allocate(req_id, len(token_ids))
    kv.cache_blocks(req_id, token_ids, len(token_ids) if num_tokens is None else num_tokens)
    return list(blocks)


# --- chained hashes ------------------------------------------------------------------------

def order_blind(data: bytes) -> bytes:
    """A deliberately weak block hash: blind to the order of the bytes it hashes, so a block and
    its tokens reversed collide (and so do their children)."""
    return hashlib.blake2b(bytes(sorted(data)), digest_size=16).digest()


def reversed_blocks(tokens: list[int], bs: int = BS) -> list[int]:
    """The same tokens, each full block reversed: under order_blind, every block collides."""
    return [t for i in range(0, len(tokens), bs) for t in tokens[i:i + bs][::-1]]


def test_only_full_blocks_are_hashed():
    kv = KVCacheManager(8, BS)
    assert len(kv.chain(list(range(11)))) == 2 and kv.chain([1, 2, 3]) == []
    assert all(isinstance(h, bytes) and len(h) == 16 for h in kv.chain(list(range(11))))


def test_a_hash_names_the_whole_prefix_not_just_its_block():
    kv = KVCacheManager(8, BS)
    a = kv.chain([1, 2, 3, 4, 5, 6, 7, 8])
    assert kv.chain([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a
    b = kv.chain([0, 2, 3, 4, 5, 6, 7, 8])  # same second block after a different first
    assert a[0] != b[0] and a[1] != b[1]


def test_hashing_continues_from_a_parent():
    kv = KVCacheManager(8, BS)
    t = list(range(20))
    full = kv.chain(t)
    assert kv.hasher.chain(t, BS, parent=full[1], start=2 * BS) == full[2:]


def test_hashes_are_keyed_the_same_key_hashing_alike_in_every_process():
    """Random per manager, so nobody can aim a prompt at another's hash; one key (the disk
    tier's) gives the same hashes in every process, so that its files are found again."""
    assert KVCacheManager(8, BS).chain(list(range(12))) != KVCacheManager(8, BS).chain(list(range(12)))
    key = bytes(range(32))
    code = ("from ridge.cache.block_hash import keyed_blake2b; from ridge.cache.manager import KVCacheManager; "
            f"print([h.hex() for h in KVCacheManager(8, {BS}, hash_fn=keyed_blake2b({key!r})).chain(list(range(12)))])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    here = KVCacheManager(8, BS, hash_fn=keyed_blake2b(key)).chain(list(range(12)))
    assert outs == {f"{[h.hex() for h in here]}\n"}


def test_the_salt_starts_the_chain():
    kv = KVCacheManager(16, BS)
    prompt = list(range(10))
    assert kv.chain(prompt, "alice") != kv.chain(prompt, "bob") != kv.chain(prompt)
    kv.allocate("a", 10)
    kv.cache_blocks("a", prompt, 10, salt="alice")
    assert kv.get_computed_blocks("b", prompt, "bob") == ([], 0)
    assert kv.get_computed_blocks("c", prompt) == ([], 0)
    assert kv.get_computed_blocks("d", prompt, "alice") == (kv.block_ids("a")[:2], 8)


def test_blocks_that_collide_under_a_weak_hash_are_not_hits():
    """The device pool compares the block's tokens (and parent) on every hit: with a hash that
    collides, the second prompt gets no hit and no block of the first."""
    kv = KVCacheManager(16, BS, hash_fn=order_blind)
    a, b = list(range(1, 13)), reversed_blocks(list(range(1, 13)))
    assert kv.chain(a) == kv.chain(b) and a != b  # the collision is real
    computed(kv, "a", a)
    assert kv.get_computed_blocks("b", b + [0]) == ([], 0)
    assert kv.get_computed_blocks("a2", a + [0]) == (kv.block_ids("a"), 12)  # the same prompt still hits


def test_the_hash_changes_only_before_any_request():
    kv = KVCacheManager(8, BS)
    kv.set_hash(order_blind)
    computed(kv, "a", list(range(8)))
    with pytest.raises(AssertionError, match="before any request"):
        kv.set_hash(keyed_blake2b(bytes(32)))


# --- allocation ----------------------------------------------------------------------------

def test_a_request_holds_the_blocks_its_tokens_need():
    kv = KVCacheManager(8, BS)
    first = list(kv.allocate("r", 5))
    assert len(first) == 2 and kv.num_used_blocks == 2
    grown = kv.allocate("r", 9)  # growing keeps the blocks it has
    assert grown[:2] == first and len(grown) == 3 and kv.block_ids("r") == grown
    assert kv.allocate("r", 12) == grown and kv.num_used_blocks == 3
    kv.free("r")
    assert kv.num_free_blocks == 8 and kv.block_ids("r") == []


def test_can_allocate_agrees_with_allocate_at_exhaustion():
    kv = KVCacheManager(4, BS)
    kv.allocate("a", 8)
    assert kv.can_allocate("b", 8) and not kv.can_allocate("b", 9)
    assert kv.can_allocate("a", 16) and not kv.can_allocate("a", 17)  # counts what a already holds
    with pytest.raises(ValueError):
        kv.allocate("b", 9)
    assert kv.num_free_blocks == 2 and kv.block_ids("b") == []
    assert len(kv.allocate("b", 8)) == 2 and kv.num_free_blocks == 0


def test_a_refused_allocation_with_prefix_hits_changes_nothing():
    kv = KVCacheManager(4, BS)
    prompt = list(range(13))
    computed(kv, "a", prompt[:12])
    kv.free("a")
    kv.allocate("x", 1)  # takes the one block a never used
    hits, n = kv.get_computed_blocks("b", prompt)
    assert n == 12 and not kv.can_allocate("b", 13, hits)  # 3 revived + 1 new > 3 free
    with pytest.raises(ValueError):
        kv.allocate("b", 13, hits)
    assert kv.num_free_blocks == 3 and kv.block_ids("b") == []
    assert all(kv.pool.blocks[h].ref_cnt == 0 for h in hits)


# --- prefix caching ------------------------------------------------------------------------

def test_a_lookup_counts_once_when_the_request_is_admitted():
    """A request that waits for room is looked up again every step; the hit rate counts the
    lookup that admitted it, once, and none for a request aborted while it waited."""
    kv = KVCacheManager(4, BS)
    prompt = list(range(13))
    computed(kv, "a", prompt[:12])
    kv.free("a")
    kv.allocate("x", 1)
    for _ in range(3):  # three steps without room
        hits, n = kv.get_computed_blocks("b", prompt)
        assert not kv.can_allocate("b", 13, hits)
    assert (kv.prefix_queries, kv.prefix_hits, kv.device_hits) == (0, 0, 0)
    kv.free("x")
    hits, n = kv.get_computed_blocks("b", prompt)
    kv.allocate("b", 13, hits)
    assert (kv.prefix_queries, kv.prefix_hits, kv.device_hits, kv.device_misses) == (13, 12, 3, 0)
    kv.free("b")
    kv.get_computed_blocks("c", [7] * 9)
    kv.free("c")  # aborted while waiting
    kv.allocate("c", 9)
    assert (kv.prefix_queries, kv.device_misses) == (13, 0)


def test_the_same_prefix_hits_and_a_different_earlier_block_misses():
    kv = KVCacheManager(16, BS)
    a = computed(kv, "a", list(range(10)))
    assert kv.get_computed_blocks("b", list(range(8)) + [99, 98, 97]) == (a[:2], 8)
    assert kv.get_computed_blocks("c", [99] + list(range(1, 10))) == ([], 0)
    assert kv.get_computed_blocks("d", [0, 1, 2, 3, 9, 9, 9, 9, 9]) == (a[:1], 4)


def test_the_last_token_is_never_a_hit():
    kv = KVCacheManager(16, BS)
    a = computed(kv, "a", list(range(8)))
    assert kv.get_computed_blocks("b", list(range(8))) == (a[:1], 4)  # its logits pick the next token
    assert kv.get_computed_blocks("c", list(range(9))) == (a[:2], 8)


def test_only_full_computed_blocks_are_published():
    kv = KVCacheManager(16, BS)
    tokens = list(range(12))
    kv.allocate("a", 12)
    for num_computed, published in ((3, 0), (6, 1), (11, 2), (12, 3)):
        kv.cache_blocks("a", tokens, num_computed)
        assert kv.pool.num_cached_blocks == published
    assert kv.get_computed_blocks("b", tokens + [0]) == (kv.block_ids("a"), 12)


def test_hits_on_freed_blocks_revive_them():
    kv = KVCacheManager(4, BS)
    prompt = list(range(16))
    a = computed(kv, "a", prompt[:12])
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 3
    hits, n = kv.get_computed_blocks("b", prompt)
    assert (hits, n) == (a, 12)
    assert kv.can_allocate("b", 16, hits)  # 3 revived + 1 new = 4 free
    blocks = kv.allocate("b", 16, hits)
    assert blocks[:3] == a and kv.num_free_blocks == 0
    assert not kv.can_allocate("c", 1)


def test_freed_prefixes_are_evicted_least_recent_first_and_tail_first():
    kv = KVCacheManager(6, BS)
    old = computed(kv, "old", list(range(100, 108)))
    new = computed(kv, "new", list(range(8)))
    kv.free("old")
    kv.free("new")
    kv.allocate("x", 4 * 3)  # the 2 blocks never used, then old's last block
    assert kv.get_computed_blocks("q", list(range(100, 109))) == (old[:1], 4)
    kv.allocate("y", 4)  # old's first block
    assert kv.get_computed_blocks("q", list(range(100, 109))) == ([], 0)
    assert kv.get_computed_blocks("q", list(range(9))) == (new, 8)


def test_n_samples_share_the_prompt_blocks():
    kv = KVCacheManager(8, BS)
    prompt = list(range(9))
    s0 = computed(kv, "s0", prompt)
    hits, n = kv.get_computed_blocks("s1", prompt)
    s1 = kv.allocate("s1", 9, hits)
    assert n == 8 and s1[:2] == s0[:2] and s1[2] != s0[2]
    assert [kv.pool.blocks[b].ref_cnt for b in s0] == [2, 2, 1]
    kv.free("s0")
    assert [kv.pool.blocks[b].ref_cnt for b in s1] == [1, 1, 1] and kv.num_used_blocks == 3
    kv.free("s1")
    assert kv.num_free_blocks == 8 and kv.pool.num_cached_blocks == 2


def test_without_caching_there_are_no_hits():
    kv = KVCacheManager(8, BS, enable_caching=False)
    computed(kv, "a", list(range(9)))
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks("b", list(range(9))) == ([], 0)


def test_hit_rate_counts_prompt_tokens_found():
    kv = KVCacheManager(8, BS)
    computed(kv, "a", list(range(9)))
    hits, _ = kv.get_computed_blocks("b", list(range(10)))
    kv.allocate("b", 10, hits)  # counted at admission
    assert kv.prefix_hit_rate == 8 / 10


# --- speculative rollback ------------------------------------------------------------------

def test_truncate_returns_the_blocks_only_rejected_drafts_used():
    kv = KVCacheManager(8, BS)
    tokens = [5, 6, 7, 8, 9]
    computed(kv, "r", tokens)  # one block published
    blocks = list(kv.allocate("r", 5 + 1 + 4))  # the next token and 4 drafts: 3 blocks
    kv.truncate("r", 7)  # 1 draft accepted
    assert kv.block_ids("r") == blocks[:2] and kv.num_used_blocks == 2
    assert kv.pool.blocks[blocks[2]].ref_cnt == 0
    tokens += [10, 11, 12]
    kv.cache_blocks("r", tokens, 7)
    assert kv.pool.num_cached_blocks == 1
    kv.cache_blocks("r", tokens, 8)  # the second block's hash chains from the first
    assert kv.get_computed_blocks("q", tokens + [0]) == (blocks[:2], 8)


def test_truncate_below_a_published_block_is_refused():
    kv = KVCacheManager(8, BS)
    tokens = list(range(6))
    blocks = computed(kv, "r", tokens)
    # Block 0 may already be another request's prefix hit: rewriting it would corrupt that request.
    with pytest.raises(AssertionError, match="published"):
        kv.truncate("r", 3)
    assert kv.block_ids("r") == blocks and kv.get_computed_blocks("q", tokens) == (blocks[:1], 4)


# --- invariants under any sequence of operations -------------------------------------------

class ManagerMachine(RuleBasedStateMachine):
    """Requests are admitted with prefix lookup, grow, compute, roll back drafts and leave,
    in any order. Beside the manager, `content` records which token each block slot holds,
    so that a prefix hit can be checked against what was really computed there."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(8, BS)
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.content: dict[int, list[int | None]] = {}
        self.next_id = 0

    def _live(self):
        return sorted(self.tokens)

    def _allocate(self, req_id, num_tokens, hits=()) -> bool:
        can = self.kv.can_allocate(req_id, num_tokens, hits)
        before = list(self.kv.block_ids(req_id))
        try:
            blocks = self.kv.allocate(req_id, num_tokens, hits)
        except ValueError:
            assert not can, "can_allocate said no room, yet allocate found it"
            return False
        assert can, "allocate succeeded where can_allocate said no room"
        for b in blocks[len(before) + len(hits):]:
            self.content[b] = [None] * BS
        return True

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, prompt):
        req_id, self.next_id = f"r{self.next_id}", self.next_id + 1
        hits, cached = self.kv.get_computed_blocks(req_id, prompt)
        assert cached == len(hits) * BS < len(prompt)
        for i, b in enumerate(hits):
            assert self.content[b] == prompt[i * BS:(i + 1) * BS], "a prefix hit on blocks holding other tokens"
        if self._allocate(req_id, len(prompt), hits):
            self.tokens[req_id], self.num_computed[req_id] = list(prompt), cached

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, data, new):
        req_id = data.draw(st.sampled_from(self._live()))
        if self._allocate(req_id, len(self.tokens[req_id]) + len(new)):
            self.tokens[req_id] += new

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data):
        req_id = data.draw(st.sampled_from(self._live()))
        tokens, blocks = self.tokens[req_id], self.kv.block_ids(req_id)
        upto = data.draw(st.integers(self.num_computed[req_id], len(tokens)))
        for p in range(self.num_computed[req_id], upto):
            slot = self.content[blocks[p // BS]]
            assert self.kv.pool.blocks[blocks[p // BS]].ref_cnt == 1 or slot[p % BS] == tokens[p], \
                "a write into a block another request shares"
            slot[p % BS] = tokens[p]
        self.num_computed[req_id] = upto
        self.kv.cache_blocks(req_id, tokens, upto)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def reject_drafts(self, data):
        req_id = data.draw(st.sampled_from(self._live()))
        keep = data.draw(st.integers(self.num_computed[req_id], len(self.tokens[req_id])))
        del self.tokens[req_id][keep:]
        self.kv.truncate(req_id, keep)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        req_id = data.draw(st.sampled_from(self._live()))
        self.kv.free(req_id)
        del self.tokens[req_id], self.num_computed[req_id]

    @invariant()
    def pool_is_consistent(self):
        pool = self.kv.pool
        queue, b = [], pool.free_queue.head.next
        while b is not pool.free_queue.tail:
            queue.append(b.block_id)
            b = b.next
        used = [blk.block_id for blk in pool.blocks if blk.ref_cnt > 0]
        assert all(blk.ref_cnt >= 0 for blk in pool.blocks)
        assert len(queue) == len(set(queue)) == pool.num_free_blocks
        assert not set(queue) & set(used), "a block both free and referenced"
        assert pool.num_free_blocks + len(used) == pool.num_blocks
        assert all(blk.block_hash == h for h, blk in pool.cached.items())
        assert sum(blk.block_hash is not None for blk in pool.blocks) == pool.num_cached_blocks

    @invariant()
    def references_are_the_requests_blocks(self):
        held = [b for req_id in self.tokens for b in self.kv.block_ids(req_id)]
        assert all(self.kv.pool.blocks[b].ref_cnt == held.count(b) for b in range(self.kv.num_blocks))
        for req_id, tokens in self.tokens.items():
            assert len(self.kv.block_ids(req_id)) == -(-len(tokens) // BS)


ManagerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_manager_keeps_its_invariants = ManagerMachine.TestCase


def test_block_rows_follow_the_block_lists_through_growth_truncation_and_free():
    """The block table is filled from each request's int32 row: it must always equal its list."""
    kv = KVCacheManager(64, BS)
    for n in (1, BS, BS + 1, 5 * BS, 40 * BS):  # past the row's first capacity (16 blocks)
        kv.allocate("a", n)
        assert kv.block_row("a").tolist() == kv.block_ids("a")
    kv.truncate("a", 3 * BS)  # rejected drafts roll back
    assert kv.block_row("a").tolist() == kv.block_ids("a") and len(kv.block_ids("a")) == 3
    kv.allocate("b", 2 * BS)  # another request takes the freed blocks
    kv.allocate("a", 6 * BS)
    assert kv.block_row("a").tolist() == kv.block_ids("a") and len(kv.block_ids("a")) == 6
    assert kv.block_row("b").tolist() == kv.block_ids("b")
    kv.free("a")
    kv.allocate("a", BS)
    assert kv.block_row("a").tolist() == kv.block_ids("a")
