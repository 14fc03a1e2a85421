"""The Gemma 4 image encoder: Gemma4VisionModel and the embedder into the text model's space, as
transformers 5.25's Gemma4Model.get_image_features runs them.

One image (ridge/vision/gemma4.py: resized to whole pooling cells within a patch budget, its
patches flattened row by row) -> the patch embedder: 2 (pixels - 0.5) through a bias-free product,
plus a learned x and a learned y position -> encoder layers: Gemma norms around attention and a
gated MLP, q and k normed per head and turned by a 2-D rotary (the first half of each head by the
patch's x, the second by its y), v normed without a scale, attention unscaled and bidirectional ->
the pooler: each pooling_kernel_size x pooling_kernel_size cell of patches averaged, times
sqrt(hidden), then (standardize) a bias and scale -> the embedder: an RMSNorm without a scale and
a bias-free product to the text model's width: one row per cell, the image's run of placeholders.

transformers pads every image's patches to the budget and masks the padding out of attention and
pooling; ridge runs each image at its own length, which computes the same rows. Clipped linears
(use_clipped_linears) clamp their inputs and outputs to the checkpoint's bounds. With FP8 weights
every product of the tower and the embedder is e4m3 with per-output-channel scales (FP8Linears,
ridge/models/layers/siglip.py); the position table and the norms stay in the compute dtype."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ridge.quant.hf_config import ACTIVATIONS, HFConfig
from ridge.vision.inputs import ImageInput

from ..idefics3.vision import ACT
from ..layers.siglip import VisionView, load_encoder, positive, read_config, tower_bytes
from .config import WRAPPER_DEFAULTS, text_config

# Gemma4VisionConfig's defaults (transformers 5.25); rope_parameters None is its axial RoPE at 100.
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                       num_key_value_heads=12, head_dim=64, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                       max_position_embeddings=131_072, attention_bias=False, attention_dropout=0.0,
                       rope_parameters=None, pooling_kernel_size=3, patch_size=16, position_embedding_size=10 * 1024,
                       use_clipped_linears=False, standardize=False, initializer_range=0.02)
# Fields transformers' tower never reads at inference: its products have no bias whatever
# attention_bias says, and positions come from the patch grid, not max_position_embeddings.
VISION_IGNORED = frozenset({"attention_bias", "attention_dropout", "initializer_range", "max_position_embeddings"})
TOWER_PREFIXES = ("model.vision_tower.", "model.embed_vision.")


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_act: str  # ridge's name (quant/hf_config.py ACTIVATIONS)
    eps: float
    rope_theta: float
    pooling_kernel_size: int
    patch_size: int
    position_embedding_size: int
    clipped: bool
    standardize: bool
    text_hidden_size: int


def read_vision(c: HFConfig, text_hidden_size: int) -> VisionConfig:
    """The wrapper's vision_config, each field honoured or refused by name."""
    values = c.get("vision_config")
    if not isinstance(values, dict):
        c.refuse("vision_config", values, "expected the vision tower's config (a JSON object)")
    v = VisionView(values, c.path, VISION_DEFAULTS)
    if v.get("model_type") not in (None, "gemma4_vision"):
        v.refuse("model_type", v.get("model_type"), "Gemma 4's tower is gemma4_vision")
    unknown = sorted(set(values) - set(VISION_DEFAULTS) - {"model_type", "transformers_version", "dtype",
                                                         "torch_dtype", "architectures"})
    if unknown:
        v.refuse(unknown[0], values[unknown[0]], "not a field of Gemma4VisionConfig that ridge reads")
    heads, kv_heads, dim = positive(v, "num_attention_heads"), positive(v, "num_key_value_heads"), positive(v, "head_dim")
    if heads % kv_heads:
        v.refuse("num_key_value_heads", kv_heads, f"does not divide num_attention_heads={heads}")
    if dim % 4:  # two axes, each rotated by halves
        v.refuse("head_dim", dim, "the 2-D rotary turns each axis's half by halves: expected a multiple of 4")
    act = v.get("hidden_activation")
    if act not in ACTIVATIONS:
        v.refuse("hidden_activation", act, f"ridge runs {', '.join(ACTIVATIONS)}")
    rope = v.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 100.0}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial" or set(rope) - {"rope_type", "rope_theta"}:
        v.refuse("rope_parameters", rope, "Gemma 4's tower runs axial RoPE with a rope_theta")
    theta = rope.get("rope_theta", 100.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        v.refuse("rope_parameters.rope_theta", theta, "expected a positive number")
    for key in ("use_clipped_linears", "standardize"):
        if not isinstance(v.get(key), bool):
            v.refuse(key, v.get(key), "expected true or false")
    return VisionConfig(hidden_size=positive(v, "hidden_size"), intermediate_size=positive(v, "intermediate_size"),
                        num_layers=positive(v, "num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads,
                        head_dim=dim, hidden_act=ACTIVATIONS[act], eps=v.number("rms_norm_eps"),
                        rope_theta=float(theta), pooling_kernel_size=positive(v, "pooling_kernel_size"),
                        patch_size=positive(v, "patch_size"),
                        position_embedding_size=positive(v, "position_embedding_size"),
                        clipped=v.get("use_clipped_linears"), standardize=v.get("standardize"),
                        text_hidden_size=text_hidden_size)


def rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma 4's RMSNorm: in fp32, times w itself (not 1 + w), or no scale at all."""
    y = x.float()
    y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (y if weight is None else y * weight.float()).type_as(x)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.eps, self.weight)


class ClippableLinear(nn.Module):
    """A bias-free product; clipped: its input and output clamped to the checkpoint's bounds."""

    def __init__(self, cfg: VisionConfig, n_in: int, n_out: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.clipped = cfg.clipped
        if cfg.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(name, torch.tensor(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        y = self.linear(x)
        return torch.clamp(y, self.output_min, self.output_max) if self.clipped else y


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[N, H, D]: the first half of each head by the x angles, the second by the y angles, each
    half rotated by halves. cos, sin: [N, 2, D / 4] (x, then y)."""
    parts = []
    for axis, part in enumerate(x.chunk(2, dim=-1)):
        c = torch.cat([cos[:, axis], cos[:, axis]], -1)[:, None]
        s = torch.cat([sin[:, axis], sin[:, axis]], -1)[:, None]
        a, b = part.chunk(2, dim=-1)
        parts.append(part * c + torch.cat([-b, a], -1) * s)
    return torch.cat(parts, -1)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = ClippableLinear(cfg, h, cfg.num_heads * d)
        self.k_proj = ClippableLinear(cfg, h, cfg.num_kv_heads * d)
        self.v_proj = ClippableLinear(cfg, h, cfg.num_kv_heads * d)
        self.o_proj = ClippableLinear(cfg, cfg.num_heads * d, h)
        self.q_norm, self.k_norm = Norm(d, cfg.eps), Norm(d, cfg.eps)
        self.cfg = cfg

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[0], self.cfg
        q = rotate(self.q_norm(self.q_proj(x).view(n, c.num_heads, c.head_dim)), cos, sin)
        k = rotate(self.k_norm(self.k_proj(x).view(n, c.num_kv_heads, c.head_dim)), cos, sin)
        v = rms(self.v_proj(x).view(n, c.num_kv_heads, c.head_dim), c.eps)
        group = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # every patch sees every patch of its image; q and k are normed, so no 1/sqrt(d) scale
        scores = torch.einsum("qhd,khd->hqk", q, k)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.gate_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = ClippableLinear(cfg, cfg.intermediate_size, cfg.hidden_size)
        self.act = ACT[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg), MLP(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Norm(cfg.hidden_size, cfg.eps))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size ** 2, cfg.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, cfg.position_embedding_size, cfg.hidden_size))

    def forward(self, patches: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        h = self.input_proj(2 * (patches - 0.5))
        table = self.position_embedding_table
        return h + (F.embedding(xy[:, 0], table[0]) + F.embedding(xy[:, 1], table[1])).to(h.dtype)


class Tower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embedder, self.encoder = PatchEmbedder(cfg), Encoder(cfg)
        if cfg.standardize:
            self.register_buffer("std_bias", torch.zeros(cfg.hidden_size))
            self.register_buffer("std_scale", torch.ones(cfg.hidden_size))
        self.cfg = cfg

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[rows * cols, 3 p^2] patches of one image, row by row -> [cells, hidden] in fp32."""
        c = self.cfg
        yy, xx = torch.meshgrid(torch.arange(rows, device=patches.device), torch.arange(cols, device=patches.device),
                                indexing="ij")
        xy = torch.stack([xx.reshape(-1), yy.reshape(-1)], -1)  # [N, 2] (x, y), as the processor writes them
        x = self.patch_embedder(patches, xy)
        d = c.head_dim // 2  # each axis's share of a head, rotated by halves
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=patches.device) / d)
        angles = xy[..., None].float() * inv_freq  # [N, 2, d / 2]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        k = c.pooling_kernel_size
        if k > 1:  # each k x k cell of patches averaged, cells row by row
            cell = (xy[:, 1] // k) * (cols // k) + xy[:, 0] // k
            pooled = torch.zeros(rows * cols // (k * k), x.shape[-1], dtype=torch.float32, device=x.device)
            x = (pooled.index_add_(0, cell, x.float()) / (k * k)).to(x.dtype)
        x = x.float() * c.hidden_size ** 0.5
        if c.standardize:
            x = (x - self.std_bias.float()) * self.std_scale.float()
        return x


class Embedder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.embedding_projection = nn.Linear(cfg.hidden_size, cfg.text_hidden_size, bias=False)
        self.eps = cfg.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms(x, self.eps))


class Gemma4Vision(nn.Module):
    """The encoder the engine runs for a Gemma 4 prompt's images: encode() turns each ImageInput
    (one image: its patches and meta["grid"], rows and columns of patches) into its rows of the
    text model's embeddings, one per pooled cell."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower, self.embed_vision = Tower(cfg), Embedder(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.vision_tower.patch_embedder.position_embedding_table.dtype  # the compute dtype

    @property
    def device(self) -> torch.device:
        return self.vision_tower.patch_embedder.position_embedding_table.device

    @torch.no_grad()
    def encode(self, inputs: list[ImageInput]) -> list[torch.Tensor]:
        """One [cells, text hidden] tensor per input, in the weights' dtype; one image at a time
        (each is as long as its own patch grid)."""
        c, out = self.cfg, []
        for i, inp in enumerate(inputs):
            rows, cols = inp.meta.get("grid", (0, 0))
            k = c.pooling_kernel_size
            want = (rows * cols, 3 * c.patch_size ** 2)
            if tuple(inp.pixel_values.shape) != want or rows % k or cols % k or not rows * cols:
                raise ValueError(f"image input {i}: pixel values of shape {inp.pixel_values.shape} for a "
                                 f"{rows} x {cols} patch grid; expected {want} in whole {k} x {k} cells")
            if inp.length != rows * cols // (k * k):
                raise ValueError(f"image input {i}: {inp.length} placeholder tokens for an image worth "
                                 f"{rows * cols // (k * k)}")
            if max(rows, cols) > c.position_embedding_size:
                raise ValueError(f"image input {i}: {rows} x {cols} patches, past the tower's "
                                 f"{c.position_embedding_size} positions")
            patches = torch.from_numpy(np.array(inp.pixel_values)).to(self.device, self.dtype)
            pooled = self.vision_tower(patches, rows, cols).to(self.dtype)
            out.append(self.embed_vision(pooled))
        return out

    def weight_bytes(self) -> int:
        return tower_bytes(self)


def _module_name(name: str) -> str | None:
    """A checkpoint's tensor -> Gemma4Vision's name, or None for the text model's and the audio's."""
    return name.removeprefix("model.") if name.startswith(TOWER_PREFIXES) else None


def load_vision(path, device, dtype: torch.dtype, weights: str = "fp32") -> Gemma4Vision | None:
    """The tower and the embedder of a Gemma 4 directory, their weights in dtype on device (their
    products e4m3 where weights is "fp8"); None without a vision_config (a text checkpoint) or where
    its safetensors hold no tower (a text-only copy)."""
    path = Path(path)
    values = read_config(path)
    if values.get("model_type") != "gemma4" or values.get("vision_config") is None:
        return None
    c = HFConfig(values, path / "config.json", WRAPPER_DEFAULTS)
    cfg = read_vision(c, text_config(c).positive_int("hidden_size"))
    return load_encoder(path, _module_name, lambda: Gemma4Vision(cfg), device, dtype, weights)
