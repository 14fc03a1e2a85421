"""Hugging Face directories: config.json + *.safetensors (fp32/fp16/bf16, or
vLLM-style FP8 e4m3 with `weight_scale` per tensor or per channel)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ridge.config import ModelConfig

from .errors import ModelLoadError
from .progress import progress

_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def read_hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(path, "no config.json in this directory")
    try:
        c = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(cfg_file, f"invalid JSON ({e})") from None
    kind = c.get("model_type")
    if kind not in _ARCHS:
        raise ModelLoadError(cfg_file, f"unsupported model_type {kind!r}; ridge runs {', '.join(_ARCHS)}")
    arch = _ARCHS[kind]
    heads = c["num_attention_heads"]
    rope = c.get("rope_parameters") or {}  # transformers 5 moves theta and scaling here
    scaling = c.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
    if scaling and (scaling.get("rope_type") or scaling.get("type")) in (None, "default"):
        scaling = None
    return ModelConfig(
        arch=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=c.get("rope_theta") or rope.get("rope_theta", 10000.0), rope_scaling=scaling,
        max_position=c.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
        qk_norm=arch == "qwen3", name=path.name,
    )


def load_hf(path, show_progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    path = Path(path)
    cfg = read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "no *.safetensors weights in this directory")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in progress(st.keys(), f"loading {f.name}", enabled=show_progress):
                    sd[name] = st.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f, f"not a readable safetensors file ({e})") from None
    return cfg, sd
