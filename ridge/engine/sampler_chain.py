"""llama.cpp's samplers (SamplingParams: penalties, logit_bias, DRY, typical_p, top_n_sigma, XTC,
mirostat, the `samplers` order), for the rows of a step that ask for them; sampler.py sends only
those rows here, so a request without them runs the plain path and pays nothing.

Two kinds of work:
- adjust_logits: what changes the logits before anything else, greedy rows included (their
  argmax): repetition / presence / frequency penalties, logit_bias and DRY. Penalties and DRY read
  the token history on the host (one vectorised pass per request a step), and land on the device in
  one scatter per kind for all rows at once.
- chain_probs: the distribution a sampled row draws from, each stage in the request's order on the
  logits (a removed token is -inf; each stage sees the survivors renormalised, as llama.cpp's do),
  batched over the rows that share an order. Mirostat replaces the chain with temperature then
  mirostat, as in llama.cpp, and its mu is updated on the device after the draw (mirostat_update).

Definitions follow llama.cpp (src/llama-sampling.cpp, tools/server/README.md); presence and
frequency follow OpenAI's (counts over the generated tokens)."""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .sampler_keys import keyed_generator, to_device

XTC_KEY = 0x58544321  # keys a deterministic request's XTC coin apart from its sampling noise
_FLOAT_MAX_LOG = 88.7228391  # log(FLT_MAX): DRY's exponent is capped so its penalty stays finite


# -- logit adjustments -------------------------------------------------------------------------
def adjust_logits(logits: torch.Tensor, reqs) -> torch.Tensor:
    """logits: [n, V], edited in place and returned. Rows whose params adjust nothing are untouched."""
    rep_r, rep_t, rep_p = [], [], []
    sub_r, sub_t, sub_v = [], [], []  # subtracted: presence / frequency, DRY
    add_r, add_t, add_v = [], [], []  # logit_bias
    for i, r in enumerate(reqs):
        p = r.params
        if not p._adjusts:
            continue
        if p.penalizes:
            if p.repetition_penalty != 1.0 and p.repeat_last_n != 0:
                window = r.all_token_ids if p.repeat_last_n < 0 else r.all_token_ids[-p.repeat_last_n:]
                toks = np.unique(np.asarray(window, dtype=np.int64))
                rep_r.append(np.full(len(toks), i)), rep_t.append(toks), rep_p.append(np.full(len(toks), p.repetition_penalty))
            if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
                toks, counts = np.unique(np.asarray(r.output_token_ids, dtype=np.int64), return_counts=True)
                sub_r.append(np.full(len(toks), i)), sub_t.append(toks)
                sub_v.append(counts * p.frequency_penalty + p.presence_penalty)
        if p.dries:
            toks, pen = dry_penalties(r.all_token_ids, p)
            if len(toks):
                sub_r.append(np.full(len(toks), i)), sub_t.append(toks), sub_v.append(pen)
        if p.logit_bias:
            add_r.append(np.full(len(p.logit_bias), i)), add_t.append(np.fromiter(p.logit_bias, np.int64))
            add_v.append(np.fromiter(p.logit_bias.values(), np.float64))
    dev = logits.device
    if rep_r:
        rows, toks = _index(rep_r, dev), _index(rep_t, dev)
        pen = to_device(np.concatenate(rep_p).tolist(), logits.dtype, dev)
        vals = logits[rows, toks]
        logits[rows, toks] = torch.where(vals > 0, vals / pen, vals * pen)
    for rs, ts, vs, sign in ((sub_r, sub_t, sub_v, -1.0), (add_r, add_t, add_v, 1.0)):
        if rs:
            v = to_device((sign * np.concatenate(vs)).tolist(), logits.dtype, dev)
            logits.index_put_((_index(rs, dev), _index(ts, dev)), v, accumulate=True)
    return logits


def _index(parts: list, dev) -> torch.Tensor:
    return to_device(np.concatenate(parts).tolist(), torch.int64, dev)


