"""The Mistral 3 image encoder: the Pixtral vision tower and the Mistral 3 projector, as
transformers 5.25's Mistral3Model.get_image_features runs them.

One image (ridge/vision/pixtral.py's preprocessing, its sides whole cells) -> patches of
patch_size (a bias-free strided conv) -> RMSNorm (ln_pre) -> pre-norm transformer blocks
(RMSNorm, attention with 2D rotary positions: a quarter of each head's frequencies turned by the
patch's row, a quarter by its column, then repeated as rotate-half pairs; RMSNorm, a gated MLP)
-> the hidden state vision_feature_layer names -> the projector: RMSNorm (the text model's eps),
the patch merger (each spatial_merge_size square of patches becomes one row, channel-major as
torch's unfold lays it out, through a bias-free linear), linear, activation, linear.

Images batched into one pass are one sequence whose attention mask is block-diagonal: a patch
sees only its own image's patches. The ImageInputs are rows of an image's token grid (see the
package's docstring); encode() runs each image once and slices its rows out.

With FP8 weights every Linear (attention, the gated MLP, the patch merger, the projector's two) is
e4m3 with per-output-channel scales (an FP8Linear, ridge/models/layers/siglip.py); the patch conv
and the RMSNorms stay in the compute dtype."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ridge.vision.inputs import ImageInput

from ..layers.siglip import load_encoder, read_config, tower_bytes
from .config import VISION_PREFIXES, VisionConfig, read_wrapper

ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
KEEP_BYTES = 64 << 20  # whole images' outputs kept for the rows a later prefill chunk asks for


def inverse_frequencies(cfg: VisionConfig, device=None) -> torch.Tensor:
    """[head_dim / 2] rotary frequencies, fp32; the even ones turn by row, the odd by column."""
    hd = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float, device=device) / hd))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32, scaled in the input's dtype: transformers' order of rounding
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.heads = cfg.num_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None):
        t, d = x.shape
        q, k, v = (p(x).view(t, self.heads, d // self.heads).transpose(0, 1)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # [H, T, hd]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # scale head_dim ** -0.5
        return self.o_proj(o.transpose(0, 1).reshape(t, d))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act = ACT[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, 1e-5)  # Pixtral's eps is fixed, not configured
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, 1e-5)
        self.feed_forward = MLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))


class PixtralTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_conv = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size, bias=False)
        self.ln_pre = RMSNorm(cfg.hidden_size, 1e-5)
        self.transformer = Transformer(cfg)
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)

    def rotary(self, grids: list[tuple[int, int]], dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] of every patch, image after image, row by row: the even
        frequencies by its row, the odd ones by its column."""
        pos = torch.cat([torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
                         for h, w in grids]).to(self.inv_freq.device)
        inv = self.inv_freq.float()
        angles = torch.cat([pos[:, :1].float() * inv[0::2], pos[:, 1:].float() * inv[1::2]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """[3, H, W] images -> the hidden state cfg.feature_layer names, [T, D] for all the images'
        patches in order, and each image's patch grid."""
        patches = [self.patch_conv(im[None])[0] for im in images]  # [D, h, w] each
        grids = [tuple(p.shape[-2:]) for p in patches]
        x = self.ln_pre(torch.cat([p.flatten(1).T for p in patches]))  # [T, D]
        cos, sin = self.rotary(grids, x.dtype)
        mask = None
        if len(grids) > 1:
            ids = torch.cat([torch.full((h * w,), i) for i, (h, w) in enumerate(grids)]).to(x.device)
            mask = ids[:, None] == ids[None, :]
        for layer in self.transformer.layers[:self.cfg.feature_layer]:
            x = layer(x, cos, sin, mask)
        return x, grids


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.s = cfg.spatial_merge_size
        self.merging_layer = nn.Linear(cfg.hidden_size * self.s ** 2, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """[T, D] patches, image after image -> [tokens, D * s^2]: row (i, j) of an image holds its
        block's patches channel by channel, each channel's s x s patches row by row (unfold's order)."""
        out, s = [], self.s
        for t, (h, w) in zip(x.split([h * w for h, w in grids]), grids):
            d = t.shape[-1]
            out.append(t.view(h // s, s, w // s, s, d).permute(0, 2, 4, 1, 3).reshape(-1, d * s * s))
        return self.merging_layer(torch.cat(out))


class Projector(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.projector_eps)
        self.patch_merger = PatchMerger(cfg)
        self.linear_1 = nn.Linear(cfg.hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)
        self.act = ACT[cfg.projector_act]

    def forward(self, x: torch.Tensor, grids) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.patch_merger(self.norm(x), grids))))


class Mistral3Vision(nn.Module):
    """The encoder the engine runs for a Mistral 3 prompt's images: encode() turns each
    ImageInput (one row of an image's tokens) into its rows of the text model's embeddings."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = PixtralTower(cfg)
        self.multi_modal_projector = Projector(cfg)
        self.kept: OrderedDict[str, torch.Tensor] = OrderedDict()  # image hash -> [rows * cols, hidden]
        self.kept_bytes = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.norm.weight.dtype  # the compute dtype: FP8Linears hold e4m3

    @property
    def device(self) -> torch.device:
        return self.multi_modal_projector.norm.weight.device

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of image tokens an image of height x width pixels gives."""
        c = self.cfg.cell
        if height % c or width % c:
            # transformers' unfold would drop the patches past the last whole block
            raise ValueError(f"a {height}x{width} image: expected sides in whole cells of {c} pixels "
                             "(patch_size x spatial_merge_size)")
        return height // c, width // c

    @torch.no_grad()
    def features(self, images: list[np.ndarray]) -> list[torch.Tensor]:
        """[3, H, W] images -> each its [rows * cols, text hidden] rows, row by row; one pass."""
        pixels = [torch.from_numpy(np.array(p)).to(device=self.device, dtype=self.dtype) for p in images]
        x, grids = self.vision_tower(pixels)
        out = self.multi_modal_projector(x, grids)
        s = self.cfg.spatial_merge_size
        return list(out.split([h // s * (w // s) for h, w in grids]))

    @torch.no_grad()
    def encode(self, inputs: list[ImageInput]) -> list[torch.Tensor]:
        """One [input.length, text hidden] tensor per input (a row of an image's tokens: meta's
        image, row), in the weights' dtype; the images not kept go through the tower together."""
        todo: dict[str, np.ndarray] = {}
        for i, inp in enumerate(inputs):
            pv, meta = inp.pixel_values, inp.meta
            if pv.ndim != 3 or pv.shape[0] != self.cfg.num_channels:
                raise ValueError(f"image input {i}: pixel values of shape {pv.shape}, expected one image "
                                 f"[{self.cfg.num_channels}, height, width]")
            rows, cols = self.grid(*pv.shape[1:])
            if not {"image", "row"} <= set(meta) or not 0 <= meta["row"] < rows:
                raise ValueError(f"image input {i}: meta {sorted(meta)} must name its image and a row of its {rows}")
            if inp.length != cols:
                raise ValueError(f"image input {i}: {inp.length} placeholder tokens for a row worth {cols}")
            if meta["image"] not in self.kept:
                todo.setdefault(meta["image"], pv)
        if todo:
            for key, feats in zip(todo, self.features(list(todo.values()))):
                self.kept[key] = feats
                self.kept_bytes += feats.numel() * feats.element_size()
        out = []
        for inp in inputs:
            whole = self.kept[inp.meta["image"]]
            self.kept.move_to_end(inp.meta["image"])
            # a copy: the engine's cache counts a row's bytes, and must not hold the whole image alive
            out.append(whole[inp.meta["row"] * inp.length:(inp.meta["row"] + 1) * inp.length].clone())
        while self.kept_bytes > KEEP_BYTES and len(self.kept) > 1:
            _, old = self.kept.popitem(last=False)
            self.kept_bytes -= old.numel() * old.element_size()
        return out

    def weight_bytes(self) -> int:
        return tower_bytes(self)


def load_vision(path, device, dtype: torch.dtype, weights: str = "fp32") -> Mistral3Vision | None:
    """The tower and the projector of a Mistral 3 directory, their weights in dtype on device (their
    Linears e4m3 where weights is "fp8"); None where its safetensors hold neither (a text-only copy)."""
    path = Path(path)
    _, cfg = read_wrapper(read_config(path), path / "config.json")
    model = load_encoder(path, lambda name: name.removeprefix("model.") if name.startswith(VISION_PREFIXES) else None,
                         lambda: Mistral3Vision(cfg), device, dtype, weights)
    if model is not None:  # the rotary's frequencies are no tensor of the checkpoint: built where it runs
        model.vision_tower.inv_freq = inverse_frequencies(cfg, device)
    return model
