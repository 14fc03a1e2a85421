"""The Speculator: speculative decoding as the engine sees it, one object called at named points
of a step. Its policy (policy.py) and proposer (proposers.py) are read by nothing else."""
from __future__ import annotations

from .policy import SpecPolicy
from .verify import Verified, verify_batch


class Speculator:
    def __init__(self, policy: SpecPolicy, proposer, caches: list | None = None):
        self.policy, self.proposer = policy, proposer
        self.name = proposer.name
        self.caches = caches or []  # a draft model's KV caches: the KV tiers move them with the target's

    # -- plan: Scheduler, for each request about to decode one token ----------------------
    def draft_slots(self, req, room: int, batch_tokens: int) -> int:
        """The draft slots the request reserves this step (0: a plain decode). room: the most
        that its max_tokens, the context and the step's budget leave; batch_tokens: the tokens
        already in the step, which set the price of a draft against the knee."""
        p = req.params
        # Penalties and DRY read every earlier token, mirostat's mu moves with each drawn token, XTC
        # draws a coin per token, a logit_bias moves the argmax greedy verification compares with
        # (SamplingParams.plain_decoding), and logprobs are per sampled row: none is defined over a
        # verified span, so such a request decodes one token a step.
        if not p.speculative or p.plain_decoding or p.logprobs or room <= 0:
            return 0
        return min(room, self.policy.choose_k(req.request_id, batch_tokens))

    # -- draft: EngineCore, before the forward ------------------------------------------------
    def propose(self, out) -> dict:
        """request id -> Draft for the slots reserved in out; never edits the plan (the engine
        has the constraints and then Scheduler.accept_drafts fit them)."""
        return self.proposer.propose(out)

    # -- verify: ModelRunner, after the forward ----------------------------------------------
    def verify(self, logits, items: list, sampler) -> Verified:
        """Every speculating request's rows at once (items: (ScheduledRequest, first row, rows)),
        still on the device: the step's one read returns them with the samples."""
        return verify_batch(logits, items, sampler)

    # -- the target's forward: a draft head reads its hidden states ---------------------------
    def on_forward(self, out, batch, hidden) -> None:
        """ModelRunner.forward_logits: the step's final hidden states [num tokens, H], before the
        samples; the checkpoint's draft head (mtp.py) feeds them at the next step's drafting."""
        if hasattr(self.proposer, "on_forward"):
            self.proposer.on_forward(out, batch, hidden)

    # -- read: the step's tokens are in -------------------------------------------------------
    def on_verified(self, req, drafted: int, accepted: int) -> None:
        """Scheduler.update: how many of a request's drafts the target kept."""
        self.policy.record(req.request_id, drafted, accepted, req.draft_source)

    def on_step(self, out, seconds: float) -> None:
        """EngineCore._complete: a read step's cost from its launch, drafting excluded. Only a
        step without prompt tokens prices verified tokens against plain ones."""
        if all(s.start >= s.request.num_prompt_tokens for s in out.scheduled):
            self.policy.observe_step(sum(s.num_scheduled_tokens for s in out.scheduled), seconds)

    # -- finish: the request leaves the scheduler -------------------------------------------
    def on_finish(self, request_id: str) -> None:
        self.policy.forget(request_id)
        if hasattr(self.proposer, "on_finish"):
            self.proposer.on_finish(request_id)

    def stats(self) -> dict:
        return self.policy.stats()
