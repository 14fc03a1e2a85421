"""The state cache beside the paged KV: a hybrid model's recurrent states (Gated DeltaNet, LFM2's
short convolutions), one slot per running request.

A linear-attention layer keeps no KV that grows with the context. Per request it keeps the
delta rule's state, a [Dk, Dv] matrix per value head, and the short convolution's window, the
last K - 1 inputs of its q/k/v channels (an LFM2 convolution layer keeps the window alone): the
same bytes at 1K and at 1M tokens. Each such layer holds a pool of each (ModelConfig.state_shapes),
indexed by slot (kernels/varlen.py), and a request owns one slot, the same in every layer, from
admission to its finish, abort or preemption (StateSlots: the scheduler's check/act pair, as it
asks the block pool for blocks). Attention metadata carries each sequence's slot and whether it
continues from the slot's state (a later prefill chunk, a decode) or starts from zeros (its
first chunk: a preempted request recomputes from its prompt).

Speculative decoding: a verified span (the last token and k drafts) leaves the state after all
of them in the request's slot, and the state after each earlier token in a scratch slot
(StateSlots.scratch). When a draft is rejected, the state after the last accepted token is
copied back into the request's slot (restore), so the next step continues from exactly the
state plain decoding would have.

Prefix caching (StateCheckpoints): a KV hit of b blocks is only as good as the recurrent state
after its last token, so the state after each block boundary of a prompt is kept in a
checkpoint slot under that block's chain hash (cache/block_hash.py: it names the whole prefix
and the cache salt). A hit is cut back to the longest prefix whose last block has a checkpoint,
whose state is copied into the request's slot before its first step. Checkpoints are few
(each is a whole state) and evicted least recently used; a hit that finds none computes from
zeros, as without the cache.

States stay fp32: the recurrence multiplies them by its decay at every token, and rounding them
to bf16 at every step would drift from the oracle; they are small beside KV at any real context."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ridge.config import ModelConfig

STATE_DTYPE = torch.float32


@dataclass
class LayerState:
    """One linear-attention layer's pools: what the model's layer gets in place of its LayerKV.
    Each pool a layer kind declares (ModelConfig.state_shapes) is here; the others are None."""
    conv: torch.Tensor  # [slots, K - 1, channels]: the convolution's window, oldest input first
    recurrent: torch.Tensor | None = None  # [slots, Hv, Dk, Dv]: the delta rule's state; None: a short convolution

    def pools(self) -> list[torch.Tensor]:
        return [t for t in (self.conv, self.recurrent) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.pools())


def layer_state(cfg: ModelConfig, num_slots: int, device) -> LayerState:
    return LayerState(**{name: torch.zeros((num_slots, *shape), dtype=STATE_DTYPE, device=device)
                         for name, shape in cfg.state_shapes().items()})


def restore(layers, dst: int, src: int) -> None:
    """Every linear layer's states at slot src copied into slot dst (a speculative step's rollback:
    src holds the state after the last accepted token)."""
    for st in layers:
        if isinstance(st, LayerState):
            for pool in st.pools():
                pool[dst].copy_(pool[src])


class StateSlots:
    """The slots of the state pools, by request: the free list is this object's alone. A slot's
    contents need no clearing when it changes hands: a request's first chunk starts from zeros
    (has_initial_state false), whatever the slot held."""

    def __init__(self, num_slots: int, num_spec_tokens: int = 0):
        """num_spec_tokens: the most drafts a request verifies in a step. Speculation keeps the state
        after each of a request's verified tokens but its last in a scratch slot of its own
        (kernels' token_state_slots), to roll back to: num_slots x num_spec_tokens of them after
        the requests' slots (pool_size)."""
        assert num_slots >= 1, "a state pool needs a slot"
        self.num_slots, self.num_spec_tokens = num_slots, num_spec_tokens
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._owner: dict[str, int] = {}

    @property
    def pool_size(self) -> int:
        """The slots each layer's pools hold: the requests' and the speculative scratch slots."""
        return self.num_slots * (1 + self.num_spec_tokens)

    def scratch(self, slot: int, j: int) -> int:
        """Where the state after token j of slot's request's verified span is kept (j < num_spec_tokens)."""
        assert 0 <= j < self.num_spec_tokens, f"token {j} of a span of at most {self.num_spec_tokens} drafts"
        return self.num_slots + slot * self.num_spec_tokens + j

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, request_id: str) -> bool:
        return request_id in self._owner or bool(self._free)

    def allocate(self, request_id: str) -> int:
        """The request's slot, taken now unless it holds one."""
        if request_id not in self._owner:
            if not self._free:
                raise RuntimeError("no free state slot (check can_allocate first)")
            self._owner[request_id] = self._free.pop()
        return self._owner[request_id]

    def slot(self, request_id: str) -> int:
        return self._owner[request_id]

    def free(self, request_id: str) -> None:
        """Give the request's slot back (finish, abort, preemption); nothing where it holds none."""
        s = self._owner.pop(request_id, None)
        if s is not None:
            self._free.append(s)


class StateCheckpoints:
    """Checkpoint slots of the state pools (slots first .. first + count - 1), by block hash,
    least recently used first. A checkpoint is written by the step that computes its block's
    last token (token_state_slots) and read by a later request's admission (find)."""

    def __init__(self, first: int, count: int):
        assert count >= 1, "a checkpoint store needs a slot"
        self.first, self.count = first, count
        self._free = list(range(first + count - 1, first - 1, -1))
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()
        self._writing: set[int] = set()  # slots this step writes: not evicted again within it

    def longest(self, hashes: list[bytes], num_blocks: int) -> int:
        """The most of the first num_blocks blocks a hit may keep: up to the last with a checkpoint."""
        for m in range(num_blocks, 0, -1):
            if hashes[m - 1] in self._by_hash:
                return m
        return 0

    def find(self, h: bytes) -> int:
        """The checkpoint slot of block hash h (now the most recently used)."""
        self._by_hash.move_to_end(h)
        return self._by_hash[h]

    def begin_step(self) -> None:
        self._writing.clear()

    def take(self, h: bytes) -> int | None:
        """A slot to write block h's state into this step; None where h has one already, or where
        every slot is written this step (the checkpoint is skipped: a later hit computes more)."""
        if h in self._by_hash:
            self._by_hash.move_to_end(h)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, v in self._by_hash.items() if v not in self._writing), None)
            if victim is None:
                return None
            slot = self._by_hash.pop(victim)
        self._by_hash[h] = slot
        self._writing.add(slot)
        return slot

    def __len__(self) -> int:
        return len(self._by_hash)
