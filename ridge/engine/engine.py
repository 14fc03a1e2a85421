"""The engine API the daemon calls: add requests, abort them, step, take outputs.

step() = schedule -> run -> update, as in nano-vllm and vLLM V1."""
from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections import deque

import torch

from ridge.cache.kv_cache import KVCache
from ridge.cache.manager import KVCacheManager
from ridge.cache.state_cache import StateCheckpoints, StateSlots
from ridge.config import draft_table_mismatch
from ridge.errors import InvalidRequest, internal_error
from ridge.models.loader import LoadedModel, load_model

from ridge.kernels import native, ops
from ridge.kernels.timing import section

from .admit import Admitted, Rules
from .budget import default_token_budget, pooled_token_budget
from .config import EngineConfig
from .cpu_format import CpuFormats, choose_cpu_format, fp8_max_tokens, invariant_unavailable, keep_freed_memory
from .kv_tiers import build_tiers
from .metrics import RequestMetrics
from .output import RequestOutput, TextState, make_output
from .pooling import pooled_output, resolve_pooling
from .rerank import judged_tokens, prompt_ids, scores
from .request import FinishReason, Request, RequestStatus
from .runner import ModelRunner, StepHandle
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .hybrid import hybrid_config
from .sizing import measure_activation_peak, plan_memory
from .speculative import build_speculator, plan_speculation
from .threads import ThreadGovernor
from .structured import Constraints

