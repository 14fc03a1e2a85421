"""Multimodal rotary positions (mrope: Qwen2-VL, Qwen2.5-VL; interleaved: Qwen3-VL, Qwen3.5).

Every prompt token has three positions (t, h, w). A text token has one position in all three,
one past the largest position before it; an image of t x H x W merged tokens that starts at
position s places its tokens at (s + t', s + row, s + col), and the text after it goes on from
s + max(H, W) (Qwen2VLModel.get_rope_index, images only: t' is the frame, 0 for a still image).
Past the prompt a token at index i is at i + delta, delta = the prompt's largest position + 1 -
its length (<= 0).

Each rotary frequency turns by one of the three (axis_map): with three equal positions that is
the plain rotation at that position. So the 1-D path serves every text token, its position
shifted by the images before it (PositionTable.chunk), and only image tokens need their own
rows of cos and sin (mrope_cos_sin), made from the model's plain table: a text-only request runs
as any other model's.

The table is built once per request, when its prompt and image grids are known
(engine/request.py), and read a chunk at a time by the runner (step_positions): chunked prefill,
a prefix hit (start > 0) and decode all read the same table."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .decoder import CausalLM

GRID_KEY = "mrope_grid"  # an ImageInput's meta: its (t, h, w) grid of merged tokens


@dataclass(frozen=True, slots=True)
class PositionTable:
    """A prompt's positions: pos [3, n] int64; token i >= n is at i + delta in all three."""
    pos: np.ndarray
    delta: int

    def chunk(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens start .. start + count -> (their 1-D positions [count] (t's for an image token),
        the indices among them of image tokens, their three positions [3, k])."""
        n = self.pos.shape[1]
        idx = np.arange(start, start + count)
        inside = idx < n
        plain = np.where(inside, self.pos[0, np.minimum(idx, n - 1)], idx + self.delta)
        j = np.flatnonzero(inside)
        p3 = self.pos[:, idx[j]]
        image = j[(p3[0] != p3[1]) | (p3[0] != p3[2])]
        return plain, image, self.pos[:, start + image]


def position_table(num_tokens: int, images) -> PositionTable | None:
    """The prompt's table, or None where no image input carries a grid (the plain 1-D path)."""
    grids = [(im, im.meta.get(GRID_KEY)) for im in images]
    if not any(g is not None for _, g in grids):
        return None
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cur, at = 0, 0  # the next text position, the next token index
    for im, (t, h, w) in sorted(((im, g) for im, g in grids if g is not None), key=lambda x: x[0].offset):
        if t * h * w != im.length:
            raise ValueError(f"an image of {im.length} tokens at {im.offset} with a grid of {t} x {h} x {w}")
        pos[:, at:im.offset] = np.arange(cur, cur + im.offset - at)
        cur += im.offset - at
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[:, im.offset:im.end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur
        cur += max(h, w)
        at = im.end
    pos[:, at:] = np.arange(cur, cur + num_tokens - at)
    return PositionTable(pos, int(pos.max(initial=-1)) + 1 - num_tokens)


def step_positions(items, device) -> tuple[torch.Tensor, tuple | None] | None:
    """items: per scheduled request (its PositionTable or None, first row, first token index, count).
    -> (the shift to add to each of the step's rows [rows], (image rows [k], their positions [3, k])
    or None), or None where no request has a table."""
    items = [x for x in items if x[0] is not None]
    if not items:
        return None
    total = max(row + count for _, row, _, count in items)
    shift = np.zeros(total, dtype=np.int64)
    rows, p3 = [], []
    for table, row, start, count in items:
        plain, image, pos = table.chunk(start, count)
        shift[row:row + count] = plain - np.arange(start, start + count)
        if len(image):
            rows.append(image + row)
            p3.append(pos)
    image = (_on(np.concatenate(rows), device), _on(np.concatenate(p3, 1), device)) if rows else None
    return _on(shift, device), image


def _on(a: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(a).to(device, non_blocking=True)  # as the runner's other per-step metadata


def axis_map(section: list[int], interleaved: bool, rotary_dim: int) -> torch.Tensor:
    """[rotary_dim] int64: which of (t, h, w) turns each column of a [cos | sin] table.
    mrope_section splits the frequencies into a run for t, then h, then w (Qwen2-VL); interleaved,
    frequency f turns by h where f % 3 == 1 and f < 3 * section[1], by w where f % 3 == 2 and
    f < 3 * section[2], else by t (Qwen3-VL's apply_interleaved_mrope)."""
    half = rotary_dim // 2
    if interleaved:
        f = torch.arange(half)
        axis = torch.zeros(half, dtype=torch.int64)
        for a in (1, 2):
            axis[(f % 3 == a) & (f < 3 * section[a])] = a
    else:
        axis = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(section)])
    return torch.cat([axis, axis])


def mrope_cos_sin(cos_sin: torch.Tensor, pos3: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """[k, R] rows of cos and sin for k tokens at three positions each ([3, k]): each column from
    the plain table at the position of its axis."""
    rows = cos_sin[pos3]  # [3, k, R]
    return rows.gather(0, axis.expand(1, pos3.shape[1], -1).to(pos3.device))[0]


class MRopeCausalLM(CausalLM):
    """A decoder whose image tokens rotate by three positions: meta.mrope (the runner's
    step_positions image rows) gives their rows of cos and sin; every other row keeps the plain
    table at its (shifted) position. ModelConfig.extra: mrope_section, mrope_interleaved."""

    def __init__(self, cfg, max_model_len: int | None = None):
        super().__init__(cfg, max_model_len)
        self.step_rope = None  # this step's [T, R] table, where it has image rows

    def load_globals(self, sd, device, dtype, freq_factors=None) -> None:
        super().load_globals(sd, device, dtype, freq_factors)
        cfg = self.cfg
        if "mrope_section" in cfg.extra:  # else a text model only (a GGUF's): every row plain
            self.mrope_axis = axis_map(cfg.extra["mrope_section"], cfg.extra.get("mrope_interleaved", False),
                                       self.cos_sin.shape[1]).to(device)

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta, kv_caches, num_layers=None, embeds=None):
        image = getattr(meta, "mrope", None)
        if image is None:
            return super().forward(input_ids, positions, meta, kv_caches, num_layers, embeds)
        rows, pos3 = image
        table = self.cos_sin.index_select(0, positions)
        table[rows] = mrope_cos_sin(self.cos_sin, pos3, self.mrope_axis)
        self.step_rope = table
        try:
            steps = torch.arange(positions.shape[0], device=positions.device)
            return super().forward(input_ids, steps, meta, kv_caches, num_layers, embeds)
        finally:
            self.step_rope = None

    def rope_for(self, layer) -> torch.Tensor:
        return self.step_rope if self.step_rope is not None else super().rope_for(layer)
