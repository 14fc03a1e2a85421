"""The offline half of loading: a model source -> fused FP8 state dict + config +
tokenizer, cached on disk. ridge/models/loader.py is the runtime half."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ridge.config import ModelConfig

from . import store
from .fp8 import quantize_state_dict
from .fuse import fuse_hf_state_dict
from .source import read_source, resolve_model_path

log = logging.getLogger("ridge.quant")


@dataclass
class ConvertedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # fused names; linear weights FP8 unless quantize=False
    tokenizer: object
    freq_factors: torch.Tensor | None
    from_cache: bool
    identity: str = ""  # the store key: the source file's identity, the quantizer's version and options


def convert(path=None, *, quantize: bool = True, rule: str = "mse", use_cache: bool = True,
            show_progress: bool = True) -> ConvertedModel:
    from ridge.tokenizer import Tokenizer

    path = resolve_model_path(path)
    key = store.cache_key(path, {"quantize": quantize, "rule": rule})
    if use_cache and quantize and (hit := store.load(key)) is not None:
        meta, tensors = hit
        freq = tensors.pop("__rope_freqs__", None)
        return ConvertedModel(ModelConfig.from_dict(meta["config"]), tensors,
                              Tokenizer.from_dict(meta["tokenizer"]), freq, True, key)
    cfg, sd, freq, tok = read_source(path, show_progress)
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
    return ConvertedModel(cfg, fused, tok, freq, False, key)
