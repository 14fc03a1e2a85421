"""The encoder step: a prompt's images through the model's vision encoder, as part of its prefill.

A step that schedules placeholder tokens of an image (a run of them, ridge.vision.inputs.ImageInput)
needs the encoder's output rows for exactly those positions; they replace the placeholders'
embeddings before the first layer (CausalLM.forward's `embeds`). The encoder runs once per image
content: its output is kept by content hash, least recently used evicted past a byte budget, so a
second question about the same image, a prompt chunked across the image, a preempted request
recomputed or a sample of n > 1 skips the encoder. A prefix-cache hit over an image's blocks
skips both (its blocks are named by the image: engine/request.py image_token_ids). Placeholders
count against the step's token budget like any prompt token."""
from __future__ import annotations

from collections import OrderedDict

import torch

from .scheduler import SchedulerOutput

CACHE_BYTES = 256 << 20  # encoder outputs kept: about 250 images of 256 rows x 1024 fp32


class EncoderCache:
    """Encoder outputs by image content, least recently used evicted past max_bytes."""

    def __init__(self, max_bytes: int = CACHE_BYTES):
        self.max_bytes, self.bytes = max_bytes, 0
        self.items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, content: str) -> torch.Tensor | None:
        t = self.items.get(content)
        if t is not None:
            self.items.move_to_end(content)
        return t

    def put(self, content: str, rows: torch.Tensor) -> None:
        if content in self.items:
            return
        self.items[content] = rows
        self.bytes += rows.numel() * rows.element_size()
        while self.bytes > self.max_bytes and len(self.items) > 1:
            _, old = self.items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()


class EncoderStep:
    """vision: the model's encoder (LoadedModel.vision), whose encode(inputs) gives each input's
    [length, hidden] rows."""

    def __init__(self, vision, cache: EncoderCache | None = None):
        self.vision = vision
        self.cache = cache or EncoderCache()

    @staticmethod
    def needed(out: SchedulerOutput) -> bool:
        """Whether the step schedules any image placeholder (such a step runs eagerly: a CUDA
        graph's replay takes token ids only)."""
        return any(s.request.images and s.start < s.request.num_prompt_tokens for s in out.scheduled)

    def embeds(self, out: SchedulerOutput, last_row: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """-> (rows of the step's flattened batch, their embeddings [rows, hidden]) for every image
        placeholder the step schedules, or None when it schedules none."""
        spans = []  # (first batch row, image, its first row, past its last row)
        for s in out.scheduled:
            r = s.request
            a, b = s.start, s.start + s.num_scheduled_tokens
            if not r.images or a >= r.num_prompt_tokens:
                continue
            first = last_row[id(s)] + 1 - s.num_scheduled_tokens  # the batch row of position a
            for im in r.images:
                lo, hi = max(a, im.offset), min(b, im.end)
                if lo < hi:
                    spans.append((first + lo - a, im, lo - im.offset, hi - im.offset))
        if not spans:
            return None
        outs: dict[str, torch.Tensor] = {}
        missing = []
        for _, im, _, _ in spans:
            if im.content in outs:
                continue
            got = self.cache.get(im.content)
            if got is None:
                missing.append(im)
                outs[im.content] = None
                self.cache.misses += 1
            else:
                outs[im.content] = got
                self.cache.hits += 1
        if missing:
            for im, rows in zip(missing, self.vision.encode(missing)):
                assert rows.shape[0] == im.length, f"the encoder gave {rows.shape[0]} rows for {im.length} placeholders"
                outs[im.content] = rows
                self.cache.put(im.content, rows)
        device = next(iter(outs.values())).device
        rows = torch.cat([torch.arange(row, row + hi - lo, device=device) for row, _, lo, hi in spans])
        values = torch.cat([outs[im.content][lo:hi] for _, im, lo, hi in spans])
        return rows, values