def dry_penalties(tokens: list[int], p) -> tuple[np.ndarray, np.ndarray]:
    """DRY over the last dry_penalty_last_n tokens -> (token ids, penalty each), as llama.cpp's
    llama_sampler_dry_apply. A candidate t extends a repeat of length n when the last n tokens also
    occur earlier followed by t; n is capped at the tokens after the newest sequence breaker (a
    repeat never spans one, whether its text is one token or several). Penalty: multiplier *
    base ** (n - allowed_length) for n >= allowed_length, the longest n per token; a token that is
    a breaker by itself is never penalized."""
    seq = tokens if p.dry_penalty_last_n < 0 else tokens[-p.dry_penalty_last_n:]
    s = np.asarray(seq, dtype=np.int64)
    n = len(s)
    none = np.empty(0, np.int64), np.empty(0, np.float64)
    if n < 2 or n <= p.dry_allowed_length:
        return none
    table = breaker_table(p.dry_breaker_ids)
    limit = restart_limit(seq, s, table)
    if limit < p.dry_allowed_length:
        return none
    # match[i]: how many tokens ending at i equal the tokens ending at n - 1 (the newest), for the
    # earlier ends i < n - 1, grown one step back at a time while any end still matches.
    ends = np.arange(n - 1)
    match = np.zeros(n - 1, np.int64)
    alive = np.ones(n - 1, bool)
    for j in range(limit):
        at = ends - j
        ok = alive & (at >= 0)
        ok[ok] = s[at[ok]] == s[n - 1 - j]
        alive = ok
        if not alive.any():
            break
        match += alive
    keep = match >= p.dry_allowed_length
    if not keep.any():
        return none
    cand, length = s[ends[keep] + 1], match[keep]
    order = np.lexsort((-length, cand))  # per candidate, its longest repeat first
    cand, length = cand[order], length[order]
    first = np.r_[True, cand[1:] != cand[:-1]]
    cand, length = cand[first], length[first]
    if len(table.single):
        spared = ~np.isin(cand, table.single)
        cand, length = cand[spared], length[spared]
    # llama.cpp's cap on the exponent, so that the penalty stays a finite float: whole, and only
    # for a base above 1.000001
    cap = int(_FLOAT_MAX_LOG / math.log(p.dry_base)) if p.dry_base > 1.000001 else 0
    exponent = length - p.dry_allowed_length
    if cap > 0:
        exponent = np.minimum(exponent, cap)
    return cand, p.dry_multiplier * np.power(p.dry_base, exponent.astype(np.float64))


class BreakerTable:
    """DRY's sequence breakers as token sequences: head token -> its tails (the tokens that must
    follow it to spell the breaker), longest first; an empty tail is a breaker in one token."""
    __slots__ = ("tails", "heads", "single")

    def __init__(self, sequences: frozenset):
        tails: dict[int, list[tuple[int, ...]]] = {}
        for head, *tail in sequences:
            tails.setdefault(head, []).append(tuple(tail))
        self.tails = {h: sorted(ts, key=len, reverse=True) for h, ts in tails.items()}
        self.heads = np.fromiter(self.tails, np.int64, len(self.tails))
        self.single = np.fromiter((h for h, ts in self.tails.items() if ts[-1] == ()), np.int64)


@functools.lru_cache(maxsize=64)
def breaker_table(sequences: frozenset) -> BreakerTable:
    """One table per set of breakers (a frozenset hashes once; most requests share the default set)."""
    return BreakerTable(sequences)


def restart_limit(seq: list[int], s: np.ndarray, table: BreakerTable) -> int:
    """The tokens after the newest complete breaker (all of them when there is none): llama.cpp's
    rep_limit. Heads are tried newest first; the first whose longest fitting tail follows it wins."""
    n = len(s)
    if not len(table.heads):
        return n
    for j in np.flatnonzero(np.isin(s, table.heads))[::-1]:
        after = n - 1 - int(j)  # tokens after the head
        for tail in table.tails[int(s[j])]:
            if len(tail) <= after and tuple(seq[j + 1:j + 1 + len(tail)]) == tail:
                return after - len(tail)
    return n


DRY_MAX_CHARS, DRY_MAX_TAIL = 40, 20  # llama.cpp's caps: a breaker's characters, a tail's tokens


def breaker_sequences(texts: list[str], breakers, encode) -> frozenset[tuple[int, ...]]:
    """DRY's breakers -> token sequences (head, *tail), as llama.cpp's get_overlapping_token_sequences
    finds them. texts: each token's text, by id; encode: text -> token ids, no special tokens. A
    token whose text holds a breaker is one by itself; a token whose text ends with the start of a
    breaker is the head of one, followed by the tokens of the breaker's rest (at most 20). Text is
    compared in characters (llama.cpp: bytes; the same for ASCII breakers)."""
    out: set[tuple[int, ...]] = set()
    for b in breakers:
        b = b[:DRY_MAX_CHARS]
        rests: dict[str, tuple[int, ...]] = {}
        for t, word in enumerate(texts):
            if b in word:
                out.add((t,))
                continue
            pos = word.find(b[0])
            while pos >= 0:
                if b.startswith(word[pos:]):
                    rest = b[len(word) - pos:]
                    if rest not in rests:
                        rests[rest] = tuple(encode(rest))[:DRY_MAX_TAIL]
                    out.add((t, *rests[rest]))
                pos = word.find(b[0], pos + 1)
    return frozenset(out)


