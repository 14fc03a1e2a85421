"""The Gemma 3 image encoder: the SigLIP vision tower and Gemma3MultiModalProjector, as
transformers 5.25's Gemma3Model.get_image_features runs them.

One picture (the whole image or a pan-and-scan crop, ridge/vision/gemma3.py, always image_size
square) -> SigLIP: patches of patch_size (a strided conv) plus a learned position per patch ->
pre-norm encoder layers (bidirectional attention, a GELU MLP) -> a final LayerNorm (the tower is
Idefics3's, ridge/models/idefics3/vision.py, whose positions over a whole tile are SigLIP's) ->
the projector: an average pool of the patch grid to mm_tokens_per_image cells, Gemma's RMSNorm
(weight 1 + w) and a bias-free product to the text model's width: mm_tokens_per_image rows, the
picture's run of <image_soft_token>s.

With FP8 weights every Linear of the tower (attention, MLP) and the projector's product are e4m3
with per-output-channel scales (FP8Linears, ridge/models/layers/siglip.py); the patch conv, the
position table and the norms stay in the compute dtype."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ridge.quant.fp8 import quantize_fp8
from ridge.quant.hf_config import HFConfig
from ridge.vision.inputs import ImageInput

from ..idefics3.vision import VisionTower
from ..layers.siglip import TowerLinear, load_encoder, positive, read_config, read_tower, tower_bytes
from .config import VISION_PREFIXES, WRAPPER_DEFAULTS, text_config

# SiglipVisionConfig's defaults (transformers 5.25).
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                       layer_norm_eps=1e-6, vision_use_head=True)
# Training-time fields; and the pooling head, which get_image_features never runs.
VISION_IGNORED = frozenset({"attention_dropout", "initializer_range", "vision_use_head"})
# The pooling head's tensors (vision_use_head): present in some checkpoints, never read.
HEAD = "vision_tower.head."


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The SigLIP tower (the field names idefics3's tower reads) and the projector's pool."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str  # ridge's name (quant/hf_config.py ACTIVATIONS)
    layer_norm_eps: float
    mm_tokens_per_image: int
    text_hidden_size: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)


def read_vision(c: HFConfig, text_hidden_size: int) -> VisionConfig:
    """The wrapper's vision_config and mm_tokens_per_image, each honoured or refused by name."""
    v, tower = read_tower(c, VISION_DEFAULTS)
    if v.get("model_type") not in (None, "siglip_vision_model"):
        v.refuse("model_type", v.get("model_type"), "Gemma 3's tower is siglip_vision_model")
    image, patch = tower["image_size"], tower["patch_size"]
    if image % patch:
        # SiglipVisionEmbeddings' conv drops the remainder while its position table counts it
        v.refuse("patch_size", patch, f"does not divide image_size={image}")
    tokens = positive(c, "mm_tokens_per_image")
    side, patches = math.isqrt(tokens), image // patch
    if side * side != tokens or patches % side:
        # the projector pools the patch grid by patches // side: a square that divides it exactly
        c.refuse("mm_tokens_per_image", tokens, f"expected the square of a divisor of the {patches} patches a side")
    return VisionConfig(**tower, mm_tokens_per_image=tokens, text_hidden_size=text_hidden_size)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in fp32, back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Projector(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg.hidden_size, cfg.text_hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.side, self.kernel = cfg.patches_per_side, cfg.patches_per_side // cfg.tokens_per_side
        self.proj: TowerLinear | None = None  # the product in FP8 (quantize), in place of the parameter

    def quantize(self, device, dtype: torch.dtype) -> None:
        """The [in, out] product as an FP8Linear: e4m3, one scale per output channel."""
        w = self.mm_input_projection_weight.detach()
        self.proj = TowerLinear(*w.shape)
        self.proj.load(*quantize_fp8(w.T.float(), grouping="channel"), None, torch.device(device), dtype)
        del self.mm_input_projection_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, d = x.shape  # [N, side * side, D], patches row by row
        grid = x.transpose(1, 2).reshape(n, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [N, tokens, D]
        normed = self.mm_soft_emb_norm(pooled)
        if self.proj is not None:
            return self.proj(normed).type_as(x)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


class Gemma3Vision(nn.Module):
    """The encoder the engine runs for a Gemma 3 prompt's images: encode() turns each ImageInput
    (the whole image or one crop) into its mm_tokens_per_image rows of the text model's embeddings."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg)
        self.multi_modal_projector = Projector(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.mm_soft_emb_norm.weight.dtype  # the compute dtype, FP8 or not

    @property
    def device(self) -> torch.device:
        return self.multi_modal_projector.mm_soft_emb_norm.weight.device

    @torch.no_grad()
    def encode(self, inputs: list[ImageInput]) -> list[torch.Tensor]:
        """One [mm_tokens_per_image, text hidden] tensor per input, in the weights' dtype; all go
        through the tower together (every picture is the same square)."""
        c = self.cfg
        want = (c.num_channels, c.image_size, c.image_size)
        for i, inp in enumerate(inputs):
            if tuple(inp.pixel_values.shape) != want:
                raise ValueError(f"image input {i}: pixel values of shape {inp.pixel_values.shape}, expected {want}")
            if inp.length != c.mm_tokens_per_image:
                raise ValueError(f"image input {i}: {inp.length} placeholder tokens for a picture worth "
                                 f"{c.mm_tokens_per_image}")
        if not inputs:
            return []
        # np.stack copies: an input's pixels may be a read-only buffer
        pixels = torch.from_numpy(np.stack([inp.pixel_values for inp in inputs])).to(self.device, self.dtype)
        return list(self.multi_modal_projector(self.vision_tower(pixels)))

    def weight_bytes(self) -> int:
        return tower_bytes(self)


def _module_name(name: str) -> str | None:
    """A checkpoint's tensor -> Gemma3Vision's name, or None for the text model's and the unused head's.
    The Hub's files hold vision_tower.vision_model.* and multi_modal_projector.*; transformers 5.25
    saves vision_tower.* (SiglipVisionModel's names without vision_model) and reads model.* too."""
    if not name.startswith(VISION_PREFIXES):
        return None
    name = name.removeprefix("model.")
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name[len("vision_tower.vision_model."):]
    return None if name.startswith(HEAD) else name


def load_vision(path, device, dtype: torch.dtype, weights: str = "fp32") -> Gemma3Vision | None:
    """The tower and the projector of a Gemma 3 directory, their weights in dtype on device (their
    Linears and the projector's product e4m3 where weights is "fp8"); None for Gemma3ForCausalLM's
    (no tower) and where its safetensors hold neither (a text-only copy). Reads only their tensors,
    one at a time from the files' memory maps."""
    path = Path(path)
    values = read_config(path)
    if values.get("model_type") != "gemma3":
        return None
    c = HFConfig(values, path / "config.json", WRAPPER_DEFAULTS)
    cfg = read_vision(c, text_config(c).positive_int("hidden_size"))
    model = load_encoder(path, _module_name, lambda: Gemma3Vision(cfg), device, dtype, weights)
    if model is not None and weights == "fp8":  # a parameter, not an nn.Linear: load_encoder left it
        model.multi_modal_projector.quantize(device, dtype)
    return model
