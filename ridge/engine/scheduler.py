"""The scheduler: plain data in, plain data out, never a tensor.

One rule: each step, every running request's num_computed_tokens catches up
toward its token count (prompt + output + drafts) under a per-step token
budget. A long prompt therefore runs in chunks beside the decodes (chunked
prefill); a finished request leaves at once and a waiting one takes its place
in the same step (continuous batching). When blocks run out, the newest
running request is preempted by recompute: its blocks are freed and it
resumes later from its prompt and the output it already has.

schedule() advances num_computed_tokens as if the step had already run, and
counts a placeholder for each token it will sample; update() then reads the
step's tokens in and takes back drafts that were rejected. So the next step
can be planned while this one runs (overlap): a request's next input may be a
token that is still on the device, and a stop token takes effect one step
late (that step's token is dropped).

A request whose prefix is partly in the KV tiers (host RAM, disk) waits in
`loading` while those blocks are copied into its device blocks, and joins
`running` with num_computed_tokens past them: a prefix hit that took a while.

A model whose image tokens attend each other both ways (whole_image_runs: Gemma 3) needs each
image's run of placeholders computed in one step, as transformers needs it in one prefill chunk:
a chunk that would end inside a run ends before it, or, where the run starts the chunk, runs to
its end if the step's budget holds it (else waits for a step that does); a prefix hit that ends
inside a run is cut back to the run's first block."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ridge.cache.manager import ComputedBlocks, KVCacheManager
from ridge.cache.state_cache import StateCheckpoints, StateSlots

from .request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_scheduled_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    block_ids: list[int]  # the request's whole block table
    num_spec_tokens: int = 0  # drafted tokens among the scheduled ones (the last ones)
    draft_probs: object = None  # [num_spec, V] draft distribution, for model drafters that sample
    start: int = -1  # num_computed_tokens when scheduled
    samples: bool = False  # the step reaches the end of the known tokens, so the next one is sampled
    block_row: object = None  # block_ids as the manager's int32 array, for the block table's memcpy
    group_rows: tuple = ()  # the same for KV groups 1.. (sliding layers' own tables; cache/manager.py)
    state_slot: int = -1  # its slot in a hybrid model's state pools (cache/state_cache.py); -1: none
    state_source: int = -1  # a prefix hit's checkpoint slot, copied into state_slot before this step; -1: none

    def __post_init__(self):
        r = self.request
        self.start = r.num_computed_tokens
        self.samples = self.start + self.num_scheduled_tokens >= r.num_tokens_with_spec


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in batch order
    num_scheduled_tokens: int = 0
    preempted: list[str] = field(default_factory=list)  # preempted this step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def only_decodes(self) -> bool:
        """Every scheduled row lies past its request's prompt: last step's samples and the drafts
        that follow them, no prompt rows."""
        return all(s.start >= s.request.num_prompt_tokens for s in self.scheduled)


@dataclass(slots=True)
class SchedulerConfig:
    """Built by engine/builder.py from its EngineConfig and the step budget: no defaults of its own."""
    max_num_seqs: int
    max_num_batched_tokens: int  # the token budget of one step
    long_prefill_token_threshold: int  # the largest prefill chunk of one request per step
    block_size: int
    max_model_len: int
    whole_image_runs: bool = False  # ModelConfig.image_attention_bidirectional: never split an image's run

    def __post_init__(self):
        assert self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1
        self.long_prefill_token_threshold = min(self.long_prefill_token_threshold, self.max_num_batched_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, speculator=None,
                 state_slots: StateSlots | None = None, state_checkpoints: StateCheckpoints | None = None):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        # A hybrid model's state slots (one per running request, taken at admission and given back
        # with its blocks); None: the model keeps no recurrent state.
        self.state_slots = state_slots
        # A hybrid's prefix hits end where a state checkpoint is (None: no prefix cache for it).
        self.state_checkpoints = state_checkpoints
        self.speculator = speculator  # speculative.Speculator, None: no speculation
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # admitted, tier hits being copied into their blocks
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_preempted_waiting(self) -> int:
        return sum(1 for r in self.waiting if r.status == RequestStatus.PREEMPTED)

    def refuse_images(self, images) -> str | None:
        """Why a request with these image inputs can never be scheduled, or None: a run that must
        go whole into one step longer than the step's budget."""
        if self.config.whole_image_runs:
            longest = max((b - a for a, b in image_runs(images)), default=0)
            if longest > self.config.max_num_batched_tokens:
                return (f"images: an image of {longest} tokens, more than the {self.config.max_num_batched_tokens} "
                        "tokens of one step (this model needs each image in one step)")
        return None

    # -- schedule ---------------------------------------------------------------
    def _chunk(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens_with_spec - req.num_computed_tokens
        n = min(remaining, budget, self.config.long_prefill_token_threshold if remaining > 1 else remaining)
        return self._whole_runs(req, n, budget) if self.config.whole_image_runs and req.images else n

    @staticmethod
    def _whole_runs(req: Request, n: int, budget: int) -> int:
        """The chunk of n tokens, kept from ending inside an image's run (0: wait for a larger budget)."""
        start = req.num_computed_tokens
        for a, b in image_runs(req.images):
            if a < start + n < b:
                if a > start:
                    return a - start  # ends before the run
                return b - start if b - start <= budget else 0  # the run starts the chunk: all of it
        return n

    def _whole_hit(self, req: Request, hits):
        """A prefix hit cut back to the first block of the run it ends inside (whole_image_runs)."""
        bs, m = self.config.block_size, len(hits)
        for a, b in reversed(image_runs(req.images)):
            if a < m * bs < b:  # runs descend: a cut into an earlier run is caught in turn
                m = a // bs
        return self._shorten_hit(req, hits, m)

    def _shorten_hit(self, req: Request, hits, m: int):
        if m >= len(hits):
            return hits
        cut = ComputedBlocks(hits[:m]) if isinstance(hits, ComputedBlocks) else hits[:m]
        if isinstance(hits, ComputedBlocks):
            cut.others = [o[:m] for o in hits.others]
        self.kv_cache_manager.shorten_hit(req.request_id, m)
        return cut

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv_cache_manager.free(req.request_id)
        self._free_state(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    def _num_drafts(self, req: Request, budget: int, spec_so_far: int) -> int:
        """Drafts to reserve for a request about to decode one token whose last token is on the
        host; 0 = plain decode. How many is the Speculator's choice (draft_slots)."""
        if (self.speculator is None or req.num_output_placeholders
                or req.num_computed_tokens != req.num_tokens - 1):
            return 0
        room = min(req.params.max_tokens - len(req.output_token_ids) - 1,
                   self.config.max_model_len - req.num_tokens - 1, budget - 1)
        return self.speculator.draft_slots(req, room, len(self.running) + spec_so_far)

    def _awaiting_last_token(self, req: Request) -> bool:
        """Its unread sample is its last (max_tokens or the context): nothing more to compute."""
        return bool(req.num_output_placeholders) and (
            len(req.output_token_ids) + req.num_output_placeholders >= req.params.max_tokens
            or req.num_tokens >= self.config.max_model_len)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i, spec_so_far = 0, 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = 0 if self._awaiting_last_token(req) else self._chunk(req, budget)
            if n <= 0:
                i += 1
                continue
            k = self._num_drafts(req, budget, spec_so_far) if n == 1 else 0
            n += k
            spec_so_far += k
            while not self.kv_cache_manager.can_allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status == RequestStatus.PREEMPTED:
                break
            kv = self.kv_cache_manager
            blocks = kv.allocate(req.request_id, req.num_computed_tokens + n)
            out.scheduled.append(ScheduledRequest(req, n, blocks, k, block_row=kv.block_row(req.request_id),
                                                  group_rows=kv.group_rows(req.request_id),
                                                  state_slot=self._state_slot(req)))
            budget -= n
            i += 1
        return budget

    def _sibling_prefilling(self, req: Request) -> bool:
        # n > 1: wait until one sample has computed the shared prompt (its first token is
        # read, so its blocks are published), then hit its blocks.
        return req.group_id is not None and any(
            r.group_id == req.group_id and (r.num_computed_tokens < r.num_prompt_tokens or not r.output_token_ids)
            for r in self.running + self.loading)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        kv = self.kv_cache_manager
        skipped = []
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_output_placeholders:  # preempted with a sample unread: wait for it
                break
            if self._sibling_prefilling(req):
                skipped.append(self.waiting.popleft())
                continue
            if not req.prefill_only:
                hits, cached = kv.get_computed_blocks(req.request_id, req.block_token_ids, req.cache_salt,
                                                      req.block_chain)
                if self.config.whole_image_runs and req.images and hits:
                    hits = self._whole_hit(req, hits)
                    cached = min(cached, len(hits) * self.config.block_size)
                offloaded = kv.get_offloaded_blocks(req.request_id, req.block_token_ids, len(hits), req.cache_salt,
                                                    req.block_chain)
            else:  # it needs every token's state (an embedding's mean) and keeps no KV
                hits, cached, offloaded = [], 0, 0
            source = -1
            if self.state_checkpoints is not None and hits:
                hits, cached, source = self._checkpointed(req, hits)
            req.num_computed_tokens = cached
            n = offloaded * self.config.block_size if offloaded else self._chunk(req, budget)
            if (n <= 0 and req.images) or not kv.can_allocate(req.request_id, cached + n, hits) or (
                    self.state_slots is not None and not self.state_slots.can_allocate(req.request_id)):
                req.num_computed_tokens = 0
                kv.abandon_offloaded(req.request_id)
                break
            self.waiting.popleft()
            blocks = kv.allocate(req.request_id, cached + n, hits)
            if self.state_slots is not None:
                self.state_slots.allocate(req.request_id)
            req.num_cached_tokens = cached
            if offloaded:  # computed nothing this step: joins running once they are in
                kv.load_offloaded(req.request_id)
                req.status = RequestStatus.LOADING
                self.loading.append(req)
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, blocks, block_row=kv.block_row(req.request_id),
                                                  group_rows=kv.group_rows(req.request_id),
                                                  state_slot=self._state_slot(req), state_source=source))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _admit_loaded(self) -> None:
        for req_id, computed in self.kv_cache_manager.poll_loads().items():
            req = next(r for r in self.loading if r.request_id == req_id)
            self.loading.remove(req)
            req.num_computed_tokens = req.num_cached_tokens = computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.loading:
            self._admit_loaded()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # admitting while evicting would thrash
            budget = self._schedule_waiting(out, budget)
        out.num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        for s in out.scheduled:  # as if the step had run; update() corrects drafts
            s.request.num_computed_tokens += s.num_scheduled_tokens
            if s.samples:
                s.request.num_output_placeholders += 1
        return out

    def accept_drafts(self, out: SchedulerOutput, drafts: dict) -> None:
        """Fit the plan to the drafts a proposer returned (request id -> Draft): each
        request keeps at most the slots it reserved; slots left empty are given back
        to the step (and their blocks at update)."""
        for s in out.scheduled:
            if not s.num_spec_tokens:
                continue
            req = s.request
            d = drafts.get(req.request_id)
            tokens = list(d.token_ids[: s.num_spec_tokens]) if d is not None else []
            req.spec_token_ids = tokens
            req.draft_source = d.source if d is not None else ""
            s.draft_probs = d.probs[: len(tokens)] if d is not None and d.probs is not None else None
            unused = s.num_spec_tokens - len(tokens)
            s.num_scheduled_tokens -= unused
            req.num_computed_tokens -= unused  # schedule() counted the reserved slots as computed
            out.num_scheduled_tokens -= unused
            s.num_spec_tokens = len(tokens)

    # -- update -----------------------------------------------------------------
    def update(self, out: SchedulerOutput, new_tokens: dict[str, list[int]]) -> list[Request]:
        """Read a step's tokens in: new_tokens maps request id -> tokens accepted this step
        (empty for a prefill chunk that did not reach the end); cut here to the tokens kept,
        since tokens past a stop token are dropped, and dropped whole for a request that
        finished (or was aborted) while the step ran. Returns requests finished now."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if s.samples:
                req.num_output_placeholders = max(0, req.num_output_placeholders - 1)
            if req.is_finished:
                new_tokens.pop(req.request_id, None)
                continue
            accepted = new_tokens.get(req.request_id, [])
            live = req.status == RequestStatus.RUNNING  # not preempted since the step was planned
            if s.num_spec_tokens:
                num_accepted = max(0, len(accepted) - 1)
                if self.speculator is not None:
                    self.speculator.on_verified(req, s.num_spec_tokens, num_accepted)
                if live:  # drafted tokens that were rejected were never really computed
                    req.num_computed_tokens -= s.num_spec_tokens - num_accepted
            req.spec_token_ids = []
            for i, t in enumerate(accepted):
                req.append_output(t)
                if self._check_stop(req, t):
                    new_tokens[req.request_id] = accepted[:i + 1]
                    break
            if live:
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                if s.num_spec_tokens:  # roll back the blocks that only rejected drafts used
                    self.kv_cache_manager.truncate(req.request_id, req.num_computed_tokens)
                done = min(req.num_computed_tokens, req.num_known_tokens)
                if not req.prefill_only:
                    self.kv_cache_manager.cache_blocks(req.request_id, req.block_token_ids, done,
                                                       salt=req.cache_salt, chain=req.block_chain)
                elif done >= req.num_prompt_tokens:  # its prompt's states are all it asked for
                    req.finish(FinishReason.STOP)
                self.kv_cache_manager.free_behind_window(req.request_id, done)
            if req.is_finished:
                finished.append(req)
        for req in finished:
            self._remove(req)
        return finished

    def _checkpointed(self, req: Request, hits) -> tuple[list, int, int]:
        """A hybrid's prefix hit cut back to its last block with a state checkpoint
        (cache/state_cache.py) -> (the hit, tokens it covers, the checkpoint's slot or -1)."""
        hashes = req.block_chain.hashes
        m = self.state_checkpoints.longest(hashes, len(hits))
        hits = self._shorten_hit(req, hits, m)
        return hits, m * self.config.block_size, self.state_checkpoints.find(hashes[m - 1]) if m else -1

    def _state_slot(self, req: Request) -> int:
        return self.state_slots.slot(req.request_id) if self.state_slots is not None else -1

    def _free_state(self, req: Request) -> None:
        if self.state_slots is not None:
            self.state_slots.free(req.request_id)

    def _check_stop(self, req: Request, token: int) -> bool:
        p = req.params
        if (not p.ignore_eos and token in req.eos_token_ids) or token in p.stop_token_ids:
            req.finish(FinishReason.STOP)
        elif len(req.output_token_ids) >= p.max_tokens:
            req.finish(FinishReason.LENGTH)
        return req.is_finished

    def finish_request(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """Abort, error or a stop string: the request leaves and its blocks return."""
        if not req.is_finished:
            req.finish(reason, error)
        self._remove(req)

    def _remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.loading:
            self.loading.remove(req)
        self.kv_cache_manager.free(req.request_id)
        self._free_state(req)
        if self.speculator is not None:
            self.speculator.on_finish(req.request_id)


def image_runs(images) -> list[tuple[int, int]]:
    """The [start, end) position runs of a prompt's image inputs, adjacent ones joined (transformers
    numbers a block of image tokens by contiguity: two inputs side by side are one block)."""
    runs: list[list[int]] = []
    for im in sorted(images, key=lambda im: im.offset):
        if runs and runs[-1][1] == im.offset:
            runs[-1][1] = im.end
        else:
            runs.append([im.offset, im.end])
    return [(a, b) for a, b in runs]
