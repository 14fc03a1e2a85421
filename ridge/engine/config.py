"""The engine's options: one dataclass, one field per option.

A field with a "help" is also a user option, and this declaration is its only
one: ridge/options.py generates from it the flag (--field-name, or the
metadata's "flag"), the RIDGE_* variable and the config-file key of
`ridge serve`, the flags of `ridge generate --local` and `ridge bench`, and the
EngineConfig built from their values. Fields without help are set by code; those
with "per_model" a daemon's [models.NAME] table may set for one model's engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ridge.options import FP8_RECIPE, Option, add_options, fill, options_of
from ridge.plan import WEIGHT_BYTES

if TYPE_CHECKING:  # an annotation only: the options are read by the torch-free daemon registry
    import torch


def _opt(default, help: str, **meta):
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class EngineConfig:
    model: str | None = _opt(None, "GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)",
                             example="/path/to/model.gguf")
    mmproj: str | None = _opt(None, "a GGUF model's image encoder: llama.cpp's projector file, as llama-server's "
                              "--mmproj (an HF directory carries its own)", example="/path/to/mmproj.gguf",
                              per_model=True)
    device: str | None = _opt(None, "cuda or cpu (default: cuda if available)", example="cuda")
    kv_dtype: str | None = _opt(None, "KV cache dtype (default: fp8 on CUDA; on CPU bf16 with ridge's C kernels, "
                                "else fp32; by measurement)",
                                choices=("fp8", "bf16", "fp16", "fp32"), example="fp8", per_model=True)
    block_size: int = _opt(16, "tokens per KV block", per_model=True)
    max_model_len: int | None = _opt(None, "cap the context below the model's own", example=8192, per_model=True)
    max_num_seqs: int = _opt(64, "requests in flight per step", per_model=True)
    prefill_chunk: int | None = _opt(None, "largest prefill chunk per step (default: from the ridge point)",
                                     example=512, per_model=True)  # engine/budget.py
    num_kv_blocks: int | None = _opt(None, "fixed KV pool size instead of sizing from memory", example=4096,
                                     per_model=True)
    kv_memory_gib: float | None = _opt(None, "cap on the KV pool", example=8.0, per_model=True)
    gpu_reserve_gib: float = _opt(1.0, "GPU memory left for the desktop and others")
    cpu_kv_cap_gib: float = 4.0
    enable_prefix_caching: bool = _opt(True, "turn off the prefix cache (KV blocks shared by prompts that "
                                             "start alike)", flag="--no-prefix-caching", per_model=True)
    kv_host_gib: float | None = _opt(None, "host-RAM tier of prefix KV blocks, which the pool evicts to (default: a "
                                           "quarter of the free RAM, at most 8 GiB; 0: off)", example=4.0)
    kv_disk: bool = _opt(True, "turn off the disk tier of prefix KV blocks, which survives restarts",
                         flag="--no-kv-disk")
    kv_disk_gib: float | None = _opt(None, "cap on the disk tier (default: a tenth of the free disk space, at most "
                                           "32 GiB)", example=16.0)
    kv_disk_dir: str | None = _opt(None, "where the disk tier lives (default: $XDG_CACHE_HOME/ridge/kv)",
                                   example="/var/cache/ridge/kv")
    num_threads: int | None = _opt(None, "CPU threads for torch (default: torch's on CPU, 4 on CUDA)", flag="--threads", example=8)
    adaptive_threads: bool = _opt(True, "on CPU keep the thread count fixed, even while other processes hold "
                                        "cores (default: the team shrinks to the cores left free)",
                                  flag="--fixed-threads")
    weights: str = _opt("fp8", "weights in memory: fp8 (e4m3, scaled as --fp8-recipe says; upcast at load on CPU), "
                        "or the source's values unquantized in bf16 (on CPU held in fp32) or fp32",
                        choices=tuple(WEIGHT_BYTES), per_model=True)
    fp8_recipe: str | None = _opt(None, FP8_RECIPE.help + f" (default: {FP8_RECIPE.default})", example="g32")
    ridge_point: float | None = _opt(None, "device FLOPs per byte (default: the plan table on GPU, measured on CPU)",
                                     example=295.0)
    speculative: str = _opt("head", "speculative decoding proposer: head (the checkpoint's own draft head where it "
                                    "has one, else none) | ngram | draft:PATH | self:L | auto | off", per_model=True)
    num_speculative_tokens: int = _opt(8, "most drafts per request per step", per_model=True)
    cuda_graph: bool | None = _opt(None, "replay pure-decode steps as CUDA graphs (auto: on CUDA)")
    async_scheduling: bool | None = _opt(None, "overlap scheduling: schedule step N+1 while step N runs "
                                               "(auto: on CUDA)")
    pooling: str = _opt("auto", "what the model is: an embedding model pooled by its last token's or the mean of "
                                "its tokens' final states, a reranker that judges yes/no with its head (rank: "
                                "Qwen3-Reranker), or none (it generates); auto: as its metadata says "
                                "(sentence-transformers' Pooling module, GGUF's pooling_type), else none",
                        choices=("auto", "last", "mean", "rank", "none"), per_model=True)
    cpu_weight_format: str = _opt("auto", "CPU weights: auto (measured at start-up) | fp32 | bf16:N "
                                          "(bf16 for steps of <= N tokens)", per_model=True)
    cpu_amx: str = _opt("decode", "on a CPU with AMX, which steps run their FP8 products past the streaming sizes "
                                  "on its tile unit, activations rounded to bf16 as the AVX-512 kernel of small steps "
                                  "rounds them (about 2x at 16-64 rows; FP8's KL against fp32 up 0.0001-0.0002): "
                                  "decode (steps that only continue their streams: many streams), all (prompts "
                                  "too), off (those products stay fp32-exact)",
                        choices=("off", "decode", "all"), per_model=True)
    deterministic: bool = _opt(False, "a request's tokens the same whatever its batch mates, prefill chunks and "
                                      "speculation: batch-invariant products and attention, sampling keyed by seed "
                                      "and position (a request's params.deterministic overrides it)")

    def __post_init__(self):
        # Checked here, so that a bad value fails before any model loads.
        if self.weights not in WEIGHT_BYTES:
            raise ValueError(f"--weights {self.weights!r}: choose {', '.join(WEIGHT_BYTES)}")
        self.speculative_config
        if self.fp8_recipe not in (None, "auto", "device"):
            from ridge.quant.recipe import Recipe

            Recipe.parse(self.fp8_recipe)

    @property
    def speculative_config(self):
        from .speculative.config import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative, self.num_speculative_tokens)

    def resolved_kv_dtype(self, device: torch.device) -> str:
        """The option, else the cache dtype kernels run fastest on this device (kernels/ops.py)."""
        if self.kv_dtype:
            return self.kv_dtype
        from ridge.kernels import ops

        return ops.kv_dtype(device)


def engine_options() -> list[Option]:
    return options_of(EngineConfig)


def add_engine_args(p, given_only: bool = False) -> None:
    add_options(p, engine_options(), given_only)


def engine_config(values) -> EngineConfig:
    """The EngineConfig that parsed flags (a namespace) or resolved `ridge serve` values (a dict) describe."""
    return fill(EngineConfig, engine_options(), values)
