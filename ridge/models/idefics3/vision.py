"""The Idefics3 / SmolVLM image encoder: the SigLIP-style vision tower and the connector, as
transformers 5.25's Idefics3Model.get_image_features (and SmolVLM's, the same math) runs them.

One tile (ridge/vision/idefics3.py's preprocessing) -> patches of patch_size (a strided conv)
plus a learned position per patch -> pre-norm encoder layers (bidirectional attention, a GELU
MLP) -> a final LayerNorm -> the pixel shuffle (each scale_factor x scale_factor block of
patches becomes one row of their features side by side) -> a bias-free projection to the text
model's width: (side / scale_factor)^2 rows per tile, the tile's run of <image> tokens.

With FP8 weights every Linear (attention, MLP, the connector's projection) is e4m3 with per-output-
channel scales (an FP8Linear, ridge/models/layers/siglip.py); the patch conv, the position table
and the LayerNorms stay in the compute dtype."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ridge.quant.errors import ModelLoadError
from ridge.vision.inputs import ImageInput

from ..layers.siglip import load_encoder, read_config, tower_bytes

from .config import MODEL_TYPES
from .config import VISION_PREFIXES, VisionConfig, read_wrapper

ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def position_ids(rows: int, cols: int, side: int, device) -> torch.Tensor:
    """[rows * cols] position ids of a tile's patch grid in the side x side table.

    transformers spreads any grid over the table: patch i of n along an axis sits at fraction
    i / n, in bucket floor(fraction * side) (fractions clamped below 1). A whole tile of
    image_size is the identity. Computed with transformers' float32 steps and bucket edges, so
    that a fraction landing on an edge falls into the same bucket."""
    edges = torch.arange(1 / side, 1.0, 1 / side, device=device)

    def axis(n: int) -> torch.Tensor:
        step = 1.0 / torch.tensor([n], device=device)
        frac = torch.arange(n, device=device, dtype=torch.float32) * step
        return torch.bucketize(frac.clamp(max=1.0 - 1e-6), edges, right=True)

    return (axis(rows)[:, None] * side + axis(cols)[None, :]).reshape(-1)


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side ** 2, cfg.hidden_size)
        self.side = cfg.patches_per_side

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels)  # [N, D, rows, cols]
        rows, cols = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)  # [N, rows * cols, D], patches row by row
        return x + self.position_embedding(position_ids(rows, cols, self.side, x.device))


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))
        self.heads = cfg.num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (p(x).view(n, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        # every patch of a whole tile sees every other: no mask (scale head_dim ** -0.5)
        o = F.scaled_dot_product_attention(q, k, v)  # [N, H, T, hd]
        return self.out_proj(o.transpose(1, 2).reshape(n, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACT[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


def pixel_shuffle(x: torch.Tensor, side: int, s: int) -> torch.Tensor:
    """[N, side * side, D] patches, row by row -> [N, (side / s)^2, s * s * D]: output row (i, j)
    holds the patches (i s + r, j s + c) of its block, r then c, each D wide."""
    n, _, d = x.shape
    g = side // s
    return x.view(n, g, s, g, s, d).permute(0, 1, 3, 2, 4, 5).reshape(n, g * g, s * s * d)


class Projection(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size * cfg.scale_factor ** 2, cfg.text_hidden_size, bias=False)


class Connector(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.modality_projection = Projection(cfg)
        self.scale = cfg.scale_factor

    def forward(self, x: torch.Tensor, side: int) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, side, self.scale))


class Idefics3Vision(nn.Module):
    """The encoder the engine runs for an Idefics3 / SmolVLM prompt's images: encode() turns each
    ImageInput (one whole tile) into its rows of the text model's embeddings."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_model = VisionTower(cfg)
        self.connector = Connector(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.vision_model.post_layernorm.weight.dtype  # the compute dtype: FP8Linears hold e4m3

    @property
    def device(self) -> torch.device:
        return self.vision_model.post_layernorm.weight.device

    def rows_per_tile(self, height: int, width: int) -> int:
        """The placeholder tokens one tile of height x width pixels is worth."""
        side = self._side(height, width)
        return (side // self.cfg.scale_factor) ** 2

    def _side(self, height: int, width: int) -> int:
        p, s = self.cfg.patch_size, self.cfg.scale_factor
        if height != width or height % p or (height // p) % s:
            # transformers' pixel shuffle takes a square grid whose side scale_factor divides
            raise ValueError(f"a {height}x{width} tile: expected a square of whole patches of {p}, "
                             f"a multiple of {s} patches a side")
        return height // p

    @torch.no_grad()
    def encode(self, inputs: list[ImageInput]) -> list[torch.Tensor]:
        """One [input.length, text hidden] tensor per input, in the weights' dtype; the tiles of
        one shape go through the tower together."""
        out: list[torch.Tensor | None] = [None] * len(inputs)
        by_shape: dict[tuple, list[int]] = {}
        for i, inp in enumerate(inputs):
            pv = inp.pixel_values
            if pv.ndim != 3 or pv.shape[0] != self.cfg.num_channels:
                raise ValueError(f"image input {i}: pixel values of shape {pv.shape}, expected one tile "
                                 f"[{self.cfg.num_channels}, height, width]")
            rows = self.rows_per_tile(*pv.shape[1:])
            if rows != inp.length:
                raise ValueError(f"image input {i}: {inp.length} placeholder tokens for a tile worth {rows}")
            by_shape.setdefault(tuple(pv.shape), []).append(i)
        for shape, idx in by_shape.items():
            # np.stack copies: an input's pixels may be a read-only buffer
            pixels = torch.from_numpy(np.stack([inputs[i].pixel_values for i in idx]))
            pixels = pixels.to(device=self.device, dtype=self.dtype)
            feats = self.connector(self.vision_model(pixels), self._side(*shape[1:]))
            for i, f in zip(idx, feats):
                out[i] = f
        return out

    def weight_bytes(self) -> int:
        return tower_bytes(self)


def load_vision(path, device, dtype: torch.dtype, weights: str = "fp32") -> Idefics3Vision | None:
    """The tower and the connector of an Idefics3 / SmolVLM directory, their weights in dtype on
    device (their Linears e4m3 where weights is "fp8"); None where its safetensors hold neither (a
    text-only copy). Reads only their tensors, one at a time from the files' memory maps."""
    path = Path(path)
    values = read_config(path)
    if values.get("model_type") not in MODEL_TYPES:
        raise ModelLoadError(path / "config.json", f"model_type {values.get('model_type')!r}: expected one of "
                                                   f"{', '.join(MODEL_TYPES)}")
    _, cfg = read_wrapper(values, path / "config.json")
    return load_encoder(path, lambda name: name[len("model."):] if name.startswith(VISION_PREFIXES) else None,
                        lambda: Idefics3Vision(cfg), device, dtype, weights)