# -- the chain ------------------------------------------------------------------------------------
def chain_probs(logits: torch.Tensor, reqs, sampler, positions: list[int] | None) -> torch.Tensor:
    """[n, V] normalised probabilities, each row through its request's order (or mirostat)."""
    out = torch.empty_like(logits)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(reqs):
        key = ("mirostat", r.params.mirostat) if r.params.mirostat else r.params._order
        groups.setdefault(key, []).append(i)
    for key, rows in groups.items():
        idx = to_device(rows, torch.int64, logits.device)
        sub = [reqs[i] for i in rows]
        pos = None if positions is None else [positions[i] for i in rows]
        x = logits.index_select(0, idx)
        if key[0] == "mirostat":
            x = _temperature(x, sub)
            x = mirostat_filter(x, sub, key[1])
        else:
            for stage in key:
                x = STAGES[stage](x, sub, sampler, pos) if stage in STAGES else x
        out.index_copy_(0, idx, torch.softmax(x, dim=-1))
    return out


def _params(reqs, name: str, x: torch.Tensor) -> torch.Tensor:
    return to_device([getattr(r.params, name) for r in reqs], x.dtype, x.device)


def _temperature(x, reqs, *_):
    return x / to_device([r.params.temperature or 1.0 for r in reqs], x.dtype, x.device)[:, None]


def _top_k(x, reqs, *_):
    ks = [r.params.top_k for r in reqs]
    if not any(ks):
        return x
    k = to_device([k if k > 0 else x.shape[-1] for k in ks], torch.int64, x.device)
    return _keep_sorted(x, torch.arange(x.shape[-1], device=x.device)[None, :] < k[:, None])


def _keep_sorted(x: torch.Tensor, keep_sorted: torch.Tensor) -> torch.Tensor:
    """keep_sorted: [n, V] over each row's logits sorted descending -> x with the rest at -inf."""
    vals, idx = x.sort(dim=-1, descending=True)
    return x.scatter(-1, idx, vals.masked_fill(~keep_sorted, float("-inf")))


def _top_p(x, reqs, *_):
    p = _params(reqs, "top_p", x)
    if not bool((p < 1).any()):
        return x
    vals, idx = x.sort(dim=-1, descending=True)
    probs = torch.softmax(vals, dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly above each token: keep until top_p is reached
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    drop = (before >= p[:, None]) & (rank > 0) & (p[:, None] < 1)
    return x.scatter(-1, idx, vals.masked_fill(drop, float("-inf")))


def _min_p(x, reqs, *_):
    m = _params(reqs, "min_p", x)
    if not bool((m > 0).any()):
        return x
    # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
    floor = x.amax(-1, keepdim=True) + torch.log(m)[:, None]
    return x.masked_fill((x < floor) & (m[:, None] > 0), float("-inf"))


def _typical(x, reqs, *_):
    """Locally typical sampling (Meister et al.): rank tokens by |-log p - H| and keep the smallest
    set of the most typical whose mass reaches typical_p, at least one."""
    t = _params(reqs, "typical_p", x)
    if not bool((t < 1).any()):
        return x
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    ent = -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(-1, keepdim=True)
    shifted = torch.where(torch.isfinite(logp), (-logp - ent).abs(), torch.full_like(logp, float("inf")))
    sorted_s, idx = shifted.sort(dim=-1)
    cum = p.gather(1, idx).cumsum(-1)
    last = (cum < t[:, None]).sum(-1, keepdim=True).clamp(max=x.shape[-1] - 1)  # the token reaching the mass
    drop_sorted = torch.arange(x.shape[-1], device=x.device)[None, :] > last
    drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted) & (t[:, None] < 1)
    return x.masked_fill(drop, float("-inf"))


def _top_n_sigma(x, reqs, *_):
    """Keep the logits within n standard deviations of the best (over the finite logits)."""
    n = _params(reqs, "top_n_sigma", x)
    if not bool((n > 0).any()):
        return x
    fin = torch.isfinite(x)
    cnt = fin.sum(-1, keepdim=True).clamp(min=1)
    z = torch.where(fin, x, torch.zeros_like(x))
    mean = z.sum(-1, keepdim=True) / cnt
    std = (torch.where(fin, (x - mean) ** 2, torch.zeros_like(x)).sum(-1, keepdim=True) / cnt).sqrt()
    floor = x.amax(-1, keepdim=True) - n[:, None] * std
    return x.masked_fill((x < floor) & (n[:, None] > 0), float("-inf"))


