"""A model source -> a CausalLM on a device, ready to run: the runtime half of
loading. The offline half (source -> fused FP8 state dict, cached on disk) is
ridge/quant/loader.py's convert()."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.config import ModelConfig
from ridge.quant.loader import convert, resolve_model_path

from .llama import CausalLM


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: object
    path: Path
    device: torch.device
    load_seconds: float
    from_cache: bool

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(path=None, *, device=None, dtype=None, max_model_len=None, quantize=True,
               use_cache=True, show_progress=True, rule="mse") -> LoadedModel:
    t0 = time.perf_counter()
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    conv = convert(path, quantize=quantize, rule=rule, use_cache=use_cache, show_progress=show_progress)
    with torch.device("meta"):
        model = CausalLM(conv.config, max_model_len)
    model.load_weights(conv.state_dict, device, dtype, conv.freq_factors)
    model.eval()
    return LoadedModel(conv.config, model, conv.tokenizer, resolve_model_path(path), device,
                       time.perf_counter() - t0, conv.from_cache)
