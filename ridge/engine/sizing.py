"""Size the KV pool from memory: free after the weights and a measured
activation peak, minus a reserve. Logs the seed's arithmetic at start."""
from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

import psutil
import torch

from ridge.config import layers_kv_bytes_per_token, sliding_blocks_held

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
    num_blocks: int  # group 0's (the full-attention layers', where the model has any)
    block_size: int
    # Per KV group (ModelConfig.kv_groups()): its blocks and the bytes one token takes in its layers.
    group_blocks: list[int] | None = None
    group_bytes_per_token: list[int] | None = None
    # A hybrid model's state pools (cache/state_cache.py): a slot per request in flight, the same
    # bytes at any context; taken from the budget before the KV pool is sized.
    state_bytes: int = 0
    state_bytes_per_request: int = 0

    def __post_init__(self):
        if self.group_blocks is None:
            self.group_blocks, self.group_bytes_per_token = [self.num_blocks], [self.kv_bytes_per_token]

    @property
    def kv_pool_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.group_blocks, self.group_bytes_per_token)) * self.block_size

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def summary(self, context: int = 4096) -> str:
        groups = "" if len(self.group_blocks) == 1 else " (sliding layers: " + ", ".join(
            f"{n} blocks at {b} B/token" for n, b in zip(self.group_blocks[1:], self.group_bytes_per_token[1:])) + ")"
        states = "" if not self.state_bytes else (
            f"state pool {self.state_bytes / GIB:.3f} GiB = {self.state_bytes // self.state_bytes_per_request} slots "
            f"x {self.state_bytes_per_request} B/request, ")
        return (f"weights {self.weight_bytes / GIB:.2f} GiB, activations {self.activation_bytes / GIB:.2f} GiB, {states}"
                f"KV pool {self.kv_pool_bytes / GIB:.2f} GiB = {self.num_blocks} blocks x {self.block_size} tokens "
                f"at {self.group_bytes_per_token[0]} B/token{groups} = {self.tokens} tokens, "
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


def sliding_pool_cap(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most blocks a sliding group's running requests ever hold together: between steps
    each holds its window's blocks (sliding_blocks_held), and a step adds at most
    cdiv(n, block) + 1 for its n tokens, twice over when the host plans a step ahead."""
    per_step = -(-max_num_batched_tokens // block_size) + max_num_seqs
    return max_num_seqs * sliding_blocks_held(window, block_size) + 2 * per_step


def split_pool(groups, group_bpt: list[int], block_size: int, budget: int, num_blocks: int | None,
               max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Blocks for each KV group, each group over its own pool. A sliding group gets what
    one shared table would give it (the budget over every group's bytes per block), or
    less where its running requests can never hold that many (sliding_pool_cap): past
    that its blocks would only keep prefix-cache windows, and the full group's context is
    worth more. The full-attention group gets the rest. num_blocks (--num-kv-blocks): each group's,
    a sliding group's at most its cap; a model of sliding layers alone gets the whole
    budget (or num_blocks) in its one group."""
    caps = [None if g.window is None else sliding_pool_cap(g.window, block_size, max_num_seqs, max_num_batched_tokens)
            for g in groups]
    has_full = None in caps
    if num_blocks is not None:
        return [num_blocks if cap is None or not has_full else min(num_blocks, cap) for cap in caps]
    per_block = [b * block_size for b in group_bpt]
    even = max(budget, 0) // sum(per_block)
    if not has_full:
        return [even] * len(groups)
    out = [even if cap is None else min(even, cap) for cap in caps]
    left = max(budget, 0) - sum(n * p for n, p, cap in zip(out, per_block, caps) if cap is not None)
    full_bytes = sum(p for p, cap in zip(per_block, caps) if cap is None)
    return [left // full_bytes if cap is None else n for n, cap in zip(out, caps)]


def cache_budget(device: torch.device, activation_bytes: int, *, gpu_reserve_gib: float, cpu_kv_cap_gib: float,
                 kv_memory_gib: float | None) -> int:
    """Bytes the caches (KV pool and a hybrid's state pools) may take: the device's free memory
    less the activations and the reserve (a CPU: at most cpu_kv_cap_gib), at most kv_memory_gib."""
    reserve = reserve_bytes(device, gpu_reserve_gib)
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] - activation_bytes - reserve
    else:
        budget = min(psutil.virtual_memory().available - activation_bytes - reserve, int(cpu_kv_cap_gib * GIB))
    return budget if kv_memory_gib is None else min(budget, int(kv_memory_gib * GIB))


def reserve_bytes(device: torch.device, gpu_reserve_gib: float) -> int:
    """What the caches leave free: on a GPU the desktop's and other processes' share of a consumer
    card, on a CPU a tenth of the memory available."""
    if device.type == "cuda":
        return int(gpu_reserve_gib * GIB)
    return int(0.1 * psutil.virtual_memory().available)


def plan_memory(cfg, kv_dtype: str, block_size: int, device: torch.device, weight_bytes: int,
                activation_bytes: int, *, gpu_reserve_gib: float, cpu_kv_cap_gib: float,
                kv_memory_gib: float | None, num_blocks: int | None,
                max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                extra_bytes_per_token: int = 0, state_bytes: int = 0) -> MemoryPlan:
    """extra_bytes_per_token: a draft model's KV, which lives in group 0's blocks. state_bytes: a
    hybrid model's state pools (max_num_seqs requests' recurrent states), held beside the KV."""
    groups = cfg.kv_groups()
    group_bpt = [layers_kv_bytes_per_token(cfg, kv_dtype, g.layers) for g in groups]
    group_bpt[0] += extra_bytes_per_token
    budget = cache_budget(device, activation_bytes, gpu_reserve_gib=gpu_reserve_gib, cpu_kv_cap_gib=cpu_kv_cap_gib,
                          kv_memory_gib=kv_memory_gib)
    total = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else psutil.virtual_memory().total
    reserve = reserve_bytes(device, gpu_reserve_gib)
    budget -= state_bytes
    counts = split_pool(groups, group_bpt, block_size, budget, num_blocks, max_num_seqs, max_num_batched_tokens)
    if min(counts) < 1:
        why = (f" (the recurrent states of {max_num_seqs} requests take {state_bytes / GIB:.2f} GiB: lower "
               "--max-num-seqs)" if state_bytes else "")
        raise MemoryError(f"only {max(budget, 0) / GIB:.2f} GiB left for the KV cache, not one block{why}; "
                          "lower --max-model-len or the reserve, or free memory")
    blocks = counts[0]
    if groups[0].window is None and blocks * block_size < max_model_len:  # a sliding group never holds a context
        log.warning("the KV pool (%d tokens) cannot hold one request of --max-model-len %d",
                    blocks * block_size, max_model_len)
    plan = MemoryPlan(device.type, total, weight_bytes, activation_bytes, reserve, sum(group_bpt), int(blocks),
                      block_size, [int(n) for n in counts], group_bpt, state_bytes,
                      cfg.state_bytes_per_request() if state_bytes else 0)
    log.info("memory: %s", plan.summary())
    return plan
