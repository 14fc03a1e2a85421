"""The Qwen2.5-VL image encoder, as transformers 5.25's Qwen2_5_VisionTransformerPretrainedModel
runs it.

One image (ridge/vision/qwen_vl.py's patches: [grid_h * grid_w, C * temporal_patch_size *
patch_size^2], each spatial_merge_size square of neighbours contiguous) -> a bias-free 3D patch
conv -> blocks of RMSNorm, attention with 2D rotary positions (a quarter of each head's
frequencies turned by the patch's row, a quarter by its column, repeated as rotate-half pairs),
RMSNorm, a gated MLP with biases -> the merger: RMSNorm, each merge square's patches as one row,
Linear, GELU, Linear to the text model's width.

Attention never crosses images. The blocks in fullatt_block_indexes attend over the whole image;
the others within windows of window_size pixels (window_tokens merged tokens a side, the last row
and column of windows cut short by the image's edge). transformers reorders the patches window
by window and back; a window's patches keep their order there, so gathering each window's rows
(attend_in_segments) computes the same sums.

With FP8 weights every Linear is e4m3 with per-output-channel scales (layers/siglip.py); the
conv and the RMSNorms stay in the compute dtype."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ridge.vision.inputs import ImageInput

from ..layers.siglip import load_encoder, read_config, tower_bytes
from .config import VISION_PREFIXES, VisionConfig, read_wrapper

ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
EPS = 1e-6  # the tower's RMSNorms: fixed, not configured


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32, scaled in the input's dtype: transformers' order of rounding
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def attend_in_segments(q, k, v, segments: list[torch.Tensor]) -> torch.Tensor:
    """q, k, v [T, H, D]; segments: [S, L] row indices, each row one group of L tokens that attend
    only each other (groups of one length batched) -> [T, H, D]."""
    out = torch.empty_like(q)
    for idx in segments:
        qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))  # [S, H, L, D]
        out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads = cfg.num_heads

    def forward(self, x, cos, sin, segments):
        t, d = x.shape
        q, k, v = self.qkv(x).view(t, 3, self.heads, d // self.heads).unbind(1)  # [T, H, hd] each
        dtype = q.dtype  # the rotation in fp32, as transformers' apply_rotary_pos_emb_vision
        q, k = ((z.float() * cos + rotate_half(z.float()) * sin).to(dtype) for z in (q, k))
        return self.proj(attend_in_segments(q, k, v, segments).reshape(t, d))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f), nn.Linear(d, f), nn.Linear(f, d)
        self.act = ACT[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.hidden_size), RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A patch's values [C * tp * p * p] -> [hidden]: one step of a 3D conv (with a bias in Qwen3-VL)."""

    def __init__(self, cfg, bias: bool = False):
        super().__init__()
        self.shape = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, kernel, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.view(-1, *self.shape)).flatten(1)


class Merger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, cfg.out_hidden_size))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


def patch_positions(h: int, w: int, m: int) -> torch.Tensor:
    """[h * w, 2] (row, column) of each patch, merge square after merge square (the patches' order)."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([z.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1) for z in (rows, cols)], -1)


def axial_cos_sin(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 2] (row, column) -> cos, sin [T, 1, head_dim] in fp32: a quarter of the head's
    frequencies turned by the row, a quarter by the column, repeated as rotate-half pairs."""
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=pos.device) / half))
    angles = torch.cat([pos[:, :1] * inv, pos[:, 1:] * inv], -1).float()
    angles = torch.cat([angles, angles], -1)[:, None, :]
    return angles.cos(), angles.sin()


