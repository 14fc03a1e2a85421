"""A checkpoint's own draft head as a proposer: Qwen3.5's multi-token prediction
(ridge/models/qwen3_5/mtp.py). The head at position p reads the target's final hidden state
there and the token after it, and predicts the token after that.

Its KV lives in the target's blocks (like a draft model's), so every position the target
computed is fed to the head once the token after it is known: at the next step's drafting,
from the hidden states the runner handed over (on_forward), up to the tokens the target kept
(a rejected draft's positions are never fed). The head's state at a request's last fed
position gives its first draft; each further draft feeds the head its own state and the draft
token one position on. Those drafting passes write KV past the fed positions, which the next
feed rewrites before anything reads it."""
from __future__ import annotations

import torch

from ridge.kernels.metadata import AttentionMetadata

from .proposers import Draft, _StateDrafter


class MTPProposer(_StateDrafter):
    name = "mtp"

    def __init__(self, head, kv_cache, sampler):
        self.head, self.kv_cache, self.sampler = head, kv_cache, sampler
        self.block_size, self.device = kv_cache.block_size, head.fc.weight.device
        self._init_states()  # last: each request's last fed position and the head's state there

    def propose(self, out) -> dict[str, Draft]:
        self._feed_kept(out)
        items = self._ready(out)
        if not items:
            return {}
        first = self.head.compute_logits(torch.stack(list(self.chain.values())))
        return self._draft(self.head, self.kv_cache.layers, items, first)

    def _single_token_pass(self, model, kv_layers, items, tokens, positions, num_layers=None) -> torch.Tensor:
        """A drafting pass: _draft's position is the drafted token's own; the head runs one
        position before it (it reads the token after its position)."""
        rids = [s.request.request_id for s in items]
        at = [p - 1 for p in positions]
        meta = self._meta(items, at, [1] * len(items))
        g = self.head(torch.tensor(tokens, device=self.device), torch.stack([self.chain[r] for r in rids]),
                      torch.tensor(at, device=self.device), meta, kv_layers[0])
        self.chain.update(zip(rids, g))
        return self.head.compute_logits(g)

    def _feed_kept(self, out) -> None:
        """The latest target step's kept positions, whose next token is now known, through the head."""
        feeds, hidden = self._kept(out)
        if not feeds:
            return
        ids, pos, rows = [], [], []
        for s, start, m, row in feeds:
            toks = s.request.all_token_ids
            ids += [toks[p + 1] for p in range(start, start + m)]
            pos += range(start, start + m)
            rows += range(row, row + m)
        meta = self._meta([s for s, *_ in feeds], [start for _, start, _, _ in feeds], [m for *_, m, _ in feeds])
        states = hidden.index_select(0, torch.tensor(rows, device=self.device))
        g = self.head(torch.tensor(ids, device=self.device), states, torch.tensor(pos, device=self.device), meta,
                      self.kv_cache.layers[0])
        end = 0
        for s, start, m, _ in feeds:
            end += m
            self.last[s.request.request_id] = start + m - 1, g[end - 1]

    def _meta(self, items, starts: list[int], counts: list[int]) -> AttentionMetadata:
        """counts[i] query tokens of items[i] from position starts[i], over its block table."""
        bs = self.block_size
        slots = [s.block_ids[p // bs] * bs + p % bs for s, a, n in zip(items, starts, counts) for p in range(a, a + n)]
        return AttentionMetadata.build(counts, [a + n for a, n in zip(starts, counts)], [s.block_ids for s in items],
                                       slots, self.device)