log = logging.getLogger("ridge.engine")
CUDA_HOST_THREADS = 4  # torch CPU threads of a GPU engine unless --threads says otherwise
# A hybrid model's prefix cache: state checkpoints at block boundaries, this many per request in
# flight (each a whole recurrent state: cache/state_cache.py), least recently used evicted.
STATE_CHECKPOINTS_PER_SEQ = 4
LOAD_WAIT_S = 0.05  # nothing to run but loads from the KV tiers: wait this long for one, then plan again


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = loaded.device.type if loaded else config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu":
            native.start_build()  # ridge's CPU kernels compile (first start) while the model loads
        self.loaded = loaded
        if loaded is None:
            self.loaded = load_model(config.model, device=config.device, max_model_len=config.max_model_len,
                                     weights=config.weights, recipe=config.fp8_recipe)
            # ridge bench loading --model reads this line: the load apart from the process's start
            log.info("weights loaded in %.2f s (%s)", self.loaded.load_seconds,
                     "from the converted cache" if self.loaded.from_cache else "converted from the source")
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        # A hybrid model runs without what its recurrent state does not support yet (hybrid.py).
        self.config = config = self._hybrid(config)
        self.device = self.loaded.device
        if self.device.type == "cuda" and not config.num_threads:
            # The host only plans steps and samples small tensors: torch's default of
            # one intra-op thread per core kept 10-15 cores busy for nothing.
            torch.set_num_threads(min(CUDA_HOST_THREADS, os.cpu_count() or 1))
        self.max_model_len = min(config.max_model_len or self.model.max_model_len, self.model.max_model_len)
        self.kv_dtype = config.resolved_kv_dtype(self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.thread_governor = ThreadGovernor(torch.get_num_threads()) \
            if self.device.type == "cpu" and config.adaptive_threads else None
        # What the model is (--pooling, else its metadata): last or mean for an embedding model, None if it generates.
        self.pooling = resolve_pooling(config.pooling, self.loaded.path)
        self._plan_budget()
        budget = self.sched_config.max_num_batched_tokens
        head_rows = min(budget, config.max_num_seqs * (1 + (config.num_speculative_tokens
                                                            if config.speculative_config.enabled else 0)))
        self.deterministic = config.deterministic
        self.invariant_reason = invariant_unavailable(self.device)
        if config.deterministic and self.invariant_reason:
            raise ValueError(f"--deterministic: {self.invariant_reason}")
        # A deterministic engine runs every step batch-invariant: the fastest formats by step size are never used.
        self.lowp_max_tokens = 0 if config.deterministic else choose_cpu_format(
            self.model, self.loaded.weight_bytes, config.cpu_weight_format, budget, head_rows)
        self.cpu_formats = CpuFormats(self.model, budget, head_rows, config.deterministic)
        self.fp8_max_tokens = fp8_max_tokens(self.model)
        spec = plan_speculation(config.speculative_config, self.device, config.weights, self.max_model_len,
                                self.tokenizer, self.budget_info["knee_tokens"], self.model)
        draft = spec.draft if spec is not None else None
        if draft is not None and (why := draft_table_mismatch(self.loaded.config, draft.config)):
            raise ValueError(f"the draft model {draft.path.name}: {why}")
        if draft is not None and draft.config.linear_layers:  # its states would need slots and rollback of their own
            raise ValueError(f"the draft model {draft.path.name}: a hybrid model (recurrent state) cannot draft yet")
        if draft is not None:  # the draft steps as often as the target: it gets the same CPU format
            choose_cpu_format(draft.model, draft.weight_bytes, config.cpu_weight_format, budget, head_rows)
        act = measure_activation_peak(self._profile_forward, self.device)
        state_pool = self._state_pool(spec)
        self.memory = plan_memory(self.loaded.config, self.kv_dtype, config.block_size, self.device,
                                  self.loaded.weight_bytes + (spec.weight_bytes if spec else 0), act,
                                  gpu_reserve_gib=config.gpu_reserve_gib, cpu_kv_cap_gib=config.cpu_kv_cap_gib,
                                  kv_memory_gib=config.kv_memory_gib, num_blocks=config.num_kv_blocks,
                                  max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=self.sched_config.max_num_batched_tokens,
                                  extra_bytes_per_token=spec.kv_bytes_per_token(self.kv_dtype) if spec else 0,
                                  state_bytes=state_pool * self.loaded.config.state_bytes_per_request())
        blocks = self.memory.group_blocks  # one pool per KV group (cache/manager.py)
        self.kv_cache = KVCache(self.loaded.config, blocks, config.block_size, self.kv_dtype, self.device,
                                num_state_slots=state_pool)
        self.kv_cache_manager = KVCacheManager(None, config.block_size, config.enable_prefix_caching, groups=[
            (g.window, n) for g, n in zip(self.loaded.config.kv_groups(), blocks)])
        self.runner = ModelRunner(self.model, self.kv_cache, config.max_num_seqs, self.max_model_len,
                                  config.cuda_graph, self.sched_config.max_num_batched_tokens)
        self.runner.state_slots, self.runner.state_checkpoints = self.state_slots, self.state_checkpoints
        # The two concerns the engine calls at named points (speculative/__init__.py,
        # structured/__init__.py), and nowhere else.
        self.speculator = build_speculator(spec, self.model, self.kv_cache, self.runner.sampler,
                                           self.sched_config.max_num_batched_tokens, config.max_num_seqs,
                                           self.runner.bufs.width) if spec is not None else None
        self.constraints = Constraints(self.tokenizer, self.loaded.config.vocab_size)
        self.runner.speculator, self.runner.constraints = self.speculator, self.constraints
        self.runner.pooling = self.pooling is not None
        self.judged = judged_tokens(self.tokenizer, self.loaded.path) if self.pooling == "rank" else None
        self.embeddings: dict[str, tuple] = {}  # embedding request id -> (its inputs' requests, dimensions)
        self.scheduler = Scheduler(self.sched_config, self.kv_cache_manager, self.speculator, self.state_slots,
                                   self.state_checkpoints)
        caches = [self.kv_cache] + (self.speculator.caches if self.speculator else [])  # what the block ids index
        self.tiers = build_tiers(config, self.loaded, draft, caches, self.kv_dtype)
        if self.tiers is not None:
            self.kv_cache_manager.attach_tiers(self.tiers)
        # Engine-thread time in tier work against step time (steps that ran or read work).
        self.tier_wait = {"steps": 0, "step_s": 0.0, "busy_s": 0.0, "max_frac": 0.0}
        # Overlap needs the device to run apart from the host: on CPU both are the same
        # cores, so a step would only finish later. Drafting reads the last token on the host.
        overlap = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        self.async_scheduling = overlap and self.speculator is None
        self.in_flight: StepHandle | None = None  # the launched step not yet read
        # Called with (the step's plan, seconds from its launch to its tokens read) for each
        # step read: the explicit hook benchmarks time steps with.
        self.step_observers: list = []
        self.proposer_name = self.speculator.name if self.speculator is not None else "off"
        self.grammars = self.constraints.grammars  # the daemon's validator compiles with the same compiler
        self.requests: dict[str, Request] = {}  # internal id -> request
        self.groups: dict[str, list[Request]] = {}  # client id -> its samples
        self.texts: dict[str, TextState] = {}
        self.pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._ids = itertools.count()
        self.started = time.monotonic()
        self.history: deque[tuple[float, int, int]] = deque(maxlen=4096)  # (time, prefill tok, decode tok)
        self.totals = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "requests": 0, "errors": 0}
        self.metrics = RequestMetrics()  # histograms of finished requests, for monitoring

    # -- set-up -----------------------------------------------------------------
    def _hybrid(self, config: EngineConfig) -> EngineConfig:
        config, self.hybrid_refusals = hybrid_config(config, self.loaded.config)
        return config

    def _state_pool(self, spec) -> int:
        """A hybrid model's state slots (cache/state_cache.py): one per request in flight, with
        speculation one per draft each to roll back to, and with prefix caching the checkpoints
        (STATE_CHECKPOINTS_PER_SEQ per request in flight); 0 for a model without linear layers."""
        self.state_slots = self.state_checkpoints = None
        if not self.loaded.config.linear_layers:
            return 0
        self.state_slots = StateSlots(self.config.max_num_seqs, self.config.num_speculative_tokens if spec else 0)
        if not self.config.enable_prefix_caching:
            return self.state_slots.pool_size
        count = STATE_CHECKPOINTS_PER_SEQ * self.config.max_num_seqs
        self.state_checkpoints = StateCheckpoints(self.state_slots.pool_size, count)
        return self.state_slots.pool_size + count

    def _plan_budget(self) -> None:
        c = self.config
        fp8 = ops.keeps_fp8(self.device) and self.loaded.weights == "fp8"
        b = 1 if fp8 else self.model.dtype.itemsize
        mc = self.loaded.config  # a mixture of experts' chunk grows by E / k (engine/budget.py)
        experts = (mc.num_experts, mc.num_experts_per_tok) if mc.num_experts else None
        chunk, self.budget_info = default_token_budget(self.device, b, fp8, c.ridge_point, experts)
        chunk = c.prefill_chunk or chunk
        # An embedding engine's step is sized for whole prefills, a generating one's for its decodes' latency.
        step = c.max_num_seqs + chunk
        if self.pooling is not None:
            chunk = step = c.prefill_chunk or pooled_token_budget(chunk, c.max_num_seqs)
        self.sched_config = SchedulerConfig(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=step,
                                            long_prefill_token_threshold=chunk, block_size=c.block_size,
                                            max_model_len=self.max_model_len)
        self.budget_info["prefill_chunk"] = chunk
        log.info("step budget: ridge point %.1f FLOP/B (%s), T* = %.1f tokens, prefill chunk %d, %d tokens per step",
                 self.budget_info["ridge_point"], self.budget_info["ridge_source"], self.budget_info["knee_tokens"],
                 chunk, self.sched_config.max_num_batched_tokens)

    def _profile_forward(self) -> None:
        """One forward pass at the largest step, into a scratch cache."""
        n = self.sched_config.max_num_batched_tokens
        bs = self.config.block_size
        scratch = KVCache(self.loaded.config, -(-n // bs), bs, self.kv_dtype, self.device)
        from ridge.kernels.metadata import AttentionMetadata
        meta = AttentionMetadata.build([n], [n], [list(range(-(-n // bs)))], list(range(n)), self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device) % self.max_model_len, meta, scratch.layers)
        self.model.compute_logits(hidden[: self.config.max_num_seqs])
        del scratch

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
        params, cache_salt = self._resolve_deterministic(params, cache_salt)
        compiled = self.compile_constraint(params)
        samples = []
        for i in range(params.n):
            iid = request_id if params.n == 1 else f"{request_id}#{i}"
            sp = params if params.n == 1 or params.seed is None else \
                params.derive(seed=(params.seed + i) % (1 << 63))  # distinct samples
            req = Request(iid, ids, sp, tuple(self.tokenizer.eos_token_ids),
                          group_id=request_id if params.n > 1 else None, client_id=request_id, index=i,
                          cache_salt=cache_salt,
                          matcher=self.constraints.matcher(compiled))  # one per sample
            self.requests[iid] = req
            self.texts[iid] = TextState(self.tokenizer, req)
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

    def embed(self, inputs: list, dimensions: int | None = None) -> RequestOutput:
        """Run one embedding request to completion."""
        rid = self.add_embedding(None, inputs, dimensions)
        final = None
        while self.has_unfinished():
            final = next((o for o in self.step() if o.request_id == rid), final)
        return final

    def abort_request(self, request_id: str) -> bool:
        samples = self.groups.get(request_id)
        if samples is None:
            return False
        for req in samples:
            if not req.is_finished:
                self.scheduler.finish_request(req, FinishReason.ABORT)
                if (o := self._emit(req, [], None)) is not None:
                    self.pending.append(o)
        return True

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
        text, hit = self.texts[req.request_id].add(new, req.is_finished)
        if hit and not req.is_finished:
            self.scheduler.finish_request(req, FinishReason.STOP)
            text += self.texts[req.request_id].add([], True)[0]
        o = make_output(req, req.index, req.client_id, new, text, logprobs)
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
        self.texts.pop(req.request_id, None)
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

    # -- convenience ------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; -> one merged final output per prompt (sample 0)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(None, p, sp) for p, sp in zip(prompts, plist)]
        merged = {i: RequestOutput(i, 0, [], "") for i in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.index == 0 and o.request_id in merged:
                    m = merged[o.request_id]
                    m.new_token_ids += o.new_token_ids
                    m.new_text += o.new_text
                    m.finished, m.finish_reason, m.error = o.finished, o.finish_reason, o.error
                    m.num_prompt_tokens, m.num_output_tokens, m.timings = o.num_prompt_tokens, o.num_output_tokens, o.timings
                    m.num_cached_tokens = o.num_cached_tokens
        return [merged[i] for i in ids]

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
