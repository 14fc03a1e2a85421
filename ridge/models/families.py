"""Which model runs each architecture (ModelConfig.arch): llama's decoder unless a
family registers its own (a CausalLM subclass with its layers)."""
from __future__ import annotations

from ridge.config import ModelConfig

from .gemma import GemmaCausalLM
from .granite import GraniteCausalLM
from .llama import CausalLM
from .moe import MoeCausalLM
from .olmo2 import Olmo2CausalLM

MODELS: dict[str, type[CausalLM]] = {"olmo2": Olmo2CausalLM, "granite": GraniteCausalLM, "gemma2": GemmaCausalLM,
                                     "gemma3_text": GemmaCausalLM, "qwen3_moe": MoeCausalLM, "mixtral": MoeCausalLM,
                                     "gpt_oss": MoeCausalLM}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    return MODELS.get(cfg.arch, CausalLM)
