"""The runtime half of loading: a converted state dict (quant/convert.py) -> a CausalLM on a device."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.config import ModelConfig
from ridge.kernels import ops
from ridge.quant.convert import convert
from ridge.quant.source import resolve_model_path

from .families import model_class
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
    identity: str = ""  # what the weights are (quant/convert.py): the KV tiers' disk key starts from it

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(path=None, *, device=None, dtype=None, max_model_len=None, quantize=True,
               use_cache=True, show_progress=True, rule="mse") -> LoadedModel:
    t0 = time.perf_counter()
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or ops.compute_dtype(device)
    conv = convert(path, quantize=quantize, rule=rule, use_cache=use_cache, show_progress=show_progress)
    with torch.device("meta"):  # no memory until load_weights places each tensor on the device
        model = model_class(conv.config)(conv.config, max_model_len)
    model.load_weights(conv.state_dict, device, dtype, conv.freq_factors)
    model.eval()
    return LoadedModel(conv.config, model, conv.tokenizer, resolve_model_path(path), device,
                       time.perf_counter() - t0, conv.from_cache, conv.identity)
