"""The Qwen3-VL image encoder, as transformers 5.25's Qwen3VLVisionModel runs it.

One image (ridge/vision/qwen_vl.py's patches, merge squares contiguous) -> a 3D patch conv with a
bias -> plus the learned position table resampled to the image's grid (bilinear, corners aligned,
each patch's four nearest table entries) -> blocks of LayerNorm, attention over the whole image
with 2D rotary positions (Qwen2.5-VL's: vision.py there), LayerNorm, an MLP (fc1, activation,
fc2) -> the merger (LayerNorm per patch, each merge square as one row, Linear, GELU, Linear).
The blocks deepstack_visual_indexes names also feed a deepstack merger each (the merge square's
row normed as a whole): their rows are added to the first text layers' outputs at the image's
tokens (model.py).

encode() gives each image's rows as [tokens, hidden * (1 + deepstack)]: the merger's rows, then
each deepstack merger's, so that the engine's encoder cache keeps them together and the text
model splits them (model.py).

With FP8 weights every Linear is e4m3 with per-output-channel scales (layers/siglip.py); the
conv, the position table and the LayerNorms stay in the compute dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..qwen2_5_vl.vision import ACT, Attention, PatchEmbed, axial_cos_sin, load_tower, patch_positions
from .config import VisionConfig, read_wrapper

EPS = 1e-6  # the tower's LayerNorms: fixed, not configured


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACT[cfg.hidden_act]

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=EPS)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """postshuffle: the norm over a merge square's row (the deepstack mergers), else per patch."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool):
        super().__init__()
        d = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(d if postshuffle else cfg.hidden_size, eps=EPS)
        self.linear_fc1 = nn.Linear(d, d)
        self.linear_fc2 = nn.Linear(d, cfg.out_hidden_size)

    def forward(self, x):
        d = self.linear_fc1.in_features
        x = self.norm(x.view(-1, d)) if self.postshuffle else self.norm(x).view(-1, d)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def table_taps(h: int, w: int, m: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (merge squares' order) four entries of a side x side table and their weights:
    bilinear resampling of the table to h x w with corners aligned ([h * w, 4] each)."""
    def axis(n: int):
        src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
        lo = src.floor()
        taps = (lo.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
        return taps, (1 - (src[:, None] - lo[:, None] - torch.arange(2)).abs()).clamp(min=0)

    pos = patch_positions(h, w, m)
    (rt, rw), (ct, cw) = axis(h), axis(w)
    rt, rw, ct, cw = rt[pos[:, 0]], rw[pos[:, 0]], ct[pos[:, 1]], cw[pos[:, 1]]
    return (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4), (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)


class VisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Merger(cfg, postshuffle=True) for _ in cfg.deepstack)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches -> [t * h * w / m^2, out * (1 + deepstack)]: the merger's rows, then
        each deepstack merger's."""
        cfg, (t, h, w) = self.cfg, grid
        m = cfg.spatial_merge_size
        x = self.patch_embed(patches.to(self.merger.norm.weight.dtype))
        taps, weights = table_taps(h, w, m, cfg.grid_side)
        table = (self.pos_embed(taps.to(x.device)) * weights.to(x.device, x.dtype)[:, :, None]).sum(1)
        x = x + table.repeat(t, 1)
        cos, sin = axial_cos_sin(patch_positions(h, w, m).repeat(t, 1).to(x.device), cfg.head_dim, cfg.rope_theta)
        frames = [torch.arange(t * h * w, device=x.device).view(t, h * w)]  # attention never crosses frames
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in cfg.deepstack:
                deep.append(self.deepstack_merger_list[cfg.deepstack.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)


def load_vision(path, device, dtype: torch.dtype, weights: str = "fp32"):
    return load_tower(path, device, dtype, weights, read_wrapper, VisionModel)
