"""Size the KV pool from memory: free after the weights and a measured
activation peak, minus a reserve. Logs the seed's arithmetic at start."""
from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

import psutil
import torch

from ridge.config import kv_bytes_per_token

log = logging.getLogger("ridge.engine")
GIB = 1 << 30


@dataclass
class MemoryPlan:
    device: str
    total_bytes: int  # device memory (or host RAM on CPU)
    weight_bytes: int
    activation_bytes: int  # measured peak of one forward at the step's token budget
    reserve_bytes: int
    kv_bytes_per_token: int
    num_blocks: int
    block_size: int

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def summary(self, context: int = 4096) -> str:
        return (f"weights {self.weight_bytes / GIB:.2f} GiB, activations {self.activation_bytes / GIB:.2f} GiB, "
                f"KV pool {self.kv_pool_bytes / GIB:.2f} GiB = {self.num_blocks} blocks x {self.block_size} tokens "
                f"at {self.kv_bytes_per_token} B/token = {self.tokens} tokens, "
                f"{self.tokens // context} concurrent requests at {context // 1024}K context")


def measure_activation_peak(run_once, device: torch.device) -> int:
    """Peak memory a forward pass adds: CUDA's allocator peak, or on CPU the
    growth of the process's peak RSS (a lower bound once the heap is warm)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run_once()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss = psutil.Process().memory_info().rss
    run_once()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(after - max(before, rss), 0)


def plan_memory(cfg, kv_dtype: str, block_size: int, device: torch.device, weight_bytes: int,
                activation_bytes: int, *, gpu_reserve_gib: float, cpu_kv_cap_gib: float,
                kv_memory_gib: float | None, num_blocks: int | None,
                max_model_len: int, extra_bytes_per_token: int = 0) -> MemoryPlan:
    bpt = kv_bytes_per_token(cfg, kv_dtype) + extra_bytes_per_token
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = int(gpu_reserve_gib * GIB)  # the desktop and other processes on a consumer card
        budget = free - activation_bytes - reserve
    else:
        total = psutil.virtual_memory().total
        reserve = int(0.1 * psutil.virtual_memory().available)
        budget = min(psutil.virtual_memory().available - activation_bytes - reserve, int(cpu_kv_cap_gib * GIB))
    if kv_memory_gib is not None:
        budget = min(budget, int(kv_memory_gib * GIB))
    blocks = num_blocks if num_blocks is not None else max(budget, 0) // (bpt * block_size)
    if blocks < 1:
        raise MemoryError(f"only {max(budget, 0) / GIB:.2f} GiB left for the KV cache, not one block; "
                          "lower --max-model-len or the reserve, or free memory")
    if blocks * block_size < max_model_len:
        log.warning("the KV pool (%d tokens) cannot hold one request of --max-model-len %d",
                    blocks * block_size, max_model_len)
    plan = MemoryPlan(device.type, total, weight_bytes, activation_bytes, reserve, bpt, int(blocks), block_size)
    log.info("memory: %s", plan.summary())
    return plan
