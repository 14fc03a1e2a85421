"""What quant/ takes from a model family, and the registry that finds a family for a file.

quant/ reads, fuses and quantizes every family the same way. What differs from one family to
the next is a ModelSpec, written in the family's folder under ridge/models/ and registered in
ridge/models/registry.py: how its config.json is read (HFFamily), how its GGUF metadata and
tensors are read (GGUFFamily), its tensor layout (WeightLayout) and the model that runs it.
quant/ sits below models/ (tests/test_layers.py), so the loaders and convert() take the
registry as an argument, the way convert() takes calibrate()."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .fuse import WeightLayout
from .gguf_config import GGUFFamily
from .hf_config import HFFamily, HFWrapper


@dataclass(frozen=True)
class ModelSpec:
    """One family: arch is ModelConfig.arch and the model_type of its Hugging Face configs;
    model the nn.Module class that runs it (ridge/models/<family>/, built by ridge/models/loader.py);
    hf_wrappers: other model_types whose checkpoints hold this model (a multimodal one served as text)."""
    arch: str
    model: type
    hf: HFFamily
    gguf: GGUFFamily | None = None  # None: llama.cpp writes no file of its own for it
    weights: WeightLayout = field(default_factory=WeightLayout)
    hf_wrappers: tuple[HFWrapper, ...] = ()


class Registry:
    """The families, by arch; found from a config.json's model_type or a GGUF's architecture."""

    def __init__(self, specs: Iterable[ModelSpec]):
        self.specs: dict[str, ModelSpec] = {}
        for spec in specs:
            assert spec.arch not in self.specs, f"two families register {spec.arch!r}"
            self.specs[spec.arch] = spec

    def __getitem__(self, arch: str) -> ModelSpec:
        if arch not in self.specs:
            raise ValueError(f"unsupported architecture {arch!r}; ridge runs {', '.join(self.specs)}")
        return self.specs[arch]

    def __iter__(self):
        return iter(self.specs.values())

    def hf(self, model_type) -> tuple[ModelSpec, HFWrapper | None] | None:
        """The family reading config.json's model_type, with the wrapper it is read through, or None."""
        if model_type in self.specs:
            return self.specs[model_type], None
        return next(((s, w) for s in self for w in s.hf_wrappers if w.model_type == model_type), None)

    def hf_model_types(self) -> list[str]:
        return [*self.specs, *(w.model_type for s in self for w in s.hf_wrappers)]

    def gguf(self, arch, meta) -> ModelSpec | None:
        """The family reading a GGUF of general.architecture `arch`; meta(key, default): its
        {arch}.* metadata, which tells apart families llama.cpp writes under one architecture."""
        return next((s for s in self if s.gguf is not None and s.gguf.arch == arch
                     and (s.gguf.claims is None or s.gguf.claims(meta))), None)

    def gguf_archs(self) -> list[str]:
        return list(dict.fromkeys(s.gguf.arch for s in self if s.gguf is not None))
