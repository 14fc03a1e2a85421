"""The model runner: a scheduler step -> one flattened batch -> tokens.

It turns the plan into tensors (token ids, positions, block table, slot
mapping, sequence lengths), runs the model once over every scheduled token of
every request, and samples from the rows that end a request's known tokens.
Per-step Python work is O(requests); nothing here loops over tokens."""
from __future__ import annotations

import torch

from ridge.cache.kv_cache import KVCache
from ridge.kernels.metadata import AttentionMetadata

from .sampler import Sampler, SampleResult
from .scheduler import SchedulerOutput


class StepBatch:
    """The tensors of one step, on the model's device."""

    def __init__(self, out: SchedulerOutput, block_size: int, device: torch.device):
        qlens, slens, tables, ids = [], [], [], []
        for s in out.scheduled:
            r = s.request
            known = r.all_token_ids + r.spec_token_ids
            ids.extend(known[s.start: s.start + s.num_scheduled_tokens])
            qlens.append(s.num_scheduled_tokens)
            slens.append(s.start + s.num_scheduled_tokens)
            tables.append(s.block_ids)
        self.query_lens, self.seq_lens = qlens, slens
        q = torch.tensor(qlens)
        starts = torch.tensor([s.start for s in out.scheduled])
        seq_idx = torch.repeat_interleave(torch.arange(len(qlens)), q)
        cu = torch.cumsum(q, 0)
        positions = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu - q, q) + starts[seq_idx]
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
        # Rows whose logits are needed: the last 1 + num_spec tokens of each sampling request.
        ends = cu.tolist()
        self.sample_rows: list[int] = []
        self.sample_spans: list[tuple[int, int]] = []  # (first row in logits, count) per scheduled request
        for s, end in zip(out.scheduled, ends):
            k = 1 + s.num_spec_tokens if s.samples else 0
            self.sample_spans.append((len(self.sample_rows), k))
            self.sample_rows.extend(range(end - k, end))


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = model.cos_sin.device
        self.sampler = Sampler()

    @torch.inference_mode()
    def forward_logits(self, out: SchedulerOutput) -> tuple[StepBatch, torch.Tensor]:
        """Run the model over the step; -> (batch, logits [num sample rows, V])."""
        batch = StepBatch(out, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers)
        rows = torch.tensor(batch.sample_rows, device=self.device, dtype=torch.long)
        return batch, self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, SampleResult]]:
        """-> (request id -> new tokens, request id -> sample result) for requests that sampled."""
        batch, logits = self.forward_logits(out)
        sampling = [s for s, (_, k) in zip(out.scheduled, batch.sample_spans) if k]
        if not sampling:
            return {}, {}
        result = self.sampler.sample(logits, [s.request for s in sampling])
        tokens = {s.request.request_id: [t] for s, t in zip(sampling, result.token_ids)}
        per_req = {s.request.request_id: SampleResult([t], [lp]) for s, t, lp
                   in zip(sampling, result.token_ids, result.logprobs)}
        return tokens, per_req
