"""Gemma 4's assistant drafter as a proposer (ridge/models/gemma4/assistant.py), driven as
transformers' Gemma4AssistantCandidateGenerator drives it: a request whose last known token sits
at position P drafts from the target's final hidden state at P - 1 and that token; every draft of
the round runs at position P over the target's K and V before P (its last full and last sliding
layer's, in the target's own blocks), feeding back the drafted token and the assistant's state.
It keeps no KV, so nothing needs feeding between rounds: only the target's hidden state at each
request's last kept position, which the runner hands over after each forward (on_forward)."""
from __future__ import annotations

import torch

from ridge.kernels.metadata import AttentionMetadata

from .proposers import Draft, _StateDrafter


class AssistantProposer(_StateDrafter):
    def __init__(self, assistant, target_cache, sampler):
        self.assistant, self.target_cache, self.sampler = assistant, target_cache, sampler
        self.block_size, self.device = target_cache.block_size, assistant.pre_projection.device
        self.name = assistant.name
        self._init_states()  # last: each request's last kept position and the target's state there
        # the assistant's KV groups -> the target's of the same window (whose block table they read)
        windows = [g.window for g in assistant.target[0].cfg.kv_groups()]
        self.groups = [windows.index(g.window) for g in assistant.cfg.kv_groups()]

    def propose(self, out) -> dict[str, Draft]:
        spans, hidden = self._kept(out)
        for s, start, m, row in spans:
            self.last[s.request.request_id] = start + m - 1, hidden[row + m - 1]
        items = self._ready(out)
        if not items:
            return {}
        first = self._single_token_pass(self.assistant, None, items, [s.request.all_token_ids[s.start] for s in items],
                                        [s.start for s in items])
        return self._draft(self.assistant, None, items, first)

    def _single_token_pass(self, model, kv_layers, items, tokens, positions, num_layers=None) -> torch.Tensor:
        """A drafting pass: every draft of a round runs at the round's position, the request's start."""
        rids = [s.request.request_id for s in items]
        logits, state = self.assistant(torch.tensor(tokens, device=self.device),
                                       torch.stack([self.chain[r] for r in rids]),
                                       torch.tensor([s.start for s in items], device=self.device),
                                       self._meta(items), self.target_cache.layers)
        self.chain.update(zip(rids, state))
        return logits

    def _meta(self, items) -> AttentionMetadata:
        """One query a request over the target's keys before its start, in each of the assistant's
        KV groups through the target's table of the same window."""
        starts = [s.start for s in items]

        def over(g: int) -> AttentionMetadata:
            tables = [s.block_ids if g == 0 else s.group_rows[g - 1] for s in items]
            slots = [int(t[(p - 1) // self.block_size]) * self.block_size + (p - 1) % self.block_size
                     for t, p in zip(tables, starts)]  # never written: every assistant layer shares the target's
            return AttentionMetadata.build([1] * len(items), starts, tables, slots, self.device)
        metas = [over(g) for g in self.groups]
        metas[0].groups = tuple(metas[1:])
        return metas[0]
