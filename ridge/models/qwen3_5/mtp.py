"""Qwen3.5's multi-token-prediction head (the checkpoint's mtp.* tensors), run as a draft proposer
(ridge/engine/speculative/mtp.py). transformers does not load it; the definition is the one the
checkpoints were trained with (and vLLM's Qwen3_5MultiTokenPredictor runs):

  x = fc([norm_e(embed(t_{i+1})) ; norm_h(h_i)])        fc: 2H -> H, the embedding half first
  x = decoder layer (gated full attention, the target's MLP or its MoE), over the head's own KV
  g = norm(x)                                           -> logits lm_head(g), t_{i+2}'s
where h_i is the target's final hidden state at position i (after its final norm, as the model
returns it) and every norm multiplies by 1 + w. The head runs at position i. A further draft
feeds g back as the next position's h with the drafted token.

The head shares the target's embedding, head and RoPE table, holds one attention layer's KV in
the target's blocks, and keeps its weights in the compute dtype (unquantized): it is one layer."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import fuse_layer
from ridge.quant.linear import FP8Linear

from ..layers.decoder import CausalLM, RMSNorm

PREFIX = "mtp."
NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def mtp_num_layers(path: Path) -> int:
    """config.json's mtp_num_hidden_layers (the text config's, under a multimodal wrapper); 0 if absent,
    and for a checkpoint without config.json (a GGUF file: llama.cpp's converter drops mtp.*)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return 0
    raw = json.loads(f.read_text())
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    n = text.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 0))
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ModelLoadError(path, f"mtp_num_hidden_layers={n!r}: expected a non-negative integer")
    if n > 1:
        raise ModelLoadError(path, f"mtp_num_hidden_layers={n}: ridge runs a one-layer MTP head (each further "
                                   "layer would draft with its own KV)")
    if text.get("mtp_use_dedicated_embeddings", False):
        raise ModelLoadError(path, "mtp_use_dedicated_embeddings=True: ridge's MTP head reads the target's "
                                   "embedding table")
    return n


def read_mtp_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's mtp.* tensors, from every safetensors file of the directory."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.startswith(PREFIX):
                    out[name[len(PREFIX):]] = st.get_tensor(name)
    return out


def head_config(cfg: ModelConfig) -> ModelConfig:
    """The target's config as a one-layer stack whose layer attends fully (and routes to experts
    where the target's layers do): the head's layer and its KV shape."""
    return dataclasses.replace(cfg, num_layers=1, linear_layers=None, layer_types=None,
                               moe_layers=None if cfg.num_experts else cfg.moe_layers)


class Qwen35MTP(nn.Module):
    def __init__(self, target: CausalLM, cfg: ModelConfig, layer: nn.Module):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.name = "mtp"
        self.target = [target]  # not a submodule: its weights are the target's, counted there
        h = cfg.hidden_size
        self.fc = FP8Linear(2 * h, h)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, input_ids, hidden, positions, meta, kv) -> torch.Tensor:
        """input_ids [T] (the tokens after each position), hidden [T, H] (the target's states at the
        positions, or the head's own for a further draft) -> the head's states [T, H]."""
        target = self.target[0]
        e = self.pre_fc_norm_embedding.forward(target.embed(input_ids))[0]
        h = self.pre_fc_norm_hidden.forward(hidden.to(e.dtype))[0]
        x = self.fc.forward(torch.cat([e, h], dim=-1))
        x, residual = self.layer.forward(x, None, positions, target.cos_sin, meta, kv)
        return self.norm.forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target[0].compute_logits(hidden)

    @property
    def kv_config(self) -> ModelConfig:
        """The config of its own KV (one attention layer), kept in the target's blocks."""
        return self.cfg

    def head_weights(self) -> int:
        """Weights a draft multiplies besides its layers' linear ones: the target's lm_head."""
        return self.target[0].lm_head.weight.numel()

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self.parameters()) + list(self.buffers()))


def load_mtp(target: CausalLM, path: Path, device: torch.device, dtype: torch.dtype) -> Qwen35MTP | None:
    """The head of the checkpoint at path for the loaded target, or None where it has none (not a
    Qwen3.5, mtp_num_hidden_layers 0, or no mtp.* tensors: transformers' save_pretrained drops them)."""
    from ridge.models import qwen3_5, qwen3_5_moe

    if target.cfg.arch not in (qwen3_5.SPEC.arch, qwen3_5_moe.SPEC.arch) or mtp_num_layers(path) == 0:
        return None
    raw = read_mtp_tensors(path)
    if not raw:
        return None
    cfg = head_config(target.cfg)
    layout = (qwen3_5_moe.SPEC if cfg.num_experts else qwen3_5.SPEC).weights
    hf = {("model." + k if k.startswith("layers.0.") else k): t for k, t in raw.items()}
    for name in NORMS + ("fc",):
        if name + ".weight" not in hf:
            raise ModelLoadError(path, f"missing tensor {PREFIX}{name}.weight")
    qwen3_5.shift_norms(hf)  # the layer's norms and the head's last one (names ending norm.weight)
    for name in NORMS[:2]:
        hf[name + ".weight"] = hf[name + ".weight"].float() + 1.0
    fused = fuse_layer(hf, cfg, 0, {}, path, layout)
    with torch.device("meta"):
        stack = type(target)(cfg, target.max_model_len)
    stack.load_layer(0, fused, device, dtype)
    head = Qwen35MTP(target, cfg, stack.layers[0])
    CausalLM._load_modules([("fc", head.fc)], hf, device, dtype)
    for name in NORMS:
        getattr(head, name).weight = hf[name + ".weight"].float().to(device)
    return head.eval()
