"""How many tokens to draft, per request per step, from the seed's arithmetic.

A step over T tokens reads the weights once (T* token-units of time, where the
knee T* = ridge point x bytes per weight / 2) and computes T tokens (T units);
the policy charges T* + T, the roofline's max(T*, T) with no overlap between
the two, which is what a CPU shows (SmolLM2: 16 tokens cost 2.4x one token,
docs/benchmarks.md). Below the knee a drafted token is nearly free; above it
each costs full price. With acceptance rate a, k drafts yield E(k) = (1 - a^(k+1)) / (1 - a)
tokens per verification, where a is the chance that a draft is accepted given
that the drafts before it were: accepted / (accepted + rejections), not
accepted / drafted, which counts the drafts after a rejection as failures
although they were never tried. The policy picks the k that maximises the step's
tokens per unit of cost, so speculation fades out as the batch pushes the step
past the knee, and stops for requests whose drafts are rarely accepted. The
ridge point's knee is where the policy starts; once the engine has timed decode
steps of varied sizes, the knee those times show takes its place (StepCost)."""
from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPT = 0.6  # before a request has history
PRIOR_WEIGHT = 4.0  # drafted tokens' worth of confidence in the prior
MIN_ACCEPT = 0.2  # below this, a request stops drafting with a model drafter...
PROBE_EVERY = 16  # ...except for a one-token probe every this many steps
OVERALL_EVIDENCE = 16  # drafted tokens before a drafter's overall rate can rule it out for new requests


@dataclass
class Acceptance:
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    emitted: int = 0  # accepted + the target's own token, per verification
    rejections: int = 0  # verifications that rejected a draft
    idle_steps: int = 0

    def rate(self, prior: float = PRIOR_ACCEPT) -> float:
        """The chance a draft is accepted once the drafts before it were (the a of E(k))."""
        return (self.accepted + prior * PRIOR_WEIGHT) / (self.accepted + self.rejections + PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verifications += 1
        self.emitted += accepted + 1
        self.rejections += accepted < drafted

    def as_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "verifications": self.verifications,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "tokens_per_verification": self.emitted / self.verifications if self.verifications else 0.0}


def expected_tokens(a: float, k: int) -> float:
    if a >= 1.0:
        return k + 1.0
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class StepCost:
    """A least-squares line through measured decode-step times, seconds = fixed + per_token x T,
    over recent steps (older ones fade). fixed / per_token is the knee as the whole step shows
    it: the ridge point prices only the weight reads, while a CPU step also pays a fixed cost
    in small ops that extra tokens do not add to (SmolLM2 at batch 1: 27 ms for 1 token,
    33 ms for 9, so drafts are cheaper than the ridge point's knee says)."""
    decay: float = 0.995
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + tokens, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + tokens * tokens, d * self.sxy + tokens * seconds

    def knee(self) -> float | None:
        """fixed / per_token, once enough steps of varied sizes were seen."""
        if self.n < MIN_STEPS:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var < 1.0:  # every step the same size: no slope to read
            return None
        slope = (self.sxy / self.n - mx * my) / var
        fixed = my - slope * mx
        return fixed / slope if slope > 0 and fixed > 0 else None


MIN_STEPS = 32  # measured decode steps before their knee replaces the ridge point's
KNEE_RANGE = (0.25, 8.0)  # the measured knee is kept within these multiples of the ridge point's


