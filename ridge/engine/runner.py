"""The model runner: a scheduler step -> one flattened batch -> tokens.

It turns the plan into tensors (token ids, positions, block table, slot
mapping, sequence lengths), runs the model once over every scheduled token of
every request, and samples from the rows that end a request's known tokens.
Drafted tokens are simply more scheduled tokens; their rows are verified.
Per-step Python work is O(requests); nothing here loops over tokens."""
from __future__ import annotations

import time

import torch

from ridge.cache.kv_cache import KVCache
from ridge.kernels.cuda_graph import DecodeGraphRunner
from ridge.kernels.metadata import AttentionMetadata
from ridge.kernels.timing import section

from .sampler import Sampler, SampleResult
from .scheduler import SchedulerOutput
from .spec.verify import verify


class StepBatch:
    """The tensors of one step, on the model's device. include_spec=False
    leaves out drafted tokens (what a draft model must see)."""

    def __init__(self, out: SchedulerOutput, block_size: int, device: torch.device, include_spec: bool = True):
        qlens, slens, tables, ids, starts = [], [], [], [], []
        for s in out.scheduled:
            r = s.request
            n = s.num_scheduled_tokens - (0 if include_spec else s.num_spec_tokens)
            known = r.all_token_ids + r.spec_token_ids if include_spec and s.num_spec_tokens else r.all_token_ids
            ids.extend(known[s.start: s.start + n])
            qlens.append(n)
            slens.append(s.start + n)
            tables.append(s.block_ids)
            starts.append(s.start)
        q = torch.tensor(qlens)
        seq_idx = torch.repeat_interleave(torch.arange(len(qlens)), q)
        cu = torch.cumsum(q, 0)
        positions = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu - q, q) + torch.tensor(starts)[seq_idx]
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        slots = table[seq_idx, positions // block_size].long() * block_size + positions % block_size
        self.input_ids = torch.tensor(ids, device=device)
        self.positions = positions.to(device)
        self.meta = AttentionMetadata(
            slot_mapping=slots.to(device), block_table=table.to(device),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=device),
            query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), cu]).to(torch.int32).to(device),
            seq_lens_host=slens, query_lens_host=qlens)
        ends = cu.tolist()
        self.last_row = {id(s): end - 1 for s, end in zip(out.scheduled, ends)}
        # Rows whose logits are needed: the last 1 + num_spec tokens of each sampling request.
        self.sample_rows: list[int] = []
        self.sample_spans: list[tuple[int, int]] = []  # (first row in logits, count) per scheduled request
        for s, end in zip(out.scheduled, ends):
            k = 1 + s.num_spec_tokens if s.samples else 0
            self.sample_spans.append((len(self.sample_rows), k))
            self.sample_rows.extend(range(end - k, end))


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, proposer=None, max_num_seqs: int = 64,
                 max_model_len: int | None = None, cuda_graph: bool | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = model.cos_sin.device
        self.sampler = Sampler()
        self.proposer = proposer
        self.graphs = None
        self.last_propose_s = 0.0  # the latest step's drafting time, which the policy prices on its own
        if cuda_graph if cuda_graph is not None else self.device.type == "cuda":
            # Pure-decode steps replay captured graphs; on CPU (tests) the same padded buffers run eagerly.
            max_len = max_model_len or model.max_model_len
            self.graphs = DecodeGraphRunner(lambda ids, pos, meta: self.model(ids, pos, meta, self.kv_cache.layers),
                                            max_batch=max_num_seqs, max_blocks_per_seq=-(-max_len // self.block_size),
                                            max_seq_len=max_len, device=self.device, enabled=True)

    @torch.inference_mode()
    def forward_logits(self, out: SchedulerOutput) -> tuple[StepBatch, torch.Tensor]:
        """Run the model over the step; -> (batch, logits [num sample rows, V])."""
        with section("batch_build"):
            batch = StepBatch(out, self.block_size, self.device)
        if self.graphs is not None and self.graphs.can_run(batch.meta):
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers)
        rows = torch.tensor(batch.sample_rows, device=self.device, dtype=torch.long)
        return batch, self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, SampleResult]]:
        """-> (request id -> new tokens, request id -> sample result) for requests that sampled."""
        t0 = time.perf_counter()
        if self.proposer is not None:
            self.proposer.propose(self, out)
        self.last_propose_s = time.perf_counter() - t0
        batch, logits = self.forward_logits(out)
        plain, spec = [], []
        for s, (first, k) in zip(out.scheduled, batch.sample_spans):
            if k == 1:
                plain.append((s, first))
            elif k > 1:
                spec.append((s, first, k))
        tokens, results = {}, {}
        if plain:
            rows = torch.tensor([f for _, f in plain], device=self.device)
            with section("sample"):
                res = self.sampler.sample(logits[rows], [s.request for s, _ in plain])
            for (s, _), t, lp in zip(plain, res.token_ids, res.logprobs):
                tokens[s.request.request_id] = [t]
                results[s.request.request_id] = SampleResult([t], [lp])
        for s, first, k in spec:
            tokens[s.request.request_id] = self._verify(s, logits[first:first + k])
        return tokens, results

    def _verify(self, s, logits: torch.Tensor) -> list[int]:
        req = s.request
        if req.params.greedy:
            return verify(logits, req.spec_token_ids, None, True)
        probs = self.sampler.probs(logits, [req] * logits.shape[0])
        return verify(probs, req.spec_token_ids, s.draft_probs, False, self.sampler.generator(req, self.device))
