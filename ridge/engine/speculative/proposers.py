"""Draft proposers behind one interface: propose(out) -> request id -> Draft, for
the scheduled requests that reserved draft slots (ScheduledRequest.num_spec_tokens).
A proposer never edits the plan; the scheduler fits the plan to the drafts
(Scheduler.accept_drafts). Model drafters also return the draft distribution
that the rejection rule needs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..request import RequestStatus
from ..step_batch import plan_step, token_meta


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None  # [len, V] the distribution they were drawn from (sampled model drafts)
    source: str  # the proposer's name, for the policy's acceptance figures


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the request's last
    n tokens in its own prompt and output, and propose what followed it."""
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, ids: list[int], k: int) -> list[int]:
        arr = np.asarray(ids, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every earlier n-gram
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                # Copy what followed the match. A match that ends near the end of the text
                # runs into the drafts themselves, as in an LZ77 copy: a repeating phrase
                # drafts k tokens of repeats, not just what is left of one period.
                start = int(hits[-1]) + n
                out = ids[start:start + k]
                while len(out) < k:
                    out.append(out[len(out) - (len(ids) - start)])
                return out
        return []

    def propose(self, out) -> dict[str, Draft]:
        return {s.request.request_id: Draft(self.lookup(s.request.all_token_ids, s.num_spec_tokens), None, self.name)
                for s in out.scheduled if s.num_spec_tokens}


class _ModelDrafter:
    """Autoregressive drafting with a model over paged KV, one token per request per pass."""
    name: str
    sampler = None
    block_size: int
    device: torch.device

    def _feed(self, model, kv_layers, items, tokens, positions, num_layers=None) -> torch.Tensor:
        """One token per item at its position: writes their KV -> hidden states."""
        meta = token_meta(items, positions, self.block_size, self.device)
        return model(torch.tensor(tokens, device=self.device), torch.tensor(positions, device=self.device), meta,
                     kv_layers, num_layers=num_layers)

    def _single_token_pass(self, model, kv_layers, items, tokens, positions, num_layers=None) -> torch.Tensor:
        return model.compute_logits(self._feed(model, kv_layers, items, tokens, positions, num_layers))

    def _pick(self, logits: torch.Tensor, items) -> tuple[list[int], torch.Tensor | None]:
        reqs = [s.request for s in items]
        if all(r.params.greedy for r in reqs):
            return logits.argmax(-1).tolist(), None
        q = self.sampler.probs(logits, reqs)
        greedy = torch.tensor([r.params.greedy for r in reqs], device=q.device)
        q = torch.where(greedy[:, None], torch.nn.functional.one_hot(logits.argmax(-1), q.shape[-1]).to(q.dtype), q)
        return (q / self.sampler.noise(q, reqs)).argmax(-1).tolist(), q

    def _draft(self, model, kv_layers, items, first_logits, num_layers=None) -> dict[str, Draft]:
        """items' first draft comes from first_logits; k - 1 more passes follow."""
        drafts = [[] for _ in items]
        probs = [[] for _ in items]
        logits, live = first_logits, list(range(len(items)))
        while True:
            toks, q = self._pick(logits, [items[i] for i in live])
            for j, i in enumerate(live):
                drafts[i].append(toks[j])
                if q is not None:
                    probs[i].append(q[j])
            live = [i for i in live if len(drafts[i]) < items[i].num_spec_tokens]
            if not live:
                break
            logits = self._single_token_pass(model, kv_layers, [items[i] for i in live],
                                             [drafts[i][-1] for i in live],
                                             [items[i].start + len(drafts[i]) for i in live], num_layers)
        return {s.request.request_id: Draft(d, torch.stack(p) if p else None, self.name)
                for s, d, p in zip(items, drafts, probs)}


class _StateDrafter(_ModelDrafter):
    """A drafter on the target's final hidden states (mtp.py, assistant.py): the runner hands each
    forward's over (on_forward), and the next drafting reads the positions the target kept."""
    pending = None  # (SchedulerOutput, StepBatch, hidden [T, H]) of the target's latest forward

    def _init_states(self) -> None:
        self.pending = None
        self.last: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (position, state): a round's input
        self.chain: dict[str, torch.Tensor] = {}  # request id -> the drafter's state, while drafting

    def on_forward(self, out, batch, hidden) -> None:
        self.pending = out, batch, hidden

    def on_finish(self, request_id: str) -> None:
        self.last.pop(request_id, None)

    def _kept(self, out) -> tuple[list, torch.Tensor | None]:
        """The latest forward's requests still running, each (the item with its current block
        table, first position, positions kept, first row), and the forward's hidden states."""
        if self.pending is None:
            return [], None
        prev, batch, hidden = self.pending
        self.pending = None
        now = {s.request.request_id: s for s in out.scheduled}
        spans = []
        for s in prev.scheduled:
            r = s.request
            cur = now.get(r.request_id)  # scheduled again: schedule() counted its new tokens as computed
            kept = min(cur.start if cur is not None else r.num_computed_tokens, s.start + s.num_scheduled_tokens)
            if r.status == RequestStatus.RUNNING and kept > s.start:
                spans.append((cur or s, s.start, kept - s.start, batch.last_row[id(s)] - s.num_scheduled_tokens + 1))
        return spans, hidden

    def _ready(self, out) -> list:
        """The speculating requests whose state at the position before their start is known,
        with the drafting chain seeded from it."""
        items = [s for s in out.scheduled if s.num_spec_tokens
                 and self.last.get(s.request.request_id, (-2,))[0] == s.start - 1]
        self.chain = {s.request.request_id: self.last[s.request.request_id][1] for s in items}
        return items


class SelfDraftProposer(_ModelDrafter):
    """The target's own first L layers plus its final norm and head. Their KV
    for accepted tokens is exactly the target's, so the draft reads and writes
    the target's cache and costs no memory; the verification pass rewrites the
    drafted positions with all layers."""

    def __init__(self, num_layers: int, model, kv_cache, sampler):
        self.num_layers, self.model, self.sampler = num_layers, model, sampler
        self.layers = kv_cache.layers[:num_layers]
        self.block_size, self.device = kv_cache.block_size, model.cos_sin.device
        self.name = f"self:{num_layers}"

    def propose(self, out) -> dict[str, Draft]:
        return self.propose_items([s for s in out.scheduled if s.num_spec_tokens])

    def propose_items(self, items) -> dict[str, Draft]:
        if not items:
            return {}
        first = self._single_token_pass(self.model, self.layers, items,
                                        [s.request.all_token_ids[s.start] for s in items],
                                        [s.start for s in items], self.num_layers)
        return self._draft(self.model, self.layers, items, first, self.num_layers)


class DraftModelProposer(_ModelDrafter):
    """A smaller model with the same tokenizer and its own paged KV cache,
    indexed by the target's block ids (one block = target KV + draft KV, so one
    pool accounts for both). It runs every step's known tokens to stay in step
    with the target, then drafts for the requests that speculate."""

    def __init__(self, loaded, kv_cache, sampler, step_buffers):
        self.loaded, self.kv_cache, self.sampler, self.bufs = loaded, kv_cache, sampler, step_buffers
        self.block_size, self.device = kv_cache.block_size, loaded.model.cos_sin.device
        self.name = f"draft:{loaded.path.name}"
        # request id -> (its last draft, that draft's position): drafting never feeds the last
        # draft back, so when the target accepts all of them, that position has no draft KV.
        self.unfed: dict[str, tuple[int, int]] = {}

    def propose(self, out) -> dict[str, Draft]:
        model, layers = self.loaded.model, self.kv_cache.layers
        self._feed_accepted_last_drafts(out)
        batch = plan_step(out, self.block_size, self.bufs, include_spec=False)
        h = model(batch.input_ids, batch.positions, batch.meta, layers)
        items = [s for s in out.scheduled if s.num_spec_tokens]
        if not items:
            return {}
        last = [batch.last_row[id(s)] for s in items]
        drafts = self._draft(model, layers, items, model.compute_logits(h[torch.tensor(last, device=self.device)]))
        self.unfed = {s.request.request_id: (drafts[s.request.request_id].token_ids[-1], s.start + s.num_spec_tokens)
                      for s in items}
        return drafts

    def _feed_accepted_last_drafts(self, out) -> None:
        """As gpt-fast does: a request that starts right after its last draft had every draft
        accepted, so that draft's KV is written now, before the draft model reads past it."""
        fed = [(s, self.unfed[s.request.request_id]) for s in out.scheduled
               if self.unfed.get(s.request.request_id, (0, -2))[1] == s.start - 1]
        if fed:
            self._feed(self.loaded.model, self.kv_cache.layers, [s for s, _ in fed],
                       [tok for _, (tok, _) in fed], [pos for _, (_, pos) in fed])


class AutoProposer:
    """Per request, the drafter with the better observed acceptance: prompt
    lookup when it finds a match (it is free), the self-draft otherwise, unless
    the self-draft's acceptance (the request's, or overall before the request
    has its own) is below the policy's floor."""
    name = "auto"

    def __init__(self, ngram: NgramProposer, selfdraft: SelfDraftProposer, policy):
        self.ngram, self.selfdraft, self.policy = ngram, selfdraft, policy

    def propose(self, out) -> dict[str, Draft]:
        drafts, model_items = {}, []
        for s in out.scheduled:
            if not s.num_spec_tokens:
                continue
            r = s.request
            found = self.ngram.lookup(r.all_token_ids, s.num_spec_tokens)
            by = self.policy.by_source.get(r.request_id, {})
            ng, sd = by.get(self.ngram.name), by.get(self.selfdraft.name)
            if found and (ng is None or sd is None or ng.rate() >= sd.rate()):
                drafts[r.request_id] = Draft(found, None, self.ngram.name)
            elif self.policy.worth_drafting(r.request_id, self.selfdraft.name):
                model_items.append(s)
            # else the self-draft has shown it rarely lands: this step runs without drafts
        drafts.update(self.selfdraft.propose_items(model_items))
        return drafts
