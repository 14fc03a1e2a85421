"""Constraints: structured output as the engine sees it, one object called at named points of a
request's life and of a step. The compiler (grammar.py), the masks (step.py) and the matchers'
rules are read by nothing else; each sample's matcher is request state, on Request.matcher."""
from __future__ import annotations

import torch

from ..sampler import apply_token_bitmask
from .grammar import CompiledConstraint, GrammarCompiler, Matcher
from .step import prune_drafts, step_masks


class Constraints:
    def __init__(self, tokenizer, vocab_size: int):
        # Compiled formats, cached for this tokenizer; the daemon's validator shares the compiler.
        self.grammars = GrammarCompiler(tokenizer, vocab_size)

    # -- add: EngineCore.add_request -------------------------------------------------------
    def compile(self, params) -> CompiledConstraint | None:
        """The request's compiled response_format, or None. Raises InvalidRequest at admission
        for one that does not compile, so that no step ever meets it."""
        c = params.constraint()
        return None if c is None else self.grammars.compile(c)

    @staticmethod
    def matcher(compiled: CompiledConstraint | None) -> Matcher | None:
        """One sample's own position in the constraint (each sample of n > 1 has its own)."""
        return compiled.matcher() if compiled is not None else None

    # -- plan: EngineCore.step, before it plans a step while one is in flight ----------------
    @staticmethod
    def needs_last_token(running) -> bool:
        """Whether the next step's masks need the step in flight read first: a matcher must have
        consumed its request's whole output before its next mask."""
        return any(r.matcher is not None for r in running)

    # -- draft: EngineCore._launch, between the proposer and Scheduler.accept_drafts -----------
    @staticmethod
    def fit_drafts(scheduled, drafts: dict) -> dict:
        """Deterministic drafts cut to the prefix each constraint allows (step.prune_drafts)."""
        return prune_drafts(scheduled, drafts)

    # -- before sampling: ModelRunner.launch, after the forward -------------------------------
    @staticmethod
    def mask(scheduled, sample_spans, logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """-> (the logits with every refused token at -inf, whether any row was masked). The raw
        logits are returned as they are when no row is constrained, and stay for logprobs."""
        masks = step_masks(scheduled, sample_spans, logits.shape[0], logits.shape[-1], logits.device)
        if masks is None:
            return logits, False
        return apply_token_bitmask(logits, masks.bitmask, masks.rows), True

    # -- after sampling: EngineCore._complete, once Scheduler.update read the tokens in -------
    @staticmethod
    def advance(out) -> None:
        """Each running constrained request's matcher consumes the tokens the step gave it."""
        for s in out.scheduled:
            r = s.request
            if r.matcher is not None and not r.is_finished:
                r.matcher.sync(r.output_token_ids)

    # -- finish: EngineCore, when a request leaves ---------------------------------------------
    @staticmethod
    def on_finish(req) -> None:
        """The matcher consumes the request's last tokens, so that it holds the whole output (a
        stop token included): whether the output completed its constraint is then the matcher's
        is_accepting()."""
        if req.matcher is not None:
            req.matcher.sync(req.output_token_ids)
