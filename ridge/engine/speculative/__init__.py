"""Speculative decoding: drafts are tokens not yet computed, verified in the
same step as everything else.

The engine reaches this folder through one object, a Speculator, built in two
steps (factory.py: plan_speculation before the KV cache is sized,
build_speculator once it exists) and called at these points of a step:

  plan    Scheduler._num_drafts   draft_slots(req, room, batch_tokens): the draft
                                  slots a request about to decode one token reserves
  draft   EngineCore._launch      propose(out): drafts for the reserved slots, which
                                  the constraints then the scheduler fit the plan to
  forward ModelRunner.forward_logits  on_forward(out, batch, hidden): the step's final
                                  hidden states, which a draft head (mtp.py) feeds next step
  verify  ModelRunner.launch      verify(logits, items, sampler): after the forward,
                                  every speculating request at once, read with the samples
  read    Scheduler.update        on_verified(req, drafted, accepted)
          EngineCore._complete    on_step(out, seconds): what the step cost
  finish  Scheduler._remove       on_finish(request_id)

Nothing outside this folder reads the policy or the proposer."""
from .factory import SpeculationPlan, build_speculator, plan_speculation
from .speculator import Speculator

__all__ = ["SpeculationPlan", "Speculator", "build_speculator", "plan_speculation"]
