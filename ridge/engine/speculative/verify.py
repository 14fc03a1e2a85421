"""Verification of drafted tokens against the target's distribution, for every
speculating request of a step in one batched pass whose result is read with the
step's samples (one device-to-host read a step).

Greedy: accept while the draft equals the target's argmax; the first mismatch
is replaced by the argmax, and if all match the argmax after the last draft is
the bonus token. Output is token for token plain decoding.

Sampling (Leviathan et al., Chen et al.): accept draft x_i with probability
min(1, p(x_i) / q(x_i)); on the first rejection, sample from the residual
norm(max(p - q, 0)) and stop; if all k are accepted, sample the bonus from p
after the last draft. The output is distributed exactly as the target's. A
deterministic drafter (prompt lookup) has q one-hot on its token. Every row's
candidate (the residual's sample, or the bonus) is drawn on the device before
the host knows where the first rejection is; the host then picks one.

Deterministic requests (sampler.py: noise keyed by seed and position) are verified
as greedy ones are, against the target's own draw at each position: accept while
the draft equals it. That is token for token what plain decoding with the same seed
draws, so distributed as the target's; against a one-hot drafter it accepts with
probability p(x), as the rule above does."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ridge.kernels import ops

from ..sampler import to_device

Item = tuple  # (ScheduledRequest, first logits row, rows: its drafts + 1)


def _compares(s) -> bool:
    """Verified against the target's own token (greedy, or a deterministic request's keyed draw)."""
    p = s.request.params
    return p.greedy or bool(p.deterministic)


def draw_positions(s, n: int) -> list[int]:
    """The token index each of a request's n sample rows draws: its last n scheduled rows each
    predict the next token."""
    end = s.start + s.num_scheduled_tokens
    return list(range(end - n + 1, end + 1))


@dataclass(slots=True)
class Verified:
    """A step's verification, still on the device; resolve() reads its values."""
    greedy: list[Item]
    sampled: list[Item]
    values: torch.Tensor  # int64: greedy rows' argmax, then sampled rows' accept flags, then their candidates

    def resolve(self, values: list[int]) -> dict[str, list[int]]:
        """values: self.values on the host -> request id -> accepted drafts + the target's token."""
        out, i = {}, 0
        for s, _, n in self.greedy:
            best, drafts = values[i:i + n], s.request.spec_token_ids
            m = next((j for j, d in enumerate(drafts) if d != best[j]), len(drafts))
            out[s.request.request_id] = list(drafts[:m]) + [best[m]]
            i += n
        rows = sum(n for _, _, n in self.sampled)
        accept, cand = values[i:i + rows], values[i + rows:i + 2 * rows]
        j = 0
        for s, _, n in self.sampled:
            a = accept[j:j + n - 1]
            m = a.index(0) if 0 in a else n - 1
            out[s.request.request_id] = list(s.request.spec_token_ids[:m]) + [cand[j + m]]
            j += n
        return out


def verify_batch(logits: torch.Tensor, items: list[Item], sampler) -> Verified:
    """logits: the step's sample rows (constraints applied); items: the speculating requests."""
    greedy = [it for it in items if _compares(it[0])]
    sampled = [it for it in items if not _compares(it[0])]
    parts = []
    if greedy:
        rows = logits.index_select(0, _rows(greedy, logits.device))
        drawn = [i for i, (s, _, n) in enumerate(greedy) if not s.request.params.greedy]
        best = ops.argmax(rows)
        if drawn:  # the deterministic sampled requests' rows: their keyed draws in place of the argmax
            span = [(sum(n for _, _, n in greedy[:i]), greedy[i]) for i in drawn]
            idx = [f + j for f, (_, _, n) in span for j in range(n)]
            reqs = [s.request for _, (s, _, n) in span for _ in range(n)]
            pos = [p for _, (s, _, n) in span for p in draw_positions(s, n)]
            at = to_device(idx, torch.int64, logits.device)
            best.index_copy_(0, at, sampler.sample_tokens(rows.index_select(0, at), reqs, pos))
        parts.append(best)
    if sampled:
        parts.append(_sample(logits, sampled, sampler))
    return Verified(greedy, sampled, torch.cat(parts))


def _rows(items: list[Item], device) -> torch.Tensor:
    return to_device([r for _, first, n in items for r in range(first, first + n)], torch.int64, device)


def _sample(logits: torch.Tensor, items: list[Item], sampler) -> torch.Tensor:
    """-> [accept flag per row (0 on bonus rows), candidate per row], flattened."""
    dev = logits.device
    reqs = [s.request for s, _, n in items for _ in range(n)]
    p = sampler.probs(logits.index_select(0, _rows(items, dev)), reqs)
    drafts, is_draft, one_hot, j = [], [], [], 0
    q = torch.zeros_like(p)  # the draft's distribution per row; none after the last draft
    for s, _, n in items:
        toks = list(s.request.spec_token_ids)
        drafts += toks + [0]
        is_draft += [True] * (n - 1) + [False]
        if s.draft_probs is not None:
            q[j:j + n - 1] = s.draft_probs
        else:
            one_hot += range(j, j + n - 1)
        j += n
    d = to_device(drafts, torch.int64, dev)
    if one_hot:
        rows = to_device(one_hot, torch.int64, dev)
        q[rows, d.index_select(0, rows)] = 1.0
    pd, qd = p.gather(1, d[:, None])[:, 0], q.gather(1, d[:, None])[:, 0]
    u = sampler.uniform(reqs, dev)
    # u may be 0: never accept a token p excludes.
    accept = (u * qd <= pd) & (pd > 0) & to_device(is_draft, torch.bool, dev)
    residual = (p - q).clamp(min=0)
    dist = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    cand = ops.argmax(dist / sampler.noise(dist, reqs))  # exponential race: unnormalised weights are fine
    return torch.cat([accept.long(), cand])
