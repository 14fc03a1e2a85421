"""The one place that chooses an implementation per device.

The model calls these functions; CUDA tensors go to the Triton kernels where
one exists, CPU tensors to the CPU path where one exists (a rewrite of the
reference with fewer passes and allocations, chosen by measurement:
docs/benchmarks.md), everything else to the torch reference beside it.
use_triton() overrides the choice: Triton for every tensor (interpreter tests of
a whole model step on CPU) or the references only (the oracle)."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

from .activation import silu_and_mul_cpu, silu_and_mul_ref
from .attention import paged_attention_cpu, paged_attention_ref
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


def rms_norm(x, weight, eps, residual=None):
    """-> (normed, x + residual). The CPU path adds the residual into x in place: callers pass
    a layer's fresh output, which nothing else reads."""
    with section("norm"):
        return _pick("rms_norm", rms_norm_ref, x, rms_norm_cpu)(x, weight, eps, residual)


def rope(q, k, positions, cos_sin, meta: AttentionMetadata | None = None):
    """-> rotated (q, k). The CPU path rotates them in place and looks the step's angles up once
    (kept on `meta`, which every layer shares)."""
    with section("rope"):
        fn = _pick("rope", rope_ref, q, rope_cpu)
        if fn is rope_cpu:
            return rope_cpu(q, k, positions, cos_sin, meta)
        return fn(q, k, positions, cos_sin)


def silu_and_mul(x):
    with section("act"):
        return _pick("silu_and_mul", silu_and_mul_ref, x, silu_and_mul_cpu)(x)


def fp8_linear(x, weight, weight_scale, bias=None):
    with section("linear"):
        return _pick("fp8_linear", fp8_linear_ref, x)(x, weight, weight_scale, bias)


def write_kv(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, meta: AttentionMetadata | None = None):
    """The CPU path asks once a step (kept on `meta`) whether any slot is padding."""
    with section("kv_write"):
        fn = _pick("write_kv", write_kv_ref, key, write_kv_cpu)
        if fn is write_kv_cpu:
            return write_kv_cpu(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, meta)
        return fn(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)


def paged_attention(q, k_cache, v_cache, k_scale, v_scale, meta: AttentionMetadata, softmax_scale: float):
    with section("attention"):
        return _pick("paged_attention", paged_attention_ref, q, paged_attention_cpu)(
            q, k_cache, v_cache, k_scale, v_scale, meta, softmax_scale)


if torch.cuda.is_available():
    load_triton()
