"""What every Triton kernel module shares: a guarded `import triton`, the
interpreter/architecture facts the wrappers branch on, and a small tuner whose
choices persist in a JSON file so that start-up does not re-tune.

Rules (machine-facts.md):
  - Without a GPU, kernels only run under TRITON_INTERPRET=1 on CPU tensors.
  - The interpreter cannot autotune over several configs: a CPU launch always
    takes the first candidate.
  - The interpreter computes bf16 dots and in-kernel fp32 -> fp8 casts wrongly,
    so CPU launches dot in fp32 and hand fp8 rounding to torch.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch

try:  # CPU-only machines may lack a working Triton; ops.py then keeps the references.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - any failure means "no Triton"
    triton = tl = None
    HAS_TRITON = False

log = logging.getLogger("ridge.kernels")


def jit(fn):
    """triton.jit, or a stub that fails only when launched (so modules import without Triton)."""
    if HAS_TRITON:
        return triton.jit(fn)

    class _Missing:
        def __getitem__(self, grid):
            raise RuntimeError(f"{fn.__name__}: Triton is not available on this machine")

    return _Missing()


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def interpreting(t: torch.Tensor) -> bool:
    """CPU tensors can only reach a Triton kernel through the interpreter."""
    return t.device.type != "cuda"


def capability(t: torch.Tensor) -> tuple[int, int]:
    """(major, minor) of the tensor's GPU; the interpreter counts as (0, 0)."""
    if interpreting(t):
        return (0, 0)
    return torch.cuda.get_device_capability(t.device)


def native_fp8(t: torch.Tensor) -> bool:
    """Triton converts e4m3 in hardware from sm_89 (Ada) on; the interpreter converts
    fp8 -> fp32 correctly too. Older GPUs decode the bits in software."""
    cc = capability(t)
    return cc == (0, 0) or cc >= (8, 9)


def num_sms(t: torch.Tensor) -> int:
    if interpreting(t):
        return 1
    return torch.cuda.get_device_properties(t.device).multi_processor_count


# ---------------------------------------------------------------------------
# Tuning: candidates per compute capability, choice cached in memory and on disk.

def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ridge" / "triton-configs.json"


class ConfigCache:
    """{key: config} in one JSON file; keys name the kernel, device, Triton version and shape."""

    def __init__(self, path: Path | None = None):
        self.path = path or _cache_path()
        self._data: dict[str, dict] | None = None

    def _load(self) -> dict[str, dict]:
        if self._data is None:
            try:
                self._data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._data = {}
        return self._data

    def all(self) -> dict[str, dict]:
        return dict(self._load())

    def get(self, key: str) -> dict | None:
        return self._load().get(key)

    def put(self, key: str, config: dict) -> None:
        self._load()[key] = config
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._data, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as e:
            log.warning("could not record tuned configs in %s: %s", self.path, e)


CONFIGS = ConfigCache()


def _bench_ms(launch: Callable[[], None]) -> float:
    import triton.testing

    try:
        return float(triton.testing.do_bench(launch, warmup=5, rep=25))
    except Exception as e:  # noqa: BLE001 - a config that does not fit (registers, smem) just loses
        log.debug("config failed to launch: %s", e)
        return float("inf")


def pick_config(kernel: str, key: tuple, candidates: list[dict], t: torch.Tensor,
                launch: Callable[[dict], None]) -> dict:
    """The fastest candidate for this kernel and shape key, measured once per machine.
    CPU (interpreter) or a single candidate: the first. While a CUDA graph is being
    captured nothing can be timed: the recorded choice, else the first."""
    if len(candidates) == 1 or interpreting(t):
        return candidates[0]
    props = torch.cuda.get_device_properties(t.device)
    full = f"{kernel}|{props.name}|sm{props.major}{props.minor}|triton{triton.__version__}|{key}"
    hit = CONFIGS.get(full)
    if hit is not None:
        return hit
    if torch.cuda.is_current_stream_capturing():
        return candidates[0]
    times = [_bench_ms(lambda c=c: launch(c)) for c in candidates]
    if min(times) == float("inf"):
        raise RuntimeError(f"{kernel}: no candidate config launches for {key}")
    best = candidates[min(range(len(times)), key=times.__getitem__)]
    log.info("tuned %s %s -> %s (%.3f ms)", kernel, key, best, min(times))
    CONFIGS.put(full, best)
    return best
