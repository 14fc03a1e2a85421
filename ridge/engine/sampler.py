"""The sampler: logits rows -> next tokens, per request parameters.

Each sampled row draws with the exponential race (argmax of p / E, E ~ Exp(1)),
which is exact sampling from p. A seeded request owns its generator and draws
exactly one row of noise per token, so its output does not depend on what else
is in the batch. A deterministic request (SamplingParams.deterministic) keys its
noise by its seed and the position of the token drawn (keyed_generator): no
stream is consumed, so speculation, which verifies several positions in one
step and drafts with noise of its own, draws the same noise for a position as
plain decoding does."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ridge.kernels import ops

from .request import Request
from .sampler_chain import adjust_logits, chain_probs, mirostat_update
from .sampler_keys import keyed_generator, keyed_seed, to_device  # noqa: F401  (their home before sampler_keys.py)


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # per row: (sampled token's logprob, [(token, logprob), ...] top-N), or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class SampledRows:
    """A step's samples, still on the device. The tokens can feed the next step
    directly; read() is the step's one wait for the device, and by the time the
    engine calls it the copy it waits for was queued a step ago. extra: more int64
    values the step reads at the same time (its verification), in `self.extra` after read()."""

    def __init__(self, token_ids: torch.Tensor, want: list[int], lp: tuple | None, extra: torch.Tensor | None = None):
        self.token_ids = token_ids  # [n] int64, on the device
        self.want = want  # top-N logprobs per row (0 = none)
        n = token_ids.shape[0]
        first = token_ids if extra is None else torch.cat([token_ids, extra])
        self.extra: list[int] = []
        parts = [first] + (list(lp) if lp is not None else [])
        if token_ids.is_cuda:
            self._host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts]
            for h, d in zip(self._host, parts):
                h.copy_(d, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = parts, None
        self._n = n

    def read(self) -> SampleResult:
        if self._ready is not None:
            self._ready.synchronize()
        values = self._host[0].tolist()
        tokens, self.extra = values[:self._n], values[self._n:]
        if len(self._host) == 1:
            return SampleResult(tokens, [None] * len(tokens))
        tok_lp, top_idx, top_val = (h.tolist() for h in self._host[1:])
        lps = [(tok_lp[i], list(zip(top_idx[i][:n], top_val[i][:n]))) if n else None
               for i, n in enumerate(self.want)]
        return SampleResult(tokens, lps)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """-> a copy of logits with every token a constraint refuses at -inf: one batched
    operation over all constrained rows. logits: [n, V]; bitmask: [m, ceil(V / 32)] int32,
    bit j of word w allows token 32w + j; rows: [m] the rows it masks (None: all n)."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :logits.shape[-1]].bool()
    if rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    out.index_copy_(0, rows, out.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
    return out


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 use_min_p: bool = True, use_top: bool = True) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p exclude; rows keep at least their best token.
    probs: [n, V]; top_k (0 = off), top_p, min_p: [n]. use_min_p / use_top: whether any
    row asks for them, known on the host so that nothing here waits for the device."""
    if use_min_p:
        probs = probs.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p[:, None], 0.0)
    if use_top:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above this token
        # A row with top_p = 1 keeps its tail: its rounded cumulative sum may reach 1.0 before the
        # last token, and whether it is filtered must not depend on a batch mate asking for top-p.
        drop = (rank >= k) | ((before >= top_p[:, None]) & (rank > 0) & (top_p[:, None] < 1))
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

    def noise(self, probs: torch.Tensor, reqs: list[Request], positions: list[int] | None = None) -> torch.Tensor:
        """Exp(1) noise per row. positions: the token index each row draws (None: not known,
        as for a drafter's own draws); a deterministic request's row then takes its keyed
        generator, others their own generator or the global one."""
        keyed = [positions is not None and r.params.deterministic for r in reqs]
        e = torch.empty_like(probs)
        if not all(keyed):
            e.exponential_()
        for i, r in enumerate(reqs):
            if keyed[i]:
                e[i].exponential_(generator=keyed_generator(r.params.seed, positions[i], probs.device))
            elif (g := self.generator(r, probs.device)) is not None:
                e[i].exponential_(generator=g)
        return e

    def sample_tokens(self, logits: torch.Tensor, reqs: list[Request], positions: list[int] | None) -> torch.Tensor:
        """The target's own draw for each row (logits already masked and penalised): the exponential race.
        A mirostat row's mu then moves by the drawn token's surprise (plain decoding only: such a
        request never speculates, SamplingParams.plain_decoding)."""
        p = self.probs(logits, reqs, positions)
        tokens = ops.argmax(p / self.noise(p, reqs, positions))
        miro = [i for i, r in enumerate(reqs) if r.params.mirostat]
        if miro:
            rows = to_device(miro, torch.int64, logits.device)
            mirostat_update(p.index_select(0, rows), tokens.index_select(0, rows), [reqs[i] for i in miro])
        return tokens

    def uniform(self, reqs: list[Request], device) -> torch.Tensor:
        """One U[0, 1) per row, from each seeded request's own generator."""
        u = torch.rand(len(reqs), device=device)
        for i, r in enumerate(reqs):
            g = self.generator(r, device)
            if g is not None:
                u[i] = torch.rand((), generator=g, device=device)
        return u

    def probs(self, logits: torch.Tensor, reqs: list[Request], positions: list[int] | None = None) -> torch.Tensor:
        """The distribution each row samples from (for sampled rows; greedy rows are ignored).
        Rows whose request asks for llama.cpp's samplers (typical_p, top_n_sigma, XTC, mirostat, an
        order) go through sampler_chain; the others through the plain path below, unchanged.
        positions: as for noise(), keys a deterministic request's XTC coin."""
        chained = [i for i, r in enumerate(reqs) if r.params._shapes]
        if not chained:
            return self._plain_probs(logits, reqs)
        if len(chained) == len(reqs):
            return chain_probs(logits, reqs, self, positions)
        dev = logits.device
        plain = [i for i in range(len(reqs)) if not reqs[i].params._shapes]
        out = torch.empty_like(logits)
        for rows, fn in ((plain, lambda x, rs, pos: self._plain_probs(x, rs)),
                         (chained, lambda x, rs, pos: chain_probs(x, rs, self, pos))):
            idx = to_device(rows, torch.int64, dev)
            out.index_copy_(0, idx, fn(logits.index_select(0, idx), [reqs[i] for i in rows],
                                       positions and [positions[i] for i in rows]))
        return out

    def _plain_probs(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        dev = logits.device
        ps = [r.params for r in reqs]
        temp = to_device([p.temperature or 1.0 for p in ps], torch.float32, dev)
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        probs = filter_probs(probs, to_device([p.top_k for p in ps], torch.int64, dev),
                             to_device([p.top_p for p in ps], probs.dtype, dev),
                             to_device([p.min_p for p in ps], probs.dtype, dev),
                             use_min_p=any(p.min_p > 0 for p in ps),
                             use_top=any(p.top_k > 0 or p.top_p < 1 for p in ps))
        # Normalised, so that ratios between two distributions (speculation) mean what they say.
        return probs / probs.sum(dim=-1, keepdim=True)

    def sample(self, logits: torch.Tensor, reqs: list[Request], raw: torch.Tensor | None = None,
               extra: torch.Tensor | None = None, positions: list[int] | None = None) -> SampledRows:
        """logits: [n, V] float32, one row per request in reqs (constrained rows already
        masked); raw: the same rows unmasked, for logprobs (None: logits); positions: the
        index of the token each row draws (noise). Queues everything on the device; the result
        is read later (SampledRows.read), with `extra`."""
        raw = logits if raw is None else raw
        # Penalties, logit_bias and DRY change the logits the argmax and every sampler read.
        logits = adjust_logits(logits.clone(), reqs) if any(r.params._adjusts for r in reqs) else logits
        tokens = ops.argmax(logits)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(sampled) == len(reqs):
            tokens = self.sample_tokens(logits, reqs, positions)
        elif sampled:
            rows = to_device(sampled, torch.int64, logits.device)
            sub = [reqs[i] for i in sampled]
            tokens.index_copy_(0, rows, self.sample_tokens(logits.index_select(0, rows), sub,
                                                           positions and [positions[i] for i in sampled]))
        want = [r.params.logprobs or 0 for r in reqs]
        lp = None
        if any(want):
            logp = torch.log_softmax(raw, dim=-1)
            top = logp.topk(max(want), dim=-1)
            lp = (logp.gather(1, tokens[:, None])[:, 0], top.indices, top.values)
        return SampledRows(tokens, want, lp, extra)
