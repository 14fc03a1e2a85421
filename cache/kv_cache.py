"""The physical paged KV cache: one K and one V tensor per layer.

Layout (what every attention implementation reads):
  k, v:             [num_blocks, block_size, num_kv_heads, head_dim]
  k_scale, v_scale: [num_blocks, block_size, num_kv_heads] float16, FP8 only

A layer's num_blocks is its KV group's (ModelConfig.kv_groups(): full-attention layers, or
sliding layers of a window, each group over its own pool; cache/manager.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ridge.config import ModelConfig, layers_kv_bytes_per_token

from .state_cache import layer_state

# The same names as ridge.config.KV_DTYPE_BYTES, which counts their bytes without torch.
KV_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


def kv_dtype(name: str) -> torch.dtype:
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; choose one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor. On CPU its pages are zeroed as they are first touched, not now: numpy's
    zeros is calloc, which maps a large pool's pages from the kernel's zero page, so a 4 GiB
    pool costs no start-up time (torch.zeros writes every byte: 1 s at start on a 2-core VM)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


@dataclass
class LayerKV:
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int | list[int], block_size: int, dtype_name: str,
                 device: torch.device | str = "cpu", num_state_slots: int = 1):
        """num_blocks: each KV group's (as cfg.kv_groups() orders them), or one count for all.
        A hybrid model's linear-attention layers get their state pools (cache/state_cache.py) of
        num_state_slots slots in place of KV."""
        groups = cfg.kv_groups()
        self.group_blocks = list(num_blocks) if isinstance(num_blocks, (list, tuple)) else [num_blocks] * len(groups)
        assert len(self.group_blocks) == len(groups), "one block count per KV group"
        self.num_blocks, self.block_size, self.dtype_name = self.group_blocks[0], block_size, dtype_name
        self.num_groups = len(groups)
        dt = kv_dtype(dtype_name)
        fp8 = dt == torch.float8_e4m3fn
        of_layer = {i: n for spec, n in zip(groups, self.group_blocks) for i in spec.layers}
        self.layers = []
        self.state_bytes = 0
        for i in range(cfg.num_layers):
            if cfg.is_linear_layer(i):
                st = layer_state(cfg, num_state_slots, device)
                self.state_bytes += st.nbytes
                self.layers.append(st)
                continue
            if not cfg.holds_kv(i):  # an MLP block without a token mixer: no cache
                self.layers.append(None)
                continue
            shape = (of_layer[i], block_size, *cfg.layer_kv_shape(i))
            scales = [torch.ones(shape[:3], dtype=torch.float16, device=device) for _ in range(2)] if fp8 else [None, None]
            self.layers.append(LayerKV(zeros(shape, dt, device), zeros(shape, dt, device), *scales))
        self.bytes_per_token = layers_kv_bytes_per_token(cfg, dtype_name, [i for g in groups for i in g.layers])
        self._total = sum(layers_kv_bytes_per_token(cfg, dtype_name, spec.layers) * n * block_size
                          for spec, n in zip(groups, self.group_blocks))

    @property
    def total_bytes(self) -> int:
        return self._total + self.state_bytes