@dataclass
class SpecPolicy:
    knee_tokens: float  # T*
    max_k: int = 8
    draft_cost: float = 0.0  # one drafted token's cost, as a fraction of a target step
    # auto: the model drafter that draft_cost prices. Once it is out (worth_drafting), drafts
    # come from prompt lookup only, which is free, and k is chosen without that cost.
    costed_source: str | None = None
    per_request: dict[str, Acceptance] = field(default_factory=dict)
    by_source: dict[str, dict[str, Acceptance]] = field(default_factory=dict)  # request -> proposer -> figures
    per_proposer: dict[str, Acceptance] = field(default_factory=dict)
    totals: Acceptance = field(default_factory=Acceptance)
    step_cost: StepCost = field(default_factory=StepCost)

    def knee(self) -> float:
        """The ridge point's T*, or the measured steps' knee once there is one (within KNEE_RANGE of T*)."""
        measured = self.step_cost.knee()
        if measured is None:
            return self.knee_tokens
        lo, hi = KNEE_RANGE
        return min(max(measured, lo * self.knee_tokens), hi * self.knee_tokens)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode step (no prompt tokens) of `tokens` tokens took `seconds`, drafting excluded."""
        self.step_cost.add(tokens, seconds)

    def choose_k(self, request_id: str, batch_tokens: int) -> int:
        """batch_tokens: tokens already in this step (T). -> drafts to propose."""
        acc = self.per_request.setdefault(request_id, Acceptance())
        prior = self.totals.rate()
        a = acc.rate(prior)
        # With several drafters (auto), the request's best one sets k: a drafter that never
        # lands must not stop one that does.
        for src in self.by_source.get(request_id, {}).values():
            if src.drafted >= PRIOR_WEIGHT:
                a = max(a, src.rate(prior))
        cost = self.draft_cost
        if self.costed_source is not None and not self.worth_drafting(request_id, self.costed_source):
            cost = 0.0
        # A model drafter pays a pass per draft, so poor acceptance switches it off (with a
        # probe now and then). Free drafts (prompt lookup) are left to the cost model below:
        # a request that starts with new text and then copies must not be shut out early.
        if cost and a < MIN_ACCEPT and acc.drafted >= PRIOR_WEIGHT:
            acc.idle_steps += 1
            return 1 if acc.idle_steps % PROBE_EVERY == 0 else 0
        return self._best_k(a, max(batch_tokens, 1), cost)

    def _best_k(self, a: float, T: int, cost: float) -> int:
        """Tokens per unit of step cost, without drafts and with k drafts for this
        request: a step of T tokens costs T* + T; each draft pass costs
        draft_cost of a step (T* units), shared by the requests drafting in it."""
        knee = self.knee()
        best_k, best = 0, T / (knee + T)
        for k in range(1, self.max_k + 1):
            value = (T - 1 + expected_tokens(a, k)) / (knee + T + k + k * cost * knee / T)
            if value > best * 1.02:  # a margin against noise in the estimate
                best_k, best = k, value
        return best_k

    def can_pay(self) -> bool:
        """Whether drafting at draft_cost could ever beat plain decoding: alone in a step, with
        every draft accepted. A draft model as large as the target cannot (each draft costs
        what the token it may save does), and its catch-up pass would slow every step."""
        return self._best_k(1.0, 1, self.draft_cost) > 0

    def worth_drafting(self, request_id: str, source: str) -> bool:
        """Whether `source` may still draft for this request: not once its drafts for the
        request, or its drafts overall, were accepted below MIN_ACCEPT. A model drafter pays a
        pass per drafted token, so one that never lands must not be retried request by request."""
        mine = self.by_source.get(request_id, {}).get(source)
        if mine is not None and mine.drafted >= PRIOR_WEIGHT and mine.rate() < MIN_ACCEPT:
            return False
        overall = self.per_proposer.get(source)
        return overall is None or overall.drafted < OVERALL_EVIDENCE or overall.rate() >= MIN_ACCEPT

    def record(self, request_id: str, drafted: int, accepted: int, source: str = "") -> None:
        self.per_request.setdefault(request_id, Acceptance()).record(drafted, accepted)
        self.by_source.setdefault(request_id, {}).setdefault(source, Acceptance()).record(drafted, accepted)
        self.per_proposer.setdefault(source, Acceptance()).record(drafted, accepted)
        self.totals.record(drafted, accepted)

    def forget(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)
        self.by_source.pop(request_id, None)

    def stats(self) -> dict:
        return {"total": self.totals.as_dict(), "knee_tokens": {"ridge": self.knee_tokens, "used": self.knee()},
                **{k: v.as_dict() for k, v in self.per_proposer.items()}}
