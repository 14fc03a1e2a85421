"""The sampler: logits rows -> next tokens, per request parameters.

Each sampled row draws with the exponential race (argmax of p / E, E ~ Exp(1)),
which is exact sampling from p. A seeded request owns its generator and draws
exactly one row of noise per token, so its output does not depend on what else
is in the batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # per row: (sampled token's logprob, [(token, logprob), ...] top-N), or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """HF's repetition penalty over prompt and output: divide positive logits, multiply negative."""
    for i, r in enumerate(reqs):
        p = r.params.repetition_penalty
        if p != 1.0:
            seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p, vals * p)
    return logits


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p exclude; rows keep at least their best token.
    probs: [n, V]; top_k (0 = off), top_p, min_p: [n]."""
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p[:, None], 0.0)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above this token
        drop = (rank >= k) | ((before >= top_p[:, None]) & (rank > 0))
        probs = probs.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
    return probs


class Sampler:
    def __init__(self):
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def generator(self, req: Request, device) -> torch.Generator | None:
        """The request's own generator if it is seeded, else None (the global one)."""
        if req.params.seed is None:
            return None
        g = self.generators.get(req.request_id)
        if g is None:
            g = self.generators[req.request_id] = torch.Generator(device).manual_seed(req.params.seed)
        return g

    def noise(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        e = torch.empty_like(probs).exponential_()
        for i, r in enumerate(reqs):
            g = self.generator(r, probs.device)
            if g is not None:
                e[i].exponential_(generator=g)
        return e

    def probs(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The distribution each row samples from (for sampled rows; greedy rows are ignored)."""
        dev = logits.device
        temp = torch.tensor([r.params.temperature or 1.0 for r in reqs], device=dev)
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        probs = filter_probs(probs,
                             torch.tensor([r.params.top_k for r in reqs], device=dev),
                             torch.tensor([r.params.top_p for r in reqs], device=dev, dtype=probs.dtype),
                             torch.tensor([r.params.min_p for r in reqs], device=dev, dtype=probs.dtype))
        # Normalised, so that ratios between two distributions (speculation) mean what they say.
        return probs / probs.sum(dim=-1, keepdim=True)

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
        """logits: [n, V] float32, one row per request in reqs."""
        raw = logits
        logits = apply_penalties(logits.clone(), reqs) if any(r.params.repetition_penalty != 1.0 for r in reqs) else logits
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            sub = [reqs[i] for i in sampled]
            p = self.probs(logits[rows], sub)
            tokens[rows] = (p / self.noise(p, sub)).argmax(dim=-1)
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(raw, reqs, token_list))

    @staticmethod
    def _logprobs(raw: torch.Tensor, reqs: list[Request], tokens: list[int]):
        want = [r.params.logprobs for r in reqs]
        if not any(want):
            return [None] * len(reqs)
        lp = torch.log_softmax(raw, dim=-1)
        out = []
        for i, n in enumerate(want):
            if not n:
                out.append(None)
                continue
            top = lp[i].topk(n)
            out.append((float(lp[i, tokens[i]]), list(zip(top.indices.tolist(), top.values.tolist()))))
        return out
