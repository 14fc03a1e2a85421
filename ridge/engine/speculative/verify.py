"""Verification of drafted tokens against the target's distribution."""
from __future__ import annotations

import torch


def verify(target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
           greedy: bool, generator: torch.Generator | None = None) -> list[int]:
    """target_probs: [k + 1, V], the target's distribution after each prefix
    (row i follows draft i - 1); draft_probs: [k, V] or None for a
    deterministic drafter (one-hot on its token). Returns the accepted drafts
    plus one token from the target: 1 to k + 1 tokens.

    Greedy: accept while the draft equals the target's argmax; the first
    mismatch is replaced by the argmax, and if all match the argmax after the
    last draft is the bonus token. Output is token for token plain decoding.

    Sampling (Leviathan et al., Chen et al.): accept draft x_i with probability
    min(1, p(x_i) / q(x_i)); on the first rejection, sample from the residual
    norm(max(p - q, 0)) and stop; if all k are accepted, sample the bonus from
    p after the last draft. The output is distributed exactly as the target's.
    """
    if greedy:
        best = target_probs.argmax(dim=-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            if d != best[i]:
                break
            out.append(d)
        return out + [best[len(out)]]
    k = len(drafts)
    idx = torch.arange(k, device=target_probs.device)
    d = torch.tensor(drafts, device=target_probs.device)
    p = target_probs[idx, d]
    q = draft_probs[idx, d] if draft_probs is not None else torch.ones_like(p)
    u = torch.rand(k, generator=generator, device=target_probs.device)
    accept = ((u * q <= p) & (p > 0)).tolist()  # u may be 0: never accept a token p excludes
    n = accept.index(False) if False in accept else k
    if n < k:
        q_row = draft_probs[n] if draft_probs is not None else \
            torch.nn.functional.one_hot(d[n], target_probs.shape[-1]).to(target_probs.dtype)
        residual = (target_probs[n] - q_row).clamp(min=0)
        dist = residual if residual.sum() > 0 else target_probs[n]
    else:
        dist = target_probs[k]
    nxt = torch.multinomial(dist / dist.sum(), 1, generator=generator).item()
    return drafts[:n] + [nxt]
