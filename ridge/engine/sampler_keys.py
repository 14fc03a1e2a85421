"""The sampler's small shared pieces: host lists on the device, and the keyed generators of
deterministic requests (sampler.py's docstring). Apart from sampler.py so that sampler_chain.py,
which sampler.py calls, can use them without an import cycle."""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for it: pageable copies to a
    GPU synchronize, pinned ones queue."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


_MASK64 = (1 << 64) - 1


def keyed_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): nearby seeds and positions get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = ((z ^ (z >> shift)) * mult) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def keyed_generator(seed: int, position: int, device) -> torch.Generator:
    """The generator of the token at `position` (its index in prompt + output) of a request seeded `seed`."""
    return torch.Generator(device).manual_seed(keyed_seed(seed, position))
