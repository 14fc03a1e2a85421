"""Structured output: params.response_format enforced by masking the logits.

The engine reaches this folder through one object, Constraints (constraints.py), called
at these points:

  add     EngineCore.add_request  compile(params): refused at admission if it does not
                                  compile; matcher(compiled): one per sample, on Request.matcher
  plan    EngineCore.step         needs_last_token(running): read the step in flight first
  draft   EngineCore._launch      fit_drafts(scheduled, drafts): deterministic drafts cut to
                                  what the constraint allows, before the plan is fitted to them
  sample  ModelRunner.launch      mask(scheduled, spans, logits): every constrained row of the
                                  step, plain and verified, in one operation before sampling
  read    EngineCore._complete    advance(out): the matchers consume the step's tokens
  finish  EngineCore._forget      on_finish(req): the matcher holds the whole output

The daemon's validator compiles with the engine's GrammarCompiler; its chat grammar
(daemon/frontend/chat_grammar.py: tools, reasoning) takes JSON_WHITESPACE and named_grammars."""
from .constraints import Constraints

__all__ = ["Constraints"]