def _xtc(x, reqs, sampler, positions):
    """With probability xtc_probability, when two or more tokens reach xtc_threshold, remove all
    of them but the least likely. The coin comes from the request's generator (seeded), or its
    keyed one at the token's position (deterministic)."""
    on = [r.params.xtc_on for r in reqs]
    if not any(on):
        return x
    dev = x.device
    coin = torch.rand(len(reqs), device=dev)
    for i, r in enumerate(reqs):
        if not on[i]:
            continue
        if r.params.deterministic and positions is not None:
            coin[i] = torch.rand((), generator=keyed_generator(r.params.seed ^ XTC_KEY, positions[i], dev), device=dev)
        elif (g := sampler.generator(r, dev)) is not None:
            coin[i] = torch.rand((), generator=g, device=dev)
    go = (coin < _params(reqs, "xtc_probability", x)) & to_device(on, torch.bool, dev)
    p = torch.softmax(x, dim=-1)
    above = p >= _params(reqs, "xtc_threshold", x)[:, None]
    least = torch.where(above, p, torch.full_like(p, 2.0)).amin(-1, keepdim=True)
    drop = above & (p > least) & (above.sum(-1, keepdim=True) >= 2) & go[:, None]
    return x.masked_fill(drop, float("-inf"))


STAGES = {"temperature": _temperature, "top_k": _top_k, "top_p": _top_p, "min_p": _min_p, "typ_p": _typical,
          "top_n_sigma": _top_n_sigma, "xtc": _xtc}  # penalties and dry: adjust_logits, before the chain


# -- mirostat -------------------------------------------------------------------------------------
def _mu(reqs, x: torch.Tensor) -> torch.Tensor:
    mus = []
    for r in reqs:
        if r.mirostat_mu is None:
            r.mirostat_mu = torch.full((), 2.0 * r.params.mirostat_tau, dtype=torch.float32, device=x.device)
        mus.append(r.mirostat_mu)
    return torch.stack(mus).to(x.dtype)


def mirostat_filter(x: torch.Tensor, reqs, version: int) -> torch.Tensor:
    """The tokens mirostat keeps, given each request's mu. v1 (Basu et al., llama.cpp's with m = 100):
    estimate the Zipf exponent s from the top 100 probabilities, keep the top k with
    k = (eps * 2^mu / (1 - V^-eps))^(1/s), eps = s - 1. v2: keep the tokens whose surprise
    -log2 p is at most mu (the best one always)."""
    mu = _mu(reqs, x)
    vals, idx = x.sort(dim=-1, descending=True)
    logp = torch.log_softmax(vals, dim=-1)
    V = x.shape[-1]
    rank = torch.arange(V, device=x.device)[None, :]
    if version == 2:
        keep = (-logp / math.log(2) <= mu[:, None]) | (rank == 0)
    else:
        m = min(100, V)
        i = torch.arange(m - 1, device=x.device, dtype=x.dtype)
        t = torch.log((i + 2) / (i + 1))
        b = logp[:, :m - 1] - logp[:, 1:m]
        ok = torch.isfinite(b)  # a removed token (p = 0) ends the estimate
        s_hat = (torch.where(ok, t * b, 0.0)).sum(-1) / (torch.where(ok, t * t, 0.0)).sum(-1).clamp(min=1e-12)
        eps = s_hat - 1
        k = ((eps * torch.pow(2.0, mu)) / (1 - torch.pow(float(V), -eps))).pow(1 / s_hat)
        k = torch.nan_to_num(k, nan=float(V), posinf=float(V)).clamp(1, V).floor()
        keep = rank < k[:, None]
    return x.scatter(-1, idx, vals.masked_fill(~keep, float("-inf")))


def mirostat_update(probs: torch.Tensor, tokens: torch.Tensor, reqs) -> None:
    """mu -= eta * (surprise - tau), surprise = -log2 of the drawn token's probability in the
    distribution it was drawn from; on the device, in each request's own mu."""
    surprise = -torch.log2(probs.gather(1, tokens[:, None])[:, 0].clamp(min=1e-30))
    eta = _params(reqs, "mirostat_eta", probs)
    tau = _params(reqs, "mirostat_tau", probs)
    new = _mu(reqs, probs) - eta * (surprise - tau)
    for i, r in enumerate(reqs):
        r.mirostat_mu.copy_(new[i])
