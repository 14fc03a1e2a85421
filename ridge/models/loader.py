"""The runtime half of loading: a converted state dict (quant/convert.py) -> a CausalLM on a device."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.config import ModelConfig
from ridge.kernels import ops
from ridge.plan import WEIGHT_BYTES
from ridge.quant.errors import ModelLoadError
from ridge.quant.experts import FP8Experts
from ridge.quant.fp8 import FP8
from ridge.quant.linear import FP8Linear
from ridge.quant import store
from ridge.quant.source import resolve_model_path

from .cpu_image import load_image, save_image
from .fp8_calibrate import STREAMED, calibrate
from .mmproj import load_mmproj
from .layers.decoder import CausalLM
from .registry import convert, load_vision, model_class


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: object
    path: Path
    device: torch.device
    load_seconds: float
    from_cache: bool
    weights: str  # what they hold (`--weights`): fp8, or the source's values in bf16 or fp32
    identity: str = ""  # what the weights are (quant/convert.py, and weights): the KV tiers' disk key starts from it
    vision: object = None  # an image model's encoder (its family's load_vision), whose encode() the engine calls
    mmproj: Path | None = None  # the projector file the encoder came from, for a GGUF model (models/mmproj.py)

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(path=None, *, device=None, weights="fp8", max_model_len=None, use_cache=True,
               show_progress=True, rule="mse", recipe=None, mmproj=None) -> LoadedModel:
    """weights: fp8 (e4m3 made by the FP8 recipe `recipe`, None for RIDGE_FP8_RECIPE or the declared
    default: quant/recipe.py, measured on the calibration text by fp8_calibrate where it asks), or
    bf16 / fp32 (the source's values unquantized in that dtype). The engine passes its `--weights`; this default
    is for callers without options (tests, tools). mmproj: a GGUF model's image encoder, llama.cpp's
    projector file (models/mmproj.py)."""
    if weights not in WEIGHT_BYTES:
        raise ValueError(f"--weights {weights!r}: choose {', '.join(WEIGHT_BYTES)}")
    t0 = time.perf_counter()
    device = torch.device(device) if device is not None else default_device()
    dtype = torch.float32 if weights == "fp32" else ops.compute_dtype(device)  # bf16 on CPU: fp32, see below
    conv = convert(path, quantize=weights == "fp8", rule=rule, recipe=recipe, calibrate=calibrate,
                   use_cache=use_cache, show_progress=show_progress, device=device.type,
                   calibrate_layers=STREAMED, layered=True)
    if weights != "fp8":
        _refuse_fp8_source(conv.state_dict, weights, resolve_model_path(path))
    with torch.device("meta"):  # no memory until load_weights places each tensor on the device
        model = model_class(conv.config)(conv.config, max_model_len)
    sd = conv.state_dict
    imaged = _wants_image(conv, device, weights, use_cache)
    image = load_image(conv.identity) if imaged else None
    if image is not None:  # the packed weights mapped: decoder.py and quant/embedding.py take them as they are
        sd.update(image)
    model.load_globals(sd, device, dtype, conv.freq_factors)
    for i in range(conv.config.num_layers):
        # Consumed a layer at a time: once the model holds its own copy, the cache's mapping of
        # that layer's shard (or the converted tensors, or the source's layer) goes before the next.
        if conv.layer is not None:
            model.load_layer(i, conv.layer(i), device, dtype)
            continue
        model.load_layer(i, sd, device, dtype)
        for k in [k for k in sd if k.startswith(f"layers.{i}.")]:
            del sd[k]
    if weights == "bf16" and dtype != torch.bfloat16:
        _round_to_bf16(model)
    if imaged and image is None:
        save_image(conv.identity, model, str(resolve_model_path(path)))
    model.eval()
    # An image model's encoder in the text model's compute dtype: it has no FP8 path yet.
    vision = load_vision(resolve_model_path(path), device, dtype, weights=weights)
    if mmproj is not None:
        if vision is not None or resolve_model_path(path).is_dir():
            raise ModelLoadError(mmproj, "--mmproj is for a GGUF model: an HF directory carries its own image encoder")
        vision = load_mmproj(mmproj, device, dtype, weights, conv.config.hidden_size)
    return LoadedModel(conv.config, model, conv.tokenizer, resolve_model_path(path), device,
                       time.perf_counter() - t0, conv.from_cache, weights, f"{conv.identity}:{weights}", vision,
                       None if mmproj is None else Path(mmproj))


def _wants_image(conv, device: torch.device, weights: str, use_cache: bool) -> bool:
    """Whether this start reads (or, the first time, writes) a CPU image of the converted cache
    (cpu_image.py): FP8 weights from a cached entry, on a CPU where ridge's products read them packed."""
    return (device.type == "cpu" and weights == "fp8" and use_cache and bool(conv.identity)
            and ops.resident_e4m3(device, (16, 2)) and (store.cache_root() / conv.identity).is_dir())


def _refuse_fp8_source(sd: dict, weights: str, path) -> None:
    """An FP8 checkpoint has no unquantized values: bf16 cannot hold e4m3 * scale exactly, and fp32
    would hold the numbers --weights fp8 holds, in four times the memory."""
    name = next((n for n, t in sd.items() if t.dtype == FP8), None)
    if name is not None:
        raise ModelLoadError(path, f"its weights are FP8 already ({name}); --weights {weights} needs unquantized "
                                   "weights: use --weights fp8")


@torch.no_grad()
def _round_to_bf16(model) -> None:
    """bf16 weights computed in fp32 (CPU): the numbers a GPU holds (linear weights, biases,
    embeddings; norms stay fp32 there too), kept in fp32, which holds them exactly."""
    tensors = [model.embed_tokens.weight.data]
    for m in model.modules():
        if isinstance(m, FP8Linear):
            tensors += [t for t in (m.weight, m.bias) if t is not None]
        elif isinstance(m, FP8Experts):
            tensors += [t for t in (m.w_gate_up, m.w_down, m.b_gate_up, m.b_down) if t is not None]
    for t in {t.data_ptr(): t for t in tensors}.values():  # a tied head is the embedding
        t.copy_(t.to(torch.bfloat16))
