"""The one place that chooses an implementation per device.

The model calls these functions; CUDA tensors go to the Triton kernels where
one exists, CPU tensors to the CPU path where one exists (ridge's C kernels, or a
rewrite of the reference with fewer passes and allocations, chosen by
measurement: docs/benchmarks.md), everything else to the torch reference beside
it. Paged attention on CPU takes the C kernel where the step's shapes fit it
(attention_native.fits). A linear layer whose weight was upcast at load runs in
the CPU format chosen for its shape and the step's size (cpu_linear.py, chosen at
start-up by cpu_linear_plan.py). Every backend of an op has the op's signature,
the step's AttentionMetadata included where it has one: a backend keeps its
per-step state there, in its own entry (AttentionMetadata.state_for).
use_triton() overrides the choice: Triton for every tensor (interpreter tests of
a whole model step on CPU) or the references only (the oracle)."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

from . import attention_native, native
from .activation import silu_and_mul_cpu, silu_and_mul_ref
from .attention import paged_attention_ref
from .attention_native import paged_attention_native
from .cpu_linear import FP8, CpuLinear, fp8_linear_cpu
from .kv_cache import write_kv_cpu, write_kv_ref
from .linear import fp8_linear_ref
from .metadata import AttentionMetadata
from .norm import rms_norm_cpu, rms_norm_ref
from .rope import rope_cpu, rope_ref
from .timing import section

_TRITON: dict[str, object] = {}
_FORCE: bool | None = None  # None: by device; True: Triton for every tensor; False: references only
_LOADED = False
log = logging.getLogger("ridge.kernels")


def register_triton(name: str, fn) -> None:
    """Triton modules register themselves here when they import on a CUDA machine."""
    _TRITON[name] = fn


def load_triton() -> bool:
    """Import (once) the Triton kernels; False where Triton is unusable."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        try:
            from . import triton_ops  # noqa: F401  (registers on import)
        except Exception as e:  # noqa: BLE001 - a broken Triton must not break the CPU path
            log.warning("Triton kernels unavailable, using torch references: %s", e)
    return bool(_TRITON)


@contextmanager
def use_triton(enabled: bool = True):
    """Within the block, every op runs its Triton kernel (enabled=True; CPU tensors go
    through the interpreter, so TRITON_INTERPRET=1 must be set before triton is first
    imported) or its torch reference (enabled=False), whatever the device."""
    global _FORCE
    if enabled and not load_triton():
        raise RuntimeError("use_triton(): Triton kernels are unavailable on this machine")
    if enabled and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("use_triton() without a GPU needs TRITON_INTERPRET=1 set before triton is imported")
    previous, _FORCE = _FORCE, enabled
    try:
        yield
    finally:
        _FORCE = previous


def _pick(name: str, ref, x: torch.Tensor, cpu=None):
    if _FORCE is None and not x.is_cuda:
        return cpu or ref
    use = x.is_cuda if _FORCE is None else _FORCE
    return _TRITON.get(name, ref) if use else ref


def kv_dtype(device: torch.device) -> str:
    """The KV cache dtype whose kernels run fastest on the device. CUDA: fp8. CPU, measured
    (`ridge bench kv`, docs/benchmarks.md): with ridge's C kernels bf16 at every batch (attention
    reads half of fp32's bytes; widening bf16 is a shift); without them torch's attention
    gathers and casts, so fp32. FP8 on CPU costs a per-element decode and a torch-side quantized
    write, slower at every batch."""
    if device.type == "cuda":
        return "fp8"
    return "bf16" if native.library() is not None else "fp32"


def rms_norm(x, weight, eps, residual=None):
    """-> (normed, x + residual). The CPU path adds the residual into x in place: callers pass
    a layer's fresh output, which nothing else reads."""
    with section("norm"):
        return _pick("rms_norm", rms_norm_ref, x, rms_norm_cpu)(x, weight, eps, residual)


def rope(q, k, positions, cos_sin, meta: AttentionMetadata | None = None):
    """-> rotated (q, k). The CPU path rotates them in place."""
    with section("rope"):
        return _pick("rope", rope_ref, q, rope_cpu)(q, k, positions, cos_sin, meta)


def silu_and_mul(x):
    with section("act"):
        return _pick("silu_and_mul", silu_and_mul_ref, x, silu_and_mul_cpu)(x)


def fp8_linear(x, weight, weight_scale, bias=None, cpu: CpuLinear | None = None):
    """x @ (weight * weight_scale).T + bias. An FP8 weight (kept so on a GPU) runs its kernel by
    device; a weight upcast at load (CPU) or never quantized runs in the format its layer's
    CpuLinear chose for this step's size (cpu), or F.linear where it has none."""
    with section("linear"):
        if weight.dtype != FP8:
            return fp8_linear_cpu(x, weight, bias, cpu)
        return _pick("fp8_linear", fp8_linear_ref, x)(x, weight, weight_scale, bias)


def write_kv(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, meta: AttentionMetadata | None = None):
    with section("kv_write"):
        return _pick("write_kv", write_kv_ref, key, write_kv_cpu)(
            key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, meta)


def _paged_attention_cpu(q, k_cache, v_cache, k_scale, v_scale, meta, softmax_scale, window=None, softcap=None):
    fn = paged_attention_native if attention_native.fits(q, k_cache, v_cache, k_scale, v_scale, meta,
                                                         window=window, softcap=softcap) \
        else paged_attention_ref
    return fn(q, k_cache, v_cache, k_scale, v_scale, meta, softmax_scale, window=window, softcap=softcap)


def paged_attention(q, k_cache, v_cache, k_scale, v_scale, meta: AttentionMetadata, softmax_scale: float,
                    window: int | None = None, softcap: float | None = None):
    """window: a sliding window (a query at p sees keys p - window < j <= p; None: full causal);
    softcap: scaled scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2).
    Every backend takes both and skips the KV blocks wholly behind the window."""
    with section("attention"):
        return _pick("paged_attention", paged_attention_ref, q, _paged_attention_cpu)(
            q, k_cache, v_cache, k_scale, v_scale, meta, softmax_scale, window=window, softcap=softcap)


if torch.cuda.is_available():
    load_triton()
