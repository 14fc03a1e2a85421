"""The model runner: a scheduler step -> one flattened batch -> tokens.

It plans the step's inputs on the host (step_batch.py), runs the model once
over every scheduled token of every request (a CUDA graph on a GPU), and
samples from the rows that end a request's known tokens. Drafted tokens are
simply more scheduled tokens; their rows are verified. Between the forward and
the samples it calls two hooks the engine gives it: the constraints' masks
(structured.Constraints.mask) and the speculator's verification
(speculative.Speculator.verify).

launch() queues a step and returns without waiting for the device; the
step's tokens are read with StepHandle.read(). A request whose last input is
the previous step's sample gets it on the device (the feed), so the engine can
plan and launch step N+1 before it reads step N. Drafting and verification
read tokens on the host, so the engine does not overlap steps that speculate
(the engine asks the Speculator for drafts before it launches a step). Every
speculating request is verified in one batched pass, read with the samples."""
from __future__ import annotations

import time

import torch

from ridge.cache.kv_cache import KVCache
from ridge.cache.state_cache import restore
from ridge.kernels.cpu_linear import decode_step
from ridge.kernels.timing import section

from ridge.models.layers.mrope import step_positions

from .graphs import StepGraphs
from .pooling import pool_step
from .request import RequestStatus
from .sampler import SampledRows, Sampler, SampleResult
from .scheduler import SchedulerOutput, image_runs
from .speculative.verify import Verified
from .step_batch import StepBatch, StepBuffers, plan_step


class StepHandle:
    """A launched step. read() -> (request id -> new tokens, request id -> sample result)."""

    def __init__(self, out: SchedulerOutput, sampled: SampledRows | None, plain: list, verified: Verified | None,
                 started: float):
        self.out = out
        self.sampled = sampled  # the plain rows' samples (and the verification's values), on the device
        self.plain = plain  # request ids of the plain rows, in order
        self.rows = {rid: i for i, rid in enumerate(plain)}  # what the next step's feed indexes
        self.verified = verified
        self.t0 = started  # after drafting, which the policy prices on its own
        self._result = None

    def read(self) -> tuple[dict[str, list[int]], dict[str, SampleResult]]:
        if self._result is None:
            tokens, results = {}, {}
            if self.sampled is not None:
                res = self.sampled.read()
                for rid, t, lp in zip(self.plain, res.token_ids, res.logprobs):
                    tokens[rid] = [t]
                    results[rid] = SampleResult([t], [lp])
                if self.verified is not None:
                    tokens.update(self.verified.resolve(self.sampled.extra))
            self._result = tokens, results
        return self._result


