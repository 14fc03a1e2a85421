"""Whole-prompt logits for one sequence, through the same paged path the engine uses.
For accuracy measurements and tests, where no scheduler is wanted."""
from __future__ import annotations

import math

import torch

from ridge.cache.kv_cache import KVCache
from ridge.kernels.metadata import AttentionMetadata


@torch.inference_mode()
def prompt_logits(model, token_ids: list[int], kv_dtype: str = "fp32", block_size: int = 16) -> torch.Tensor:
    """-> [T, vocab] float32 logits at every position."""
    n = len(token_ids)
    nb = math.ceil(n / block_size)
    device = model.cos_sin.device
    cache = KVCache(model.cfg, nb, block_size, kv_dtype, device)
    meta = AttentionMetadata.build([n], [n], [list(range(nb))], list(range(n)), device)
    ids = torch.tensor(token_ids, device=device)
    hidden = model(ids, torch.arange(n, device=device), meta, cache.layers)
    return model.compute_logits(hidden)
