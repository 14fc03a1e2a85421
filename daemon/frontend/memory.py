"""What the loaded models hold: the memory budget they share (plan_sharing, from `ridge serve`'s
options), the weights of an unloaded model parked in host RAM for its next load (park, unpark),
and the memory an unloaded engine gives back (release_memory). The daemon's one place that touches
torch: the model manager (models.py) and the registry stay plain data."""
from __future__ import annotations

import gc

from .registry import Registry


def release_memory() -> None:
    """What an unloaded engine held goes back to the system: its tensors once nothing refers to
    them, the CUDA allocator's cached blocks, and glibc's free heap (malloc_trim), which the
    engine's mallopt (cpu_format.keep_freed_memory) would otherwise keep mapped."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def plan_sharing(c: dict, registry: Registry) -> tuple[int | None, int, float | None]:
    """-> (the bytes loaded models may hold together, the host bytes for parked weights, each
    engine's KV budget in GiB). A daemon that knows one model sizes its pool as it always did
    (None); one that knows more splits the KV budget (kv_memory_gib, else what one engine would
    take: cpu_kv_cap_gib on CPU, half the device's free memory less its reserve on CUDA) evenly
    over max_loaded_models, so that a later load never finds the memory taken."""
    import psutil
    import torch

    from ridge.engine.config import EngineConfig

    gib = 1 << 30
    cuda = (c["device"] or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    free_ram = psutil.virtual_memory().available
    reserve = int(c["gpu_reserve_gib"] * gib)
    if c["models_memory_gib"] is not None:
        memory = int(c["models_memory_gib"] * gib)
    elif cuda:
        memory = torch.cuda.mem_get_info()[1] - reserve
    else:
        memory = int(0.75 * free_ram)
    parked = int(c["parked_gib"] * gib) if c["parked_gib"] is not None else free_ram // 4
    if len(registry.entries()) == 1:
        return memory, parked, None
    if c["kv_memory_gib"] is not None:
        budget = c["kv_memory_gib"]
    elif cuda:
        budget = (torch.cuda.mem_get_info()[0] - reserve) / 2 / gib
    else:
        budget = EngineConfig.cpu_kv_cap_gib
    return memory, parked, budget / c["max_loaded_models"]


def _move(model, to) -> None:
    """Every tensor a model holds (parameters, buffers, and tensors kept as plain attributes,
    such as rope tables and CPU-format copies) through `to`."""
    import torch

    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for k, t in table.items():
                if t is not None:
                    moved = to(t.data)
                    table[k] = torch.nn.Parameter(moved, requires_grad=False) \
                        if isinstance(t, torch.nn.Parameter) else moved
        for k, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor):
                setattr(m, k, to(v))


def park(engine):
    """On an engine's thread as it ends: its converted weights, kept for the next load of the
    model. On CPU they are host memory already; a GPU's are copied to pinned host memory."""
    loaded = engine.loaded
    if loaded.device.type == "cuda":
        _move(loaded.model, lambda t: t.to("cpu").pin_memory())
    return loaded


def unpark(loaded, device: str | None):
    """The weights park() kept, back on the device they ran on: a copy, not a conversion. Raises
    if a tensor stayed behind (one held where _move does not look)."""
    if loaded.device.type == "cuda":
        import torch

        _move(loaded.model, lambda t: t.to(loaded.device, non_blocking=True))
        torch.cuda.synchronize(loaded.device)
        left = [t for m in loaded.model.modules()
                for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values())
                if isinstance(t, torch.Tensor) and t.device != loaded.device]
        if left:
            raise RuntimeError(f"{len(left)} tensors of the parked model are not on {loaded.device}")
    return loaded
