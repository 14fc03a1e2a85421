"""The families ridge runs: one line each in FAMILIES, the folder under ridge/models/ whose
package's SPEC (quant/spec.py ModelSpec) says how the family is read from a Hugging Face
directory and a GGUF, how its tensors fuse, and which model runs it (vLLM's model registry,
by folder). docs/architecture.md (## Models, "Adding a family") shows a family's folder.

quant/ sits below models/ (tests/test_layers.py), so its readers and convert() take the
registry as an argument; the functions below are them with ridge's families."""
from __future__ import annotations

from functools import partial
from importlib import import_module

from ridge.config import ModelConfig
from ridge.quant import convert as converter, gguf_config, hf_loader, source
from ridge.quant.spec import Registry

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "olmo2",
    "granite",
    "gemma2",
    "gemma3",
    "gemma4",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "olmo3",
    "smollm3",
    "ministral",
    "ministral3",
    "exaone4",
    "seed_oss",
    "ernie4_5",
    "glm4_moe",
    "llama4_text",
    "qwen3_5",
    "lfm2",
    "qwen3_next",
    "qwen3_5_moe",
    "granitemoehybrid",
    "nemotron_h",
    "idefics3",
    "mistral3",
    "qwen2_5_vl",
    "qwen3_vl",
)
REGISTRY = Registry(import_module(f"{__package__}.{name}").SPEC for name in FAMILIES)
# llama.cpp's projector files (--mmproj, models/mmproj.py): clip.projector_type -> the folder whose
# mmproj.py reads it
PROJECTORS = {"gemma3": "gemma3", "qwen2.5vl_merger": "qwen2_5_vl"}


def model_class(cfg: ModelConfig) -> type:
    """The nn.Module class that runs cfg.arch."""
    return REGISTRY[cfg.arch].model


convert = partial(converter.convert, registry=REGISTRY)
read_config = partial(source.read_config, registry=REGISTRY)
read_hf_config = partial(hf_loader.read_hf_config, registry=REGISTRY)
read_gguf_config = partial(gguf_config.read_config, registry=REGISTRY)


def load_vision(path, device, dtype, weights: str = "fp32"):
    """The image encoder of an HF directory whose model_type is a wrapper with one (HFWrapper.vision),
    read beside its text model, its Linears in FP8 where weights is "fp8"; None for any other model
    (text only)."""
    import json
    from pathlib import Path

    p = Path(path)
    if not (p / "config.json").is_file():
        return None
    found = REGISTRY.hf(json.loads((p / "config.json").read_text()).get("model_type"))
    wrapper = found[1] if found else None
    return wrapper.vision(p, device, dtype, weights=weights) if wrapper is not None and wrapper.vision is not None else None
