"""Hugging Face directories: config.json + *.safetensors (fp32/fp16/bf16, or
vLLM-style FP8 e4m3 with `weight_scale` per tensor or per channel)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ridge.config import ModelConfig

from .errors import ModelLoadError
from .hf_gemma import (GEMMA3_WRAPPER_DEFAULTS, VISION_PREFIXES, gemma3_text_config, gemma3_text_name,
                       shift_norms)
from .progress import progress

log = logging.getLogger("ridge.quant")
MULTIMODAL_GEMMA3 = "gemma3"  # Gemma3ForConditionalGeneration: its text model only


def _config_json(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(path, "no config.json in this directory")
    try:
        c = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(cfg_file, f"invalid JSON ({e})") from None
    if not isinstance(c, dict):
        raise ModelLoadError(cfg_file, "not a JSON object")
    return c


def read_hf_config(path: Path) -> ModelConfig:
    """config.json -> ModelConfig through the model_type's family (quant/families.py), which
    honours or refuses every field its transformers model reads; the multimodal gemma3 through
    its text model's (quant/hf_gemma.py)."""
    from .families import FAMILIES
    from .hf_config import HFConfig

    cfg_file = path / "config.json"
    c = _config_json(path)
    kind = c.get("model_type")
    if kind not in FAMILIES and kind != MULTIMODAL_GEMMA3:
        raise ModelLoadError(cfg_file, f"unsupported model_type {kind!r}; "
                                       f"ridge runs {', '.join([*FAMILIES, MULTIMODAL_GEMMA3])}")
    if kind == MULTIMODAL_GEMMA3:
        wrapper = HFConfig(c, cfg_file, GEMMA3_WRAPPER_DEFAULTS)
        _check_quantization(wrapper, kind)
        family = FAMILIES["gemma3_text"]
        view = gemma3_text_config(wrapper)
    else:
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
    # A multimodal Gemma 3 gives its language model's tensors under Gemma3ForCausalLM's names;
    # the vision tower's and the projector's are never read.
    rename = gemma3_text_name if _config_json(path).get("model_type") == MULTIMODAL_GEMMA3 else None
    sd: dict[str, torch.Tensor] = {}
    skipped = 0
    for f in files:
        try:
            st = safe_open(str(f), framework="pt")
        except Exception as e:
            raise ModelLoadError(f, f"not a readable safetensors file ({e})") from None
        with st:
            for name in progress(st.keys(), f"loading {f.name}", enabled=show_progress):
                dst = rename(name, f) if rename else name
                if dst is None:
                    skipped += 1
                    continue
                if dst in sd:
                    raise ModelLoadError(f, f"tensor {name}: a second copy of {dst}")
                try:
                    sd[dst] = st.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f, f"not a readable safetensors file ({e})") from None
    if rename:
        log.info("%s: Gemma 3 with vision served as text: its %d vision tower and projector tensors (%s) are "
                 "not loaded", path, skipped, ", ".join(p.rstrip(".") for p in VISION_PREFIXES))
    if cfg.arch in ("gemma2", "gemma3_text"):
        shift_norms(sd)
    return cfg, sd
