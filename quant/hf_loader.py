"""Hugging Face directories: config.json + *.safetensors (fp32/fp16/bf16, or
vLLM-style FP8 e4m3 with `weight_scale` per tensor or per channel)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ridge.config import ModelConfig

from .errors import ModelLoadError
from .hf_gemma import shift_norms
from .progress import progress


def read_hf_config(path: Path) -> ModelConfig:
    """config.json -> ModelConfig through the model_type's family (quant/families.py), which
    honours or refuses every field its transformers model reads."""
    from .families import FAMILIES
    from .hf_config import HFConfig

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(path, "no config.json in this directory")
    try:
        c = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(cfg_file, f"invalid JSON ({e})") from None
    if not isinstance(c, dict):
        raise ModelLoadError(cfg_file, "not a JSON object")
    kind = c.get("model_type")
    if kind not in FAMILIES:
        raise ModelLoadError(cfg_file, f"unsupported model_type {kind!r}; ridge runs {', '.join(FAMILIES)}")
    family = FAMILIES[kind]
    view = HFConfig(c, cfg_file, family.defaults)
    _check_quantization(view, kind)
    kw = family.model_config_kwargs(view)
    kw["name"] = path.name
    return ModelConfig(**kw)


def _check_quantization(c, kind: str) -> None:
    """ridge reads FP8 e4m3 checkpoints with one weight_scale per tensor or per output channel,
    and gpt-oss's MXFP4 experts (dequantized at load: quant/gpt_oss.py); any other
    quantization_config would be misread."""
    q = c.get("quantization_config")
    if q is None:
        return
    method = q.get("quant_method") if isinstance(q, dict) else q
    if kind == "gpt_oss" and method == "mxfp4":
        return
    if not isinstance(q, dict) or method not in ("fp8", "compressed-tensors"):
        c.refuse("quantization_config.quant_method", method, "ridge reads FP8 checkpoints (fp8, compressed-tensors)")
    if q.get("weight_block_size") is not None:
        c.refuse("quantization_config.weight_block_size", q["weight_block_size"],
                 "ridge reads one FP8 scale per tensor or per output channel, not per block")


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
    if cfg.arch in ("gemma2", "gemma3_text"):
        shift_norms(sd)
    return cfg, sd
