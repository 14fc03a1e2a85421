"""Draft proposers behind one interface: propose(runner, out) fills each
speculating request's draft (at most its reserved k tokens) and, for model
drafters, the draft distribution that the rejection rule needs."""
from __future__ import annotations

import numpy as np
import torch

from ridge.kernels.metadata import AttentionMetadata


def _set_drafts(s, drafts: list[int], probs: torch.Tensor | None) -> None:
    """Shrink the reserved slots to the drafts actually proposed."""
    s.request.spec_token_ids = list(drafts)
    s.draft_probs = probs
    s.num_scheduled_tokens -= s.num_spec_tokens - len(drafts)
    s.num_spec_tokens = len(drafts)


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

    def propose(self, runner, out) -> None:
        for s in out.scheduled:
            if s.num_spec_tokens:
                s.request.draft_source = self.name
                _set_drafts(s, self.lookup(s.request.all_token_ids, s.num_spec_tokens), None)


class _ModelDrafter:
    """Autoregressive drafting with a model over paged KV, one token per request per pass."""

    def _single_token_pass(self, model, kv_layers, items, tokens, positions, num_layers=None) -> torch.Tensor:
        bs = self.block_size
        slots = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(items, positions)]
        meta = AttentionMetadata.build([1] * len(items), [p + 1 for p in positions], [s.block_ids for s in items],
                                       slots, self.device)
        h = model(torch.tensor(tokens, device=self.device), torch.tensor(positions, device=self.device), meta,
                  kv_layers, num_layers=num_layers)
        return model.compute_logits(h)

    def _pick(self, runner, logits: torch.Tensor, items) -> tuple[list[int], torch.Tensor | None]:
        reqs = [s.request for s in items]
        if all(r.params.greedy for r in reqs):
            return logits.argmax(-1).tolist(), None
        q = runner.sampler.probs(logits, reqs)
        greedy = torch.tensor([r.params.greedy for r in reqs], device=q.device)
        q = torch.where(greedy[:, None], torch.nn.functional.one_hot(logits.argmax(-1), q.shape[-1]).to(q.dtype), q)
        return (q / runner.sampler.noise(q, reqs)).argmax(-1).tolist(), q

    def _draft(self, runner, model, kv_layers, items, first_logits, num_layers=None) -> None:
        """items' first draft comes from first_logits; k - 1 more passes follow."""
        drafts = [[] for _ in items]
        probs = [[] for _ in items]
        logits, live = first_logits, list(range(len(items)))
        while True:
            toks, q = self._pick(runner, logits, [items[i] for i in live])
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
        for s, d, p in zip(items, drafts, probs):
            _set_drafts(s, d, torch.stack(p) if p else None)


class SelfDraftProposer(_ModelDrafter):
    """The target's own first L layers plus its final norm and head. Their KV
    for accepted tokens is exactly the target's, so the draft reads and writes
    the target's cache and costs no memory; the verification pass rewrites the
    drafted positions with all layers."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.name = f"self:{num_layers}"

    def propose(self, runner, out) -> None:
        items = [s for s in out.scheduled if s.num_spec_tokens]
        for s in items:
            s.request.draft_source = self.name
        if items:
            self.propose_items(runner, items)

    def propose_items(self, runner, items) -> None:
        self.block_size, self.device = runner.block_size, runner.device
        layers = runner.kv_cache.layers[: self.num_layers]
        first = self._single_token_pass(runner.model, layers, items,
                                        [s.request.all_token_ids[s.start] for s in items],
                                        [s.start for s in items], self.num_layers)
        self._draft(runner, runner.model, layers, items, first, self.num_layers)


class DraftModelProposer(_ModelDrafter):
    """A smaller model with the same tokenizer and its own paged KV cache,
    indexed by the target's block ids (one block = target KV + draft KV, so one
    pool accounts for both). It runs every step's known tokens to stay in step
    with the target, then drafts for the requests that speculate."""

    def __init__(self, loaded, kv_cache):
        self.loaded, self.kv_cache = loaded, kv_cache
        self.name = f"draft:{loaded.path.name}"

    def propose(self, runner, out) -> None:
        from ridge.engine.runner import StepBatch

        self.block_size, self.device = runner.block_size, runner.device
        batch = StepBatch(out, runner.block_size, runner.device, include_spec=False)
        h = self.loaded.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers)
        items = [s for s in out.scheduled if s.num_spec_tokens]
        if not items:
            return
        for s in items:
            s.request.draft_source = self.name
        last = [batch.last_row[id(s)] for s in items]
        self._draft(runner, self.loaded.model, self.kv_cache.layers, items,
                    self.loaded.model.compute_logits(h[torch.tensor(last, device=self.device)]))


class AutoProposer:
    """Per request, the drafter with the better observed acceptance: prompt
    lookup when it finds a match (it is free), the self-draft otherwise, unless
    the self-draft's acceptance (the request's, or overall before the request
    has its own) is below the policy's floor."""
    name = "auto"

    def __init__(self, ngram: NgramProposer, selfdraft: SelfDraftProposer, policy):
        self.ngram, self.selfdraft, self.policy = ngram, selfdraft, policy

    def propose(self, runner, out) -> None:
        model_items = []
        for s in out.scheduled:
            if not s.num_spec_tokens:
                continue
            r = s.request
            found = self.ngram.lookup(r.all_token_ids, s.num_spec_tokens)
            by = self.policy.by_source.get(r.request_id, {})
            ng, sd = by.get(self.ngram.name), by.get(self.selfdraft.name)
            if found and (ng is None or sd is None or ng.rate() >= sd.rate()):
                r.draft_source = self.ngram.name
                _set_drafts(s, found, None)
            elif self.policy.worth_drafting(r.request_id, self.selfdraft.name):
                r.draft_source = self.selfdraft.name
                model_items.append(s)
            else:  # the self-draft has shown it rarely lands: this step runs without drafts
                _set_drafts(s, [], None)
        if model_items:
            self.selfdraft.propose_items(runner, model_items)
