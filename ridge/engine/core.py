"""The engine's core: requests in as token ids, tokens out (no text), one step at a time.

step() = schedule -> run -> update, as in nano-vllm and vLLM V1. The core is built by
builder.py; the text side (detokenizing, stop strings, tool and reasoning parsing) is the
output processor's (output.py TextState), which runs where the text is read: the daemon's
socket thread (daemon/frontend/streams.py), or LLMEngine in-process (engine.py). A stop string
found there finishes its sample here (finish_sample)."""
from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import fields

import torch

from ridge.errors import InvalidRequest, internal_error
from ridge.kernels.timing import section

from .admit import Admitted, Rules
from .builder import EngineParts
from .metrics import RequestMetrics
from .output import RequestOutput, make_output
from .pooling import pooled_output
from .rerank import prompt_ids, scores
from .request import FinishReason, Request
from .runner import StepHandle
from .sampling_params import SamplingParams
from .scheduler import SchedulerOutput

log = logging.getLogger("ridge.engine")
LOAD_WAIT_S = 0.05  # nothing to run but loads from the KV tiers: wait this long for one, then plan again


class EngineCore:
    def __init__(self, parts: EngineParts):
        # What the builder made, as this engine's attributes (EngineParts documents each).
        for f in fields(parts):
            setattr(self, f.name, getattr(parts, f.name))
        # Engine-thread time in tier work against step time (steps that ran or read work).
        self.tier_wait = {"steps": 0, "step_s": 0.0, "busy_s": 0.0, "max_frac": 0.0}
        self.in_flight: StepHandle | None = None  # the launched step not yet read
        # Called with (the step's plan, seconds from its launch to its tokens read) for each
        # step read: the explicit hook benchmarks time steps with.
        self.step_observers: list = []
        self.proposer_name = self.speculator.name if self.speculator is not None else "off"
        self.grammars = self.constraints.grammars  # the daemon's validator compiles with the same compiler
        self.requests: dict[str, Request] = {}  # internal id -> request
        self.groups: dict[str, list[Request]] = {}  # client id -> its samples
        self.embeddings: dict[str, tuple] = {}  # embedding request id -> (its inputs' requests, dimensions)
        self.pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._ids = itertools.count()
        self.started = time.monotonic()
        self.history: deque[tuple[float, int, int]] = deque(maxlen=4096)  # (time, prefill tok, decode tok)
        self.totals = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "requests": 0, "errors": 0}
        self.metrics = RequestMetrics()  # histograms of finished requests, for monitoring

    # -- requests ---------------------------------------------------------------
    @property
    def rules(self) -> Rules:
        """What this engine admits (admit.py), without a daemon's limits. The constraint is compiled
        once, by add_request for the request's matchers, where one that does not compile is refused."""
        return Rules(self.loaded.config.vocab_size, self.max_model_len, self.config.block_size,
                     self.kv_cache_manager.num_blocks, None, None, None, None)

    def admit(self, prompt: list[int] | str, params: SamplingParams | None = None) -> Admitted:
        """prompt (token ids or raw text) and params, admitted by the one set of rules (admit.py)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.rules.admit(ids, params or SamplingParams())

    @property
    def proposer(self):
        """The speculator's proposer (None without speculation): a draft model's cache is its."""
        return self.speculator.proposer if self.speculator is not None else None

    def compile_constraint(self, params: SamplingParams):
        """-> the request's compiled response_format, or None (Constraints.compile)."""
        return self.constraints.compile(params)

    def add_request(self, request_id: str | None, prompt: Admitted | list[int] | str,
                    params: SamplingParams | None = None, cache_salt: str = "") -> str:
        """prompt: an Admitted (the daemon's validator passed it: taken as it is), or token ids or
        raw text with their params, admitted here. cache_salt: the request shares prefix blocks only
        with requests of the same salt (docs/protocol.md §3.2.2). Raises InvalidRequest at admission."""
        if self.pooling is not None:
            raise InvalidRequest(f"this model is an embedding model (pooling {self.pooling}): it answers embed "
                                 "requests (/v1/embeddings), not generate")
        if not isinstance(cache_salt, str):
            raise InvalidRequest("cache_salt must be a string")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if isinstance(prompt, Admitted):
            assert params is None, "an Admitted request carries its params"
            admitted = prompt
        else:
            admitted = self.admit(prompt, params)
        ids, params = admitted.prompt_token_ids, admitted.params
        if admitted.images and self.runner.encoder is None:
            raise InvalidRequest("images: this model takes no image input")
        if admitted.images and (why := self.scheduler.refuse_images(admitted.images)):
            raise InvalidRequest(why)
        params, cache_salt = self._resolve_deterministic(params, cache_salt)
        compiled = self.compile_constraint(params)
        samples = []
        for i in range(params.n):
            iid = request_id if params.n == 1 else f"{request_id}#{i}"
            sp = params if params.n == 1 or params.seed is None else \
                params.derive(seed=(params.seed + i) % (1 << 63))  # distinct samples
            req = Request(iid, ids, sp, tuple(self.tokenizer.eos_token_ids),
                          group_id=request_id if params.n > 1 else None, client_id=request_id, index=i,
                          cache_salt=cache_salt, images=admitted.images,
                          matcher=self.constraints.matcher(compiled))  # one per sample
            self.requests[iid] = req
            self.scheduler.add_request(req)
            samples.append(req)
        self.groups[request_id] = samples
        self.totals["requests"] += 1
        return request_id

    def _resolve_deterministic(self, params: SamplingParams, cache_salt: str) -> tuple[SamplingParams, str]:
        """params.deterministic resolved (None: the engine's); a deterministic request that samples
        without a seed gets one, which keys its draws. Its prefix blocks are shared only with other
        deterministic requests': a block computed in a batch-dependent step holds other bits."""
        det = self.deterministic if params.deterministic is None else params.deterministic
        if det and self.invariant_reason:
            raise InvalidRequest(f"deterministic: {self.invariant_reason}")
        if det != params.deterministic or (det and not params.greedy and params.seed is None):
            seed = params.seed if params.seed is not None or not det or params.greedy else random.getrandbits(63)
            params = params.derive(deterministic=det, seed=seed)
        return params, cache_salt + "\0deterministic" if det else cache_salt

    def add_embedding(self, request_id: str | None, inputs: list, dimensions: int | None = None) -> str:
        """inputs: texts or token id lists, each one prefill whose pooled state is its embedding,
        or the Admitted ones of the daemon's validator (taken as they are); one output carries them
        all once every input is done (pooling.py). dimensions: keep the first this many components
        (Matryoshka), then normalise."""
        if self.pooling is None:
            raise InvalidRequest("this model generates text and has no embeddings (serve an embedding model, "
                                 "or say how to pool with --pooling last|mean)")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if not inputs:
            raise InvalidRequest("input is empty")
        size = self.loaded.config.hidden_size
        if dimensions is not None and not 1 <= dimensions <= size:
            raise InvalidRequest(f"dimensions must be in [1, {size}]")
        params = SamplingParams(max_tokens=1)  # the prefill's one greedy sample ends it; nothing reads it
        lists = [(x if isinstance(x, Admitted) else self.admit(x, params)).prompt_token_ids for x in inputs]
        samples = []
        for i, ids in enumerate(lists):
            req = Request(f"{request_id}#e{i}", ids, params, (), client_id=request_id, index=i,
                          embed_pooling=self.pooling)
            self.requests[req.request_id] = req
            self.scheduler.add_request(req)
            samples.append(req)
        self.groups[request_id] = samples
        self.embeddings[request_id] = samples, dimensions
        self.totals["requests"] += 1
        return request_id

    def abort_request(self, request_id: str) -> bool:
        samples = self.groups.get(request_id)
        if samples is None:
            return False
        for req in samples:
            self._finish(req, FinishReason.ABORT)
        return True

    def finish_sample(self, request_id: str, index: int, reason: FinishReason = FinishReason.STOP) -> bool:
        """End one sample of a request (the output processor found its stop string); its final
        output comes from the next step(). False if it is not here (finished meanwhile)."""
        samples = self.groups.get(request_id)
        if samples is None or not 0 <= index < len(samples):
            return False
        self._finish(samples[index], reason)
        return True

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if not req.is_finished:
            self.scheduler.finish_request(req, reason)
            if (o := self._emit(req, [], None)) is not None:
                self.pending.append(o)

    def has_unfinished(self) -> bool:
        return bool(self.groups) or bool(self.pending) or self.in_flight is not None

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan and launch a step, then read the previous one (overlapped) or this one.

        Overlapped, the host plans step N+1 while the device runs step N, and turns
        step N's tokens into outputs while the device runs N+1."""
        outputs, self.pending = self.pending, []
        if self.thread_governor is not None:
            self.thread_governor.tick()
        t0, busy0, waited = time.perf_counter(), self._tier_busy(), 0.0
        read = self.in_flight is not None
        if self.in_flight is not None and (not self.async_scheduling or self._needs_host_history()):
            outputs += self._complete(self.in_flight)
        with section("schedule"):
            out = self.scheduler.schedule()
        if out.is_empty and self.in_flight is None and self.scheduler.loading:
            # Nothing to run until a load from the KV tiers arrives: wait for one (not a stall).
            w0 = time.perf_counter()
            self.kv_cache_manager.wait_loads(LOAD_WAIT_S)
            waited = time.perf_counter() - w0
            with section("schedule"):
                out = self.scheduler.schedule()
        launched = self._launch(out, outputs) if not out.is_empty else None
        if self.in_flight is not None:
            outputs += self._complete(self.in_flight)
        self.in_flight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._complete(launched)
        if launched is not None or read:
            self._observe_tier_wait(time.perf_counter() - t0 - waited, self._tier_busy() - busy0)
        return outputs

    def _tier_busy(self) -> float:
        return self.tiers.busy_s if self.tiers is not None else 0.0

    def _observe_tier_wait(self, step_s: float, busy_s: float) -> None:
        w = self.tier_wait
        w["steps"] += 1
        w["step_s"] += step_s
        w["busy_s"] += busy_s
        w["max_frac"] = max(w["max_frac"], busy_s / step_s if step_s > 0 else 0.0)

    def close(self) -> None:
        """Let queued disk writes of the KV tiers finish and stop their threads."""
        if self.tiers is not None:
            self.tiers.flush()
            self.tiers.close()

    def _needs_host_history(self) -> bool:
        # Penalties and DRY read every earlier token on the host, the latest included;
        # a constraint's next mask needs its matcher advanced by the latest token.
        running = self.scheduler.running
        return any(r.params.reads_history for r in running) or self.constraints.needs_last_token(running)

    def _launch(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> StepHandle | None:
        now = time.monotonic()
        for s in out.scheduled:
            if s.request.timings.first_scheduled is None:
                s.request.timings.first_scheduled = now
        try:
            # Batch-invariant kernels for a step with a deterministic request in it (all of a
            # deterministic engine's): set before drafting, which self-speculation runs on the target.
            invariant = self.deterministic or any(s.request.params.deterministic for s in out.scheduled)
            self.cpu_formats.use(invariant)
            self.runner.batch_invariant = invariant
            if self.speculator is not None:  # drafts first: the constraints, then the scheduler fit them
                drafts = self.constraints.fit_drafts(out.scheduled, self.speculator.propose(out))
                self.scheduler.accept_drafts(out, drafts)
            return self.runner.launch(out)
        except Exception as e:  # fail this step's requests; keep serving the rest
            outputs += self._fail(out, internal_error(log, "step failed", e))
            return None

    def _complete(self, handle: StepHandle) -> list[RequestOutput]:
        """Read a launched step's tokens and turn them into outputs."""
        if handle is self.in_flight:
            self.in_flight = None
        out = handle.out
        try:
            tokens, samples = handle.read()
        except Exception as e:
            return self._fail(out, internal_error(log, "step failed", e))
        with section("sched_update"):
            self.scheduler.update(out, tokens)
            if self.state_slots is not None and self.speculator is not None:
                self.runner.restore_states(out, tokens)
        self.constraints.advance(out)
        self._account(out, tokens)
        with section("outputs"):
            outputs = self._postprocess(out, tokens, samples)
        seconds = time.perf_counter() - handle.t0  # the whole step but its drafting
        if self.speculator is not None:
            self.speculator.on_step(out, seconds)
        for observe in self.step_observers:
            observe(out, seconds)
        return outputs

    def _postprocess(self, out: SchedulerOutput, tokens, samples) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for s in out.scheduled:
            req = s.request
            if req.request_id not in self.requests:  # finished (stop, abort) while the step ran
                continue
            new = tokens.get(req.request_id, [])
            if not new and not req.is_finished:
                continue
            if new and req.timings.first_token is None:
                req.timings.first_token = now
            req.timings.token_times.extend([now] * len(new))
            res = samples.get(req.request_id)
            o = self._emit(req, new, res.logprobs if res and req.params.logprobs else None)
            if o is not None:
                outputs.append(o)
        return outputs

    def _emit(self, req: Request, new: list[int], logprobs) -> RequestOutput | None:
        if req.embed_pooling is not None:
            return self._emit_pooled(req)
        o = make_output(req, req.index, req.client_id, new, logprobs)
        if req.is_finished:
            self._forget(req)
        return o

    def _emit_pooled(self, req: Request) -> RequestOutput | None:
        """An embedding request's output once its last input is done; None before."""
        if not req.is_finished:
            return None
        group, dimensions = self.embeddings[req.client_id]
        self._forget(req)
        if any(r.request_id in self.requests for r in group):  # others still to come
            return None
        del self.embeddings[req.client_id]
        return pooled_output(req.client_id, group, dimensions, self._scores if self.judged is not None else None)

    def _scores(self, pooled: torch.Tensor) -> list[float]:
        return scores(self.model, pooled, self.judged)

    def rerank_inputs(self, query: str, documents: list[str], instruction: str | None = None) -> list[list[int]]:
        """A reranker's judging prompts (rerank.py), one per document, each within the prompt limit."""
        return [prompt_ids(self.tokenizer, query, d, instruction, self.max_model_len - 1) for d in documents]

    def _forget(self, req: Request) -> None:
        if self.requests.pop(req.request_id, None) is not None:
            self.metrics.observe(req)
            self.constraints.on_finish(req)
        self.runner.sampler.forget(req.request_id)
        group = self.groups.get(req.client_id)
        if group is not None and all(r.is_finished for r in group):
            del self.groups[req.client_id]

    def _fail(self, out: SchedulerOutput, error: str) -> list[RequestOutput]:
        self.totals["errors"] += 1
        outs = []
        for s in out.scheduled:
            if not s.request.is_finished:
                self.scheduler.finish_request(s.request, FinishReason.ERROR, error)
                if (o := self._emit(s.request, [], None)) is not None:
                    outs.append(o)
        return outs

    def _account(self, out: SchedulerOutput, tokens: dict[str, list[int]]) -> None:
        prefill = sum(max(0, min(s.start + s.num_scheduled_tokens, s.request.num_prompt_tokens) - s.start)
                      for s in out.scheduled)
        decode = sum(len(t) for t in tokens.values())
        self.history.append((time.monotonic(), prefill, decode))
        self.totals["prefill_tokens"] += prefill
        self.totals["decode_tokens"] += decode
        self.totals["steps"] += 1

    # -- figures -------------------------------------------------------------
    def stats(self) -> dict:
        from .stats import engine_stats
        return engine_stats(self)

    def model_info(self) -> dict:
        """What the model and its cache are (docs/protocol.md §7.1): the daemon's hello."""
        from .stats import model_info
        return model_info(self)

    def kv_waste(self) -> tuple[int, int]:
        """-> (reserved slots, filled slots) over running requests."""
        reserved = sum(len(self.kv_cache_manager.block_ids(r.request_id)) for r in self.scheduler.running) * self.config.block_size
        filled = sum(r.num_computed_tokens for r in self.scheduler.running)
        return reserved, filled
