"""Attention metadata for one flattened, variable-length batch.

One layout serves every step: prefill chunks, decodes, prefix hits and
speculative tokens are all "query tokens appended to a context"."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token, -1 = skip
    block_table: torch.Tensor  # [B, max_blocks] int32: physical blocks of each sequence, in order
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence once this step's tokens are in
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths (flash-attn's cu_seqlens_q)
    # Host copies, so that a reference path can plan its work without device syncs.
    seq_lens_host: list[int]
    query_lens_host: list[int]
    # Each backend's own state for this step, keyed by its builder (state_for): what it derives
    # from the step's batch once and every layer then reuses. No backend reads another's.
    states: dict = field(default_factory=dict)
    # The same batch over the block tables of KV groups 1.. (ModelConfig.kv_groups(): sliding
    # layers hold their own blocks): each its own slot mapping, block table and states, the
    # lengths shared. Empty: one table serves every group.
    groups: tuple = ()
    # Every query row computed alike whatever else the step holds (deterministic mode): a backend
    # must not choose its path or split by the batch's shape.
    batch_invariant: bool = False
    # A hybrid model's linear-attention layers (cache/state_cache.py): each sequence's slot in the
    # state pools and whether it continues from the state there (1) or starts from zeros (0, its
    # first chunk); query_start_loc bounds its tokens. [B] int64 and [B] bool; None in a model without them.
    state_slots: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    # [T] int64 or None: where the state after each token is also kept (-1: nowhere), for a
    # speculative step's rollback (cache/state_cache.py).
    token_state_slots: torch.Tensor | None = None
    # Bidirectional runs (ModelConfig.image_attention_bidirectional: an image's tokens): per
    # sequence, the [start, end) positions whose queries also see the run's later keys (Gemma 3's
    # block mask: causal OR same run, and inside a sliding window). Each lies wholly among its
    # sequence's queries of this step (the scheduler never splits one). None: causal everywhere.
    spans: tuple | None = None
    # Multimodal rotary positions (ridge/models/layers/mrope.py): (rows [k], their (t, h, w)
    # positions [3, k]) of the step's image tokens, which rotate by three positions; None: every
    # row rotates by its one position.
    mrope: tuple | None = None

    def group(self, g: int) -> "AttentionMetadata":
        """The metadata a layer of KV group g reads and writes through."""
        return self.groups[g - 1] if g and self.groups else self

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    def key_ends_host(self) -> list[int] | None:
        """[T]: one past the last key each query sees (its position + 1, or its run's end), on the
        host; None without spans."""
        if not self.spans:
            return None
        ends = []
        for L, n, runs in zip(self.seq_lens_host, self.query_lens_host, self.spans):
            lim = list(range(L - n + 1, L + 1))
            for a, b in runs:
                assert L - n <= a < b <= L, f"a bidirectional run [{a}, {b}) outside its step's queries [{L - n}, {L})"
                lim[a - (L - n):b - (L - n)] = [b] * (b - a)
            ends += lim
        return ends

    def key_ends(self) -> torch.Tensor | None:
        """key_ends_host as [T] int32 on the metadata's device, made once per step."""
        return None if not self.spans else self.state_for(_key_ends, None)

    def state_for(self, build, key, *args):
        """build(self, *args): a backend's state for this step (as vLLM's attention backends each
        build their own metadata), made by the first layer that asks and kept for the others;
        made again where key differs from the one it was built for (a cache of another shape)."""
        held = self.states.get(build)
        if held is None or held[0] != key:
            held = self.states[build] = (key, build(self, *args))
        return held[1]

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              slot_mapping: list[int], device: torch.device | str = "cpu",
              state_slots: list[int] | None = None, spans: list | None = None) -> "AttentionMetadata":
        """state_slots: each sequence's state slot (default: slot i for sequence i); a sequence
        with keys before its queries continues from its slot's state. spans: each sequence's
        bidirectional runs (the field's comment), or None."""
        width = max((len(b) for b in block_tables), default=0)
        table = torch.zeros((len(block_tables), max(width, 1)), dtype=torch.int32)
        for i, blocks in enumerate(block_tables):
            if len(blocks):
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_table=table.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens_host=list(seq_lens),
            query_lens_host=list(query_lens),
            state_slots=torch.tensor(state_slots if state_slots is not None else range(len(seq_lens)),
                                     dtype=torch.int64, device=device),
            has_initial_state=torch.tensor([s > q for s, q in zip(seq_lens, query_lens)], dtype=torch.bool,
                                           device=device),
            spans=None if spans is None else tuple(tuple(map(tuple, runs)) for runs in spans),
        )


def _key_ends(meta: AttentionMetadata) -> torch.Tensor:
    return torch.tensor(meta.key_ends_host(), dtype=torch.int32).to(meta.seq_lens.device)
