"""A step's constraints: the masks of its constrained sample rows, and drafts
fitted to the matchers before they are verified.

Rule: a constrained request's matcher has consumed the request's whole output
before its next mask is computed. The engine keeps it true by reading the step
in flight before it plans one with a constrained request running
(Constraints.needs_last_token) and syncing the matchers as it reads a step
(Constraints.advance), so every token is on the host here and the syncs below
find nothing new.

Masks are bitmasks, 32 tokens to an int32 word (bit j of word w allows token
32w + j), computed on the host by the library for every constrained row at
once and applied to the logits in one operation (sampler.apply_token_bitmask).
A verification span of k drafts has k + 1 rows: the mask after the output,
then after each draft. Rows past a draft the constraint refuses are never
used (the draft is rejected there) and are left allowing every token."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

_executor = None


def executor():
    """llguidance's thread pool for computing many masks at once; made on first use."""
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


@dataclass(slots=True)
class TokenMasks:
    bitmask: torch.Tensor  # [m, ceil(V / 32)] int32, on the device
    rows: torch.Tensor | None  # [m] int64 logits rows, on the device; None: rows 0..m-1, every row


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def step_masks(scheduled, sample_spans, num_rows: int, vocab_size: int, device) -> TokenMasks | None:
    """scheduled: the step's ScheduledRequests; sample_spans: (first logits row, rows) of each.
    -> the masks of the constrained rows, or None when no row is constrained (the common case,
    which costs this loop and nothing else)."""
    items, rows = [], []
    for s, (first, k) in zip(scheduled, sample_spans):
        req = s.request
        if req.matcher is None or k == 0:
            continue
        # schedule() counted this step's own sample; any other is an earlier one still unread.
        assert req.num_output_placeholders == 1, "a constrained request was planned before its last token was read"
        req.matcher.sync(req.output_token_ids)
        items.append((req.matcher.ll, len(rows), list(req.spec_token_ids[:k - 1])))
        rows.extend(range(first, first + k))
    if not items:
        return None
    pinned = device.type == "cuda"
    bitmask = torch.full((len(rows), words(vocab_size)), -1, dtype=torch.int32, pin_memory=pinned)
    fill_masks(items, bitmask, parallel=pinned)
    every = rows == list(range(num_rows))
    if not pinned:
        return TokenMasks(bitmask, None if every else torch.tensor(rows))
    rows_t = None if every else torch.tensor(rows, pin_memory=True).to(device, non_blocking=True)
    return TokenMasks(bitmask.to(device, non_blocking=True), rows_t)


def fill_masks(items: list, bitmask: torch.Tensor, parallel: bool) -> None:
    """items: (LLMatcher, first row, drafts). parallel: in llguidance's thread pool, for a
    GPU host whose cores are otherwise idle during the step. On CPU the cores are the
    device: the pool's threads, still spinning after their work, slowed the forward that
    followed 3x on 2 cores (docs/benchmarks.md), so masks are computed in this thread."""
    one, ptr = bitmask.shape[1] * 4, bitmask.data_ptr()
    plain = [(m, i) for m, i, drafts in items if not drafts]
    spec = [item for item in items if item[2]]
    if plain and parallel and len(plain) > 1:
        executor().unsafe_compute_mask_ptr(plain, ptr, one, bitmask.shape[0])
    else:
        for m, i in plain:
            m.unsafe_compute_mask_ptr(ptr + i * one, one)
    if spec:  # the mask after the output, then after each draft; the matcher is rolled back
        if parallel:
            executor().unsafe_compute_mask_ptr_with_draft_token(spec, ptr, one, bitmask.shape[0])
        else:
            for m, i, drafts in spec:
                _draft_masks(m, ptr + i * one, one, drafts)


def _draft_masks(m, ptr: int, one: int, drafts: list[int]) -> None:
    """The mask after the output, then after each draft the matcher accepts; then roll back."""
    m.unsafe_compute_mask_ptr(ptr, one)
    consumed = 0
    for d in drafts:
        if m.is_stopped() or not m.try_consume_tokens([d]):
            break
        consumed += 1
        m.unsafe_compute_mask_ptr(ptr + consumed * one, one)
    if consumed:
        m.rollback(consumed)


def prune_drafts(scheduled, drafts: dict) -> dict:
    """Cut each constrained request's drafts to the prefix its constraint allows: a refused
    draft is certain to be rejected, so verifying it and what follows only costs.

    Not for sampled drafts from a model (drafts with probabilities, for a request that
    samples): whether a token was drafted is then random, and stopping there would change
    the rejection rule's output distribution. Verification rejects those exactly instead
    (the masked target gives a refused draft probability 0)."""
    for s in scheduled:
        req = s.request
        d = drafts.get(req.request_id)
        if req.matcher is None or d is None or not d.token_ids:
            continue
        if d.probs is not None and not req.params.greedy:
            continue
        req.matcher.sync(req.output_token_ids)
        n = req.matcher.valid_prefix(list(d.token_ids))
        if n < len(d.token_ids):
            drafts[req.request_id] = replace(d, token_ids=list(d.token_ids[:n]),
                                             probs=d.probs[:n] if d.probs is not None else None)
    return drafts
