"""Admission: whether an engine can ever serve a request, decided in one place.

The daemon asks before it queues a request (daemon/frontend/validate.py), with
its own limits beside the engine's; the engine asks when a caller hands it a
prompt and params directly (EngineCore.add_request). What passes is an
`Admitted`, which the engine takes as it is: max_tokens fitted to the context,
the constraint compiled (a cache hit of the compiler both share when the
engine compiles it again for the request's matchers)."""
from __future__ import annotations

from dataclasses import dataclass

from ridge.errors import InvalidRequest
from ridge.request import FieldError

from .sampling_params import SamplingParams


class Unconstrainable(InvalidRequest):
    """A response_format (or a chat turn's grammar) that does not compile."""


@dataclass(frozen=True, slots=True)
class Admitted:
    """A prompt and its params that passed admission: the engine's proof that it need not check them."""
    prompt_token_ids: list[int]
    params: SamplingParams
    images: tuple = ()  # ridge.vision.inputs.ImageInput each, in prompt order: the encoder's inputs


@dataclass(frozen=True, slots=True)
class Rules:
    """What an engine can hold (vocab_size .. num_blocks), and the daemon's own limits
    (docs/protocol.md §4: None where an engine is used without a daemon)."""
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_prompt_tokens: int | None
    max_tokens: int | None
    max_n: int | None
    grammars: object  # structured.GrammarCompiler (None: not compiled here): compiles within its budget

    def admit(self, ids: list[int], params: SamplingParams) -> Admitted:
        """-> the request as the engine runs it; raises FieldError for a field over a limit,
        Unconstrainable for a constraint that does not compile, InvalidRequest for a prompt the
        engine can never hold."""
        self._limits(params)
        self._prompt(ids)
        room = self.max_model_len - len(ids)
        if params.max_tokens > room:  # the output stops at the context's end
            params = params.derive(max_tokens=room)
        need = -(-(len(ids) + params.max_tokens) // self.block_size)
        if need > self.num_blocks:
            raise InvalidRequest(f"the request needs {need} KV blocks and the pool has {self.num_blocks}; "
                                 "it can never fit (lower max_tokens)")
        if self.grammars is not None and (c := params.constraint()) is not None:
            try:
                self.grammars.compile(c)
            except InvalidRequest as e:
                raise Unconstrainable(str(e)) from None
        return Admitted(ids, params)

    def _limits(self, params: SamplingParams) -> None:
        if self.max_tokens is not None and params.max_tokens > self.max_tokens:
            raise FieldError("max_tokens", f"an integer in [1, {self.max_tokens}]")
        if self.max_n is not None and params.n > self.max_n:
            raise FieldError("n", f"an integer in [1, {self.max_n}]")
        if any(t >= self.vocab_size for t in params.stop_token_ids) or len(params.stop_token_ids) > 64:
            raise FieldError("stop_token_ids", f"at most 64 token ids in [0, {self.vocab_size})")

    def _prompt(self, ids: list[int]) -> None:
        n = len(ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty")
        if not all(type(t) is int for t in ids) or min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequest(f"token ids must be integers in [0, {self.vocab_size})")
        if self.max_prompt_tokens is not None and n > min(self.max_prompt_tokens, self.max_model_len - 1):
            raise InvalidRequest(f"the prompt has {n} tokens; this daemon takes at most {self.max_prompt_tokens} "
                                 f"(context {self.max_model_len}, including at least one generated token)")
        if n >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {n} tokens; the context holds {self.max_model_len}, "
                                 "including at least one generated token")
