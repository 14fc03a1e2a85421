"""The engine's options: one dataclass, one field per option."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    model: str | None = None  # path; None = the embedded default model
    device: str | None = None  # None = cuda if available, else cpu
    kv_dtype: str | None = None  # fp8 | bf16 | fp16 | fp32; None = fp8 on CUDA, the measured CPU default on CPU
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    prefill_chunk: int | None = None  # None = from the ridge point (engine/budget.py)
    num_kv_blocks: int | None = None  # fixed pool size instead of sizing from memory
    kv_memory_gib: float | None = None  # cap on the KV pool
    gpu_reserve_gib: float = 1.0
    cpu_kv_cap_gib: float = 4.0
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch CPU threads; None = torch's default on CPU, 4 on CUDA
    quantize: bool = True
    ridge_point: float | None = None  # FLOPs per byte; None = plan table (GPU) or measured (CPU)
    speculative: str = "off"  # ngram | draft:PATH | self:L | auto | off
    num_speculative_tokens: int = 8  # the most drafts per request per step
    cuda_graph: bool | None = None  # replay steps as CUDA graphs; None = on CUDA
    async_scheduling: bool | None = None  # overlap: schedule step N+1 while step N runs; None = on CUDA
    cpu_weight_format: str = "auto"  # auto (measured) | fp32 | bf16:N (bf16 for steps of <= N tokens)

    def __post_init__(self):
        self.speculative_config  # parsed here, so that a bad value fails before any model loads

    @property
    def speculative_config(self):
        from .spec.config import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative, self.num_speculative_tokens)

    def resolved_kv_dtype(self, device: torch.device) -> str:
        # CPU default, measured: reading an FP8 cache through torch costs a slow
        # fp8 -> fp32 cast every step (docs/benchmarks.md), so CPU serves fp32 KV.
        return self.kv_dtype or ("fp8" if device.type == "cuda" else "fp32")
