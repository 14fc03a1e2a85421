"""Hugging Face directories: config.json + *.safetensors (fp32/fp16/bf16, or
vLLM-style FP8 e4m3 with `weight_scale` per tensor or per channel)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ridge.config import ModelConfig

from .errors import ModelLoadError
from .hf_config import HFConfig
from .progress import progress

log = logging.getLogger("ridge.quant")


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


def _family(path: Path, registry):
    """-> (ModelSpec, HFWrapper or None, config.json's values): the family of config.json's model_type."""
    c = _config_json(path)
    kind = c.get("model_type")
    found = registry.hf(kind)
    if found is None:
        raise ModelLoadError(path / "config.json", f"unsupported model_type {kind!r}; "
                                                   f"ridge runs {', '.join(registry.hf_model_types())}")
    return *found, c


def read_hf_config(path: Path, registry) -> ModelConfig:
    """config.json -> ModelConfig through the family of its model_type (registry: quant/spec.py),
    which honours or refuses every field its transformers model reads; a wrapper's (a multimodal
    checkpoint served as text) through its text model's."""
    cfg_file = path / "config.json"
    spec, wrapper, c = _family(path, registry)
    if wrapper is not None:
        outer = HFConfig(c, cfg_file, wrapper.defaults)
        _check_quantization(outer, spec.hf)
        view = wrapper.text_config(outer)
    else:
        view = HFConfig(c, cfg_file, spec.hf.defaults)
        _check_quantization(view, spec.hf)
    kw = spec.hf.model_config_kwargs(view, spec.arch)
    kw["name"] = path.name
    return ModelConfig(**kw)


def _check_quantization(c, family) -> None:
    """ridge reads FP8 e4m3 checkpoints with one weight_scale per tensor or per output channel,
    and the methods a family declares (HFFamily.quant_methods: dequantized as they are read);
    any other quantization_config would be misread."""
    q = c.get("quantization_config")
    if q is None:
        return
    method = q.get("quant_method") if isinstance(q, dict) else q
    if method in family.quant_methods:
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

    def __init__(self, path, cfg: ModelConfig, registry):
        from safetensors import safe_open

        from .fuse import with_model_prefix

        self.path, self.cfg = Path(path), cfg
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(self.path, "no *.safetensors weights in this directory")
        spec, wrapper, _ = _family(self.path, registry)
        self.family = spec.hf
        # A wrapper gives its text model's tensors under the family's names; the other
        # modalities' are never read.
        rename = wrapper.tensor_name if wrapper is not None else None
        if wrapper is None and spec.hf.rename is not None:
            rename = lambda name, f: spec.hf.rename(name)  # noqa: E731
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
        if wrapper is not None:
            log.info("%s: %s served as text: its %d %s tensors are not loaded", path, wrapper.model_type, skipped,
                     wrapper.skipped)
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
        if self.family.tensors is not None:
            self.family.tensors(sd)
        return sd

    def globals(self) -> dict[str, torch.Tensor]:
        return self._read(self._globals)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return self._read(self._layers.get(i, ()))


def load_hf(path, registry, show_progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """-> (config, every tensor by name): the whole model at once, for the callers that want it
    (unquantized weights, an FP8 checkpoint, a recipe measured on the whole model)."""
    path = Path(path)
    cfg = read_hf_config(path, registry)
    src = HFTensors(path, cfg, registry)
    sd = src.globals()
    for i in progress(sorted(src._layers), "loading", enabled=show_progress):
        sd.update(src.layer(i))
    return cfg, sd