def window_segments(h: int, w: int, m: int, n: int) -> list[torch.Tensor]:
    """The patches of each window of n x n merged tokens, as attend_in_segments takes them: windows
    of one size stacked, each window's patches in their order."""
    hm, wm = h // m, w // m
    r, c = torch.meshgrid(torch.arange(hm), torch.arange(wm), indexing="ij")
    window = ((r // n) * -(-wm // n) + c // n).reshape(-1)  # each merged token's window
    order = torch.argsort(window, stable=True)  # merged tokens, window by window, in raster order
    counts = torch.bincount(window)
    counts = counts[counts > 0]
    groups: dict[int, list[torch.Tensor]] = {}
    for tokens in order.split(counts.tolist()):
        patches = (tokens[:, None] * m * m + torch.arange(m * m)).reshape(-1)
        groups.setdefault(len(patches), []).append(patches)
    return [torch.stack(g) for g in groups.values()]


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t * h * w, C * tp * p * p] -> its merged rows [t * h * w / m^2, out]."""
        cfg, (t, h, w) = self.cfg, grid
        m = cfg.spatial_merge_size
        x = self.patch_embed(patches.to(self.merger.ln_q.weight.dtype))
        cos, sin = axial_cos_sin(patch_positions(h, w, m).repeat(t, 1).to(x.device), cfg.head_dim, cfg.rope_theta)
        hw = h * w
        frames = torch.arange(t * hw, device=x.device).view(t, hw)  # attention never crosses frames
        windows = [torch.cat([f * hw + s.to(x.device) for f in range(t)])
                   for s in window_segments(h, w, m, cfg.window_tokens)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, [frames] if i in cfg.full_blocks else windows)
        return self.merger(x)


def checked_grid(i: int, inp: ImageInput, cfg) -> tuple[int, int, int]:
    """An input's grid of patches (meta's grid), checked against its pixels and placeholders."""
    m, width = cfg.spatial_merge_size, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    grid, pv = tuple(inp.meta.get("grid", ())), inp.pixel_values
    if len(grid) != 3 or grid[1] % m or grid[2] % m:
        raise ValueError(f"image input {i}: grid {grid}, expected (t, h, w) patches in whole merge squares")
    if pv.shape != (grid[0] * grid[1] * grid[2], width):
        raise ValueError(f"image input {i}: pixel values of shape {pv.shape} for a grid of {grid} "
                         f"patches of {width} values")
    if inp.length * m * m != pv.shape[0]:
        raise ValueError(f"image input {i}: {inp.length} placeholder tokens for {pv.shape[0] // m // m} rows")
    return grid


class QwenVLEncoder(nn.Module):
    """The encoder the engine runs for a Qwen-VL prompt's images (the tower: self.visual): encode()
    turns each ImageInput (one image: meta's grid, in patches) into its rows of the text model's
    embeddings (Qwen3-VL's with its deepstack rows beside them)."""

    def __init__(self, cfg, tower: type):
        super().__init__()
        self.cfg = cfg
        self.visual = tower(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.visual.patch_embed.proj.weight.dtype  # the compute dtype: FP8Linears hold e4m3

    @property
    def device(self) -> torch.device:
        return self.visual.patch_embed.proj.weight.device

    @torch.no_grad()
    def encode(self, inputs: list[ImageInput]) -> list[torch.Tensor]:
        """One [input.length, width] tensor per input, in the weights' dtype."""
        return [self.visual(torch.from_numpy(np.asarray(inp.pixel_values)).to(self.device),
                            checked_grid(i, inp, self.cfg)) for i, inp in enumerate(inputs)]

    def weight_bytes(self) -> int:
        return tower_bytes(self)


def load_tower(path, device, dtype: torch.dtype, weights: str, read_wrapper, tower: type) -> QwenVLEncoder | None:
    """The tower of a Qwen-VL directory (read_wrapper: its family's config reader), its weights in
    dtype on device (its Linears e4m3 where weights is "fp8"); None where its safetensors hold none
    (a text-only copy). The checkpoint's visual.* or model.visual.* are the encoder's visual.*."""
    path = Path(path)
    _, cfg = read_wrapper(read_config(path), path / "config.json")

    def rename(name: str) -> str | None:
        if not name.startswith(VISION_PREFIXES):
            return None
        return "visual." + name.removeprefix("model.").removeprefix("visual.")
    return load_encoder(path, rename, lambda: QwenVLEncoder(cfg, tower), device, dtype, weights)


def load_vision(path, device, dtype: torch.dtype, weights: str = "fp32") -> QwenVLEncoder | None:
    return load_tower(path, device, dtype, weights, read_wrapper, VisionTransformer)
