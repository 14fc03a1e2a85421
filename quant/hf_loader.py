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


class HFTensors:
    """A directory's tensors under the names the converter reads, by layer (layer(i): those under
    model.layers.{i}.; globals(): the rest), each read from its file's memory map when asked.
    A layer at a time is what conversion holds, however large the model (issue 39)."""

    def __init__(self, path, cfg: ModelConfig):
        from safetensors import safe_open

        from .fuse import with_model_prefix

        self.path, self.cfg = Path(path), cfg
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(self.path, "no *.safetensors weights in this directory")
        # A multimodal Gemma 3 gives its language model's tensors under Gemma3ForCausalLM's names;
        # the vision tower's and the projector's are never read.
        rename = gemma3_text_name if _config_json(self.path).get("model_type") == MULTIMODAL_GEMMA3 else None
        self._where: dict[str, tuple[str, Path]] = {}  # our name -> (its name in the file, the file)
        skipped = 0
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as st:
                    keys = list(st.keys())
            except Exception as e:
                raise ModelLoadError(f, f"not a readable safetensors file ({e})") from None
            for name in keys:
                dst = rename(name, f) if rename else name
                if dst is None:
                    skipped += 1
                    continue
                if dst in self._where:
                    raise ModelLoadError(f, f"tensor {name}: a second copy of {dst}")
                self._where[dst] = (name, f)
        if rename:
            log.info("%s: Gemma 3 with vision served as text: its %d vision tower and projector tensors (%s) are "
                     "not loaded", path, skipped, ", ".join(p.rstrip(".") for p in VISION_PREFIXES))
        self._where = with_model_prefix(self._where)
        self._layers: dict[int, list[str]] = {}
        self._globals: list[str] = []
        for name in self._where:
            parts = name.split(".", 3)
            if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
                self._layers.setdefault(int(parts[2]), []).append(name)
            else:
                self._globals.append(name)

    def names(self) -> list[str]:
        return list(self._where)

    def _read(self, names) -> dict[str, torch.Tensor]:
        """Each file is mapped anew for the tensors asked: the mapping (and the pages it has read,
        which count as the process's) goes when they do, so a layer's pages go with the layer."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for dst in names:
            by_file.setdefault(self._where[dst][1], []).append(dst)
        sd = {}
        for f, dsts in by_file.items():
            try:
                with safe_open(str(f), framework="pt") as st:
                    for dst in dsts:
                        sd[dst] = st.get_tensor(self._where[dst][0])
            except Exception as e:
                raise ModelLoadError(f, f"not a readable safetensors file ({e})") from None
        if self.cfg.arch in ("gemma2", "gemma3_text"):
            shift_norms(sd)
        return sd

    def globals(self) -> dict[str, torch.Tensor]:
        return self._read(self._globals)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return self._read(self._layers.get(i, ()))


def load_hf(path, show_progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """-> (config, every tensor by name): the whole model at once, for the callers that want it
    (unquantized weights, an FP8 checkpoint, a recipe measured on the whole model)."""
    path = Path(path)
    cfg = read_hf_config(path)
    src = HFTensors(path, cfg)
    sd = src.globals()
    for i in progress(sorted(src._layers), "loading", enabled=show_progress):
        sd.update(src.layer(i))
    return cfg, sd
