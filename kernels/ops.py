"""The one place that chooses an implementation per device.

The model calls these functions; CUDA tensors go to the Triton kernels where
one exists, everything else to the torch reference beside it."""
from __future__ import annotations

import torch

from .activation import silu_and_mul_ref
from .attention import paged_attention_ref
from .kv_cache import write_kv_ref
from .linear import fp8_linear_ref
from .metadata import AttentionMetadata
from .norm import rms_norm_ref
from .rope import rope_ref

_TRITON: dict[str, object] = {}


def register_triton(name: str, fn) -> None:
    """Triton modules register themselves here when they import on a CUDA machine."""
    _TRITON[name] = fn


def _pick(name: str, ref, x: torch.Tensor):
    if x.is_cuda:
        return _TRITON.get(name, ref)
    return ref


def rms_norm(x, weight, eps, residual=None):
    return _pick("rms_norm", rms_norm_ref, x)(x, weight, eps, residual)


def rope(q, k, positions, cos_sin):
    return _pick("rope", rope_ref, q)(q, k, positions, cos_sin)


def silu_and_mul(x):
    return _pick("silu_and_mul", silu_and_mul_ref, x)(x)


def fp8_linear(x, weight, weight_scale, bias=None):
    return _pick("fp8_linear", fp8_linear_ref, x)(x, weight, weight_scale, bias)


def write_kv(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    return _pick("write_kv", write_kv_ref, key)(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)


def paged_attention(q, k_cache, v_cache, k_scale, v_scale, meta: AttentionMetadata, softmax_scale: float):
    return _pick("paged_attention", paged_attention_ref, q)(q, k_cache, v_cache, k_scale, v_scale, meta, softmax_scale)
