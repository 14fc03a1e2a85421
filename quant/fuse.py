"""Hugging Face names -> the model's fused layout (qkv_proj, gate_up_proj).

Fusing turns seven matrix products per layer into four. FP8 weights fuse too:
their scales are per output channel, so they concatenate along with the rows
(a per-tensor scale is first broadcast to its rows)."""
from __future__ import annotations

import torch

from ridge.config import ModelConfig

from .errors import ModelLoadError

FP8 = torch.float8_e4m3fn
# Each layer's norms, by architecture (Gemma norms both branches' inputs and outputs).
_LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")
_GEMMA_NORMS = _LLAMA_NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")
LAYER_NORMS = {"gemma2": _GEMMA_NORMS, "gemma3_text": _GEMMA_NORMS,
               "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm")}
# Architectures whose checkpoints ship qkv_proj and gate_up_proj fused, in the model's layout.
FUSED_AS_SHIPPED = ("phi3",)


def _row_scale(sd, prefix: str, rows: int) -> torch.Tensor | None:
    s = sd.get(prefix + ".weight_scale")
    if s is None:
        return None
    s = s.float().reshape(-1)
    return s.expand(rows).clone() if s.numel() == 1 else s


def _cat(sd, prefixes: list[str], out: dict, name: str, path, bias: bool = False) -> None:
    """bias: the config declares biases on these projections; a checkpoint that disagrees with
    its config is refused rather than run one way or the other."""
    try:
        ws = [sd[p + ".weight"] for p in prefixes]
    except KeyError as e:
        raise ModelLoadError(path, f"missing tensor {e.args[0]}") from None
    out[name + ".weight"] = torch.cat(ws, dim=0)
    if ws[0].dtype == FP8:
        out[name + ".weight_scale"] = torch.cat([_row_scale(sd, p, w.shape[0]) for p, w in zip(prefixes, ws)])
    for p in prefixes:
        if (p + ".bias" in sd) != bias:
            raise ModelLoadError(path, f"missing tensor {p}.bias, which the config declares" if bias else
                                 f"tensor {p}.bias, which the config does not declare (its bias flags are false)")
    if bias:
        out[name + ".bias"] = torch.cat([sd[p + ".bias"] for p in prefixes], dim=0)


def fuse_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, path="model") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def take(src: str, dst: str):
        if src not in sd:
            raise ModelLoadError(path, f"missing tensor {src}")
        out[dst] = sd[src]

    take("model.embed_tokens.weight", "embed_tokens.weight")
    take("model.norm.weight", "norm.weight")
    if not cfg.tie_word_embeddings:  # tied: the model reuses the embedding table
        _cat(sd, ["lm_head"], out, "lm_head", path)
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for norm in LAYER_NORMS.get(cfg.arch, _LLAMA_NORMS):
            take(p + norm + ".weight", q + norm + ".weight")
        a, m = p + "self_attn.", p + "mlp."
        shipped = cfg.arch in FUSED_AS_SHIPPED  # rows [q | k | v] and [gate | up], as ours
        _cat(sd, [a + "qkv_proj"] if shipped else [a + "q_proj", a + "k_proj", a + "v_proj"], out, q + "qkv_proj",
             path, cfg.attention_bias)
        _cat(sd, [a + "o_proj"], out, q + "o_proj", path, cfg.o_bias)
        _cat(sd, [m + "gate_up_proj"] if shipped else [m + "gate_proj", m + "up_proj"], out, q + "gate_up_proj",
             path, cfg.mlp_bias)
        _cat(sd, [m + "down_proj"], out, q + "down_proj", path, cfg.mlp_bias)
        if cfg.qk_norm:
            take(a + "q_norm.weight", q + "q_norm.weight")
            take(a + "k_norm.weight", q + "k_norm.weight")
    return out