def image_spans(out: SchedulerOutput) -> tuple | None:
    """AttentionMetadata.spans for a model whose image tokens attend each other both ways: each
    scheduled request's image runs (adjacent ones joined, scheduler.image_runs) this step computes;
    None when the step holds none. The scheduler keeps a run whole; one whose first tokens came
    from the KV tiers starts at the step (its keys before it are seen causally anyway)."""
    spans, any_run = [], False
    for s in out.scheduled:
        a, b = s.start, s.start + s.num_scheduled_tokens
        runs = tuple((max(lo, a), hi) for lo, hi in image_runs(s.request.images) if lo < b and hi > a)
        spans.append(runs)
        any_run |= bool(runs)
    return tuple(spans) if any_run else None


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, max_num_seqs: int, max_model_len: int | None,
                 cuda_graph: bool | None, max_num_batched_tokens: int | None, *, sampler: Sampler, speculator,
                 constraints, pooling: bool, state_slots, state_checkpoints, encoder):
        """The values come from EngineConfig (through builder.py), their one declaration. The hooks
        between the forward and the samples (None: none to call): constraints (structured.Constraints),
        speculator (speculative.Speculator, whose proposer shares `sampler`); pooling: an embedding
        model's engine, whose steps pool their requests' states and sample nothing; state_slots and
        state_checkpoints: a hybrid model's StateSlots and StateCheckpoints (cache/state_cache.py);
        encoder: an image model's encoder.EncoderStep."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = model.cos_sin.device
        self.sampler = sampler
        max_len = max_model_len or model.max_model_len
        max_tokens = max(max_num_batched_tokens or max_num_seqs, max_num_seqs)
        # Drafts and the padded graph shapes never exceed the step budget; a draft model's
        # own plan (include_spec=False) is smaller still.
        self.bufs = StepBuffers(max_tokens, max_num_seqs, -(-max_len // self.block_size), self.device,
                                kv_cache.num_groups)
        self.graphs = None
        # A hybrid model's linear-attention layers read state slots per request (cache/state_cache.py),
        # which a captured graph's padded sequences have none of: its steps run eagerly.
        self.stateful = bool(model.cfg.linear_layers)
        self.state_slots, self.state_checkpoints = state_slots, state_checkpoints
        if (cuda_graph if cuda_graph is not None else self.device.type == "cuda") and not self.stateful:
            # On CPU (tests) the same padded buffers run eagerly.
            self.graphs = StepGraphs(lambda ids, pos, meta: self.model(ids, pos, meta, self.kv_cache.layers),
                                     self.bufs, self.block_size, max_num_seqs, max_tokens, max_len, enabled=True,
                                     num_kv_blocks=min(kv_cache.group_blocks))
            if self.graphs.pool is not None:  # capture writes the static buffers: before any step does
                self.graphs.capture()
        self.last: StepHandle | None = None  # the latest launched step, whose samples feed the next
        self.constraints, self.speculator, self.pooling, self.encoder = constraints, speculator, pooling, encoder
        self.batch_invariant = False  # the next step's attention must not depend on its batch (set per step)
        # each KV group's window, in the metadata's order (group 0, then meta.groups)
        self.kv_windows = [g.window for g in model.cfg.kv_groups()] or [None]
        self.mrope = "mrope_section" in model.cfg.extra  # image tokens rotate by three positions (Qwen-VL)

    def plan(self, out: SchedulerOutput, include_spec: bool = True, graph=None) -> StepBatch:
        prev = self.last.rows if self.last is not None else None
        batch = plan_step(out, self.block_size, self.bufs, include_spec, graph, prev)
        bidirectional = self.model.cfg.image_attention_bidirectional
        spans = image_spans(out) if bidirectional else None
        for g, meta in enumerate((batch.meta, *batch.meta.groups)):
            meta.batch_invariant = self.batch_invariant
            meta.spans = spans if bidirectional is True or self.kv_windows[g] is not None else None
        if self.mrope:
            self._mrope(out, batch, include_spec)
        if self.stateful:
            self._state_meta(out, batch.meta, include_spec)
        if batch.feed is not None:
            dst, src = batch.feed
            batch.input_ids.index_copy_(0, dst, self.last.sampled.token_ids.index_select(0, src))
        return batch

    def _mrope(self, out: SchedulerOutput, batch: StepBatch, include_spec: bool) -> None:
        """Multimodal rotary positions (models/layers/mrope.py), from each request's table: its rows'
        positions shifted past the images before them, its image rows' three positions on the
        metadata. Requests without images keep their indices."""
        items = []
        for s in out.scheduled:
            n = s.num_scheduled_tokens - (0 if include_spec else s.num_spec_tokens)
            items.append((s.request.mrope, batch.last_row[id(s)] + 1 - n, s.start, n))
        got = step_positions(items, self.device)
        image = None
        if got is not None:
            shift, image = got
            batch.positions[:shift.shape[0]] += shift
        for meta in (batch.meta, *batch.meta.groups):
            meta.mrope = image

    def _state_meta(self, out: SchedulerOutput, meta, include_spec: bool) -> None:
        """A hybrid model's state slots (the scheduler's, one per request) and whether each request
        continues from its slot's state: it does past its first chunk (a preempted request restarts
        from its prompt, so from zeros), and after a prefix hit, from the hit's checkpoint copied in
        here. The state after some tokens is also kept (token_state_slots): after each token of a
        speculating request's span but the last, in its scratch slots, which a rejection rolls back
        to (restore_states); after each prompt token that ends a block, as that block's checkpoint."""
        slots = [s.state_slot for s in out.scheduled]
        assert all(x >= 0 for x in slots), "a hybrid model's request scheduled without a state slot"
        for s in out.scheduled:
            if s.state_source >= 0 and s.start > 0:
                restore(self.kv_cache.layers, s.state_slot, s.state_source)
        meta.state_slots = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        meta.has_initial_state = torch.tensor([s.start > 0 for s in out.scheduled]).to(self.device, non_blocking=True)
        keep = self._kept_states(out, include_spec)
        meta.token_state_slots = None if keep is None else \
            torch.tensor(keep, dtype=torch.int64).to(self.device, non_blocking=True)

    def _kept_states(self, out: SchedulerOutput, include_spec: bool) -> list[int] | None:
        """token_state_slots for the step's rows (-1: kept nowhere); None where none is kept."""
        ckpt, bs = self.state_checkpoints, self.block_size
        if ckpt is not None:
            ckpt.begin_step()
        elif not include_spec or not any(s.num_spec_tokens for s in out.scheduled):
            return None
        keep, row = None, 0
        total = sum(s.num_scheduled_tokens - (0 if include_spec else s.num_spec_tokens) for s in out.scheduled)
        for s in out.scheduled:
            n = s.num_scheduled_tokens - (0 if include_spec else s.num_spec_tokens)
            k = s.num_spec_tokens if include_spec else 0
            kept = {j: self.state_slots.scratch(s.state_slot, j) for j in range(k)}
            if ckpt is not None:  # each token that ends a block whose hash the request's chain holds
                hashes = s.request.block_chain.hashes
                for end in range(-(-(s.start + 1) // bs) * bs, min(s.start + n, len(hashes) * bs) + 1, bs):
                    j = end - 1 - s.start
                    if j >= k and (slot := ckpt.take(hashes[end // bs - 1])) is not None:
                        kept[j] = slot
            if kept:
                keep = keep or [-1] * total
                for j, slot in kept.items():
                    keep[row + j] = slot
            row += n
        return keep

    def restore_states(self, out: SchedulerOutput, tokens: dict[str, list[int]]) -> None:
        """After a speculative step is read: each running request that accepted a of its k drafts
        (a < k) continues from the state after token a of its span, kept in its scratch slot."""
        for s in out.scheduled:
            req = s.request
            if not s.num_spec_tokens or req.status != RequestStatus.RUNNING or req.request_id not in tokens:
                continue  # finished or preempted while the step ran: its slot is no longer its
            a = len(tokens[req.request_id]) - 1
            if a < s.num_spec_tokens and s.state_slot == self.state_slots.slot(req.request_id):
                restore(self.kv_cache.layers, s.state_slot, self.state_slots.scratch(s.state_slot, a))

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> tuple[StepBatch, torch.Tensor]:
        """Run the model over the step; -> (batch, hidden states [num tokens, H])."""
        images = self.encoder is not None and self.encoder.needed(out)
        with section("batch_build"):
            shape = None
            if self.graphs is not None and not images:
                pure_decode = all(s.num_scheduled_tokens == 1 for s in out.scheduled)
                num_tokens = sum(s.num_scheduled_tokens for s in out.scheduled)
                shape = self.graphs.shape_for(len(out.scheduled), num_tokens, pure_decode)
            batch = self.plan(out, graph=shape)
        if shape is not None:
            hidden = self.graphs.run(shape, batch)
        elif images:
            with section("encoder"):
                embeds = self.encoder.embeds(out, batch.last_row)
            hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers, embeds=embeds)
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers)
        return batch, hidden

    @torch.inference_mode()
    def forward_logits(self, out: SchedulerOutput) -> tuple[StepBatch, torch.Tensor]:
        """Run the model over the step; -> (batch, logits [num sample rows, V]). A step of decodes
        alone may round its CPU products' activations to bf16 (cpu_linear.decode_step, --cpu-amx)."""
        with decode_step(out.only_decodes):
            batch, hidden = self.forward(out)
            if self.speculator is not None:  # a draft head (speculative/mtp.py) reads every row's final state
                self.speculator.on_forward(out, batch, hidden)
            return batch, self.model.compute_logits(hidden.index_select(0, batch.sample_rows))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> StepHandle:
        started = time.perf_counter()
        if self.pooling:
            return self._pool(out, started)
        batch, raw = self.forward_logits(out)
        logits, masked = raw, False
        if self.constraints is not None:
            with section("constraints"):  # every constrained row of the step, plain and verified, at once
                logits, masked = self.constraints.mask(out.scheduled, batch.sample_spans, raw)
        plain_rows, plain, spec = [], [], []
        for s, (first, k) in zip(out.scheduled, batch.sample_spans):
            if k == 1:
                plain_rows.append(first)
                plain.append(s)
            elif k > 1:
                spec.append((s, first, k))
        verified = None
        if spec:
            with section("verify"):
                verified = self.speculator.verify(logits, spec, self.sampler)
        sampled = None
        extra = verified.values if verified is not None else None
        with section("sample"):
            reqs = [s.request for s in plain]
            pos = [s.start + s.num_scheduled_tokens for s in plain]  # the token each row draws
            if plain and len(plain_rows) == logits.shape[0]:
                sampled = self.sampler.sample(logits, reqs, raw, extra, pos)
            elif plain:
                idx = torch.tensor(plain_rows, device=self.device)
                sampled = self.sampler.sample(logits.index_select(0, idx), reqs,
                                              raw.index_select(0, idx) if masked else None, extra, pos)
            elif verified is not None:
                sampled = SampledRows(torch.empty(0, dtype=torch.int64, device=self.device), [], None, extra)
        self.last = StepHandle(out, sampled, [s.request.request_id for s in plain], verified, started)
        return self.last

    def _pool(self, out: SchedulerOutput, started: float) -> StepHandle:
        """An embedding model's step: its requests' states pooled (pooling.py), nothing sampled. The
        head's product (a row of vocab x hidden each, as much as a short input's whole forward) is
        never run; each request ends once its prompt is computed (Request.prefill_only)."""
        batch, hidden = self.forward(out)
        pool_step(out, batch.last_row, hidden)
        self.last = StepHandle(out, None, [], None, started)
        return self.last
