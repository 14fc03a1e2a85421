"""The one place that chooses an implementation, per device and per shape.

The model calls these functions; CUDA tensors go to the Triton kernels where
one exists, everything else to the torch reference beside it, except CPU tensors,
which go to ridge's C kernel where the call fits it (each module's native_fits;
attention_native.fits), else to a rewrite of the reference with fewer passes and
allocations where there is one (chosen by measurement: docs/benchmarks.md), else
to the reference. backend(op, *args) says which runs a call. The modules only offer
their implementations; none chooses between them. A linear layer on CPU (its e4m3
bytes, resident_e4m3, or a weight never quantized) runs the product chosen for its
shape and the step's size (cpu_linear.py, chosen at start-up by cpu_linear_plan.py). Every
backend of an op has the op's signature, the step's AttentionMetadata included
where it has one: a backend keeps its per-step state there, in its own entry
(AttentionMetadata.state_for).
use_triton() overrides the choice: Triton for every tensor (interpreter tests of
a whole model step on CPU) or the references only (the oracle)."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

from . import activation, attention_native, decoder_native, kv_cache, moe, native, norm, rope as rope_impl, sample
from .activation import gelu_and_mul_ref, gelu_tanh_and_mul_ref, silu_and_mul_native, silu_and_mul_ref
from .attention import paged_attention_ref
from .attention_native import paged_attention_native
from .cpu_linear import FP8, CpuLinear, fp8_linear_cpu
from .cpu_linear import resident_e4m3 as cpu_resident_e4m3
from .kv_cache import write_kv_native, write_kv_ref
from .linear import fp8_linear_ref
from .metadata import AttentionMetadata
from .moe import fused_moe_cpu, fused_moe_native, fused_moe_ref
from .norm import rms_norm_native, rms_norm_ref, rms_norm_torch
from .rope import rope_native, rope_ref, rope_torch
from .timing import section
from . import causal_conv, gated_delta, ssd_scan

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


def compute_dtype(device: torch.device) -> torch.dtype:
    """The activations' dtype a model runs in by default. CUDA: bf16 (the Triton kernels and
    tensor cores). CPU: fp32, the dtype ridge's C kernels and the CPU weight formats take (bf16
    products are slower than fp32 at large batch on AVX2, and cpu_linear packs bf16 copies where
    they are measured faster)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def keeps_fp8(device: torch.device) -> bool:
    """Whether an FP8 weight stays FP8 for the device's FP8 kernels (CUDA). On a CPU it stays
    e4m3 for ridge's own products instead (cpu_linear.resident_e4m3, CpuLinear), which choose per
    step size."""
    return device.type == "cuda"


def resident_e4m3(device: torch.device, shape) -> bool:
    """Whether an e4m3 weight of this [out, in] shape stays e4m3 on the device for ridge's CPU
    products (cpu_linear.resident_e4m3); elsewhere on CPU it is upcast once at load."""
    return cpu_resident_e4m3(device, tuple(shape))


def fp8_refusal(weight_scale: torch.Tensor, shape, device: torch.device) -> str | None:
    """Why the device's FP8 kernels cannot take a weight of this scale layout, or None."""
    from .linear import gpu_refusal

    return gpu_refusal(weight_scale, shape, device) if device.type == "cuda" else None


def moe_packs_fp8(device: torch.device, num_experts: int, hidden: int, inter: int) -> bool:
    """Whether a mixture of experts' FP8 experts stay e4m3 on the device for ridge's CPU kernel
    (moe.fused_moe_native, packed at load: CpuExperts.packed_from), instead of keeps_fp8's CPU
    upcast: on CPU where the kernel takes the layer's shapes (moe.native_takes). It runs every
    row count faster than the upcast's per-expert products (docs/benchmarks.md) in a quarter of
    the bytes less the packed copy."""
    return device.type == "cpu" and moe.native_takes(num_experts, hidden, inter)


# -- the CPU choices: each takes its op's arguments and returns the backend that runs them. The
# C kernel where it takes the call (each module's native_fits: the library built, the shapes and
# dtypes it handles); the torch rewrite with fewer passes where there is one; else the reference.
def _rms_norm_cpu(x, weight, eps, residual=None):
    if norm.native_fits(x, weight, residual):
        return rms_norm_native
    return rms_norm_torch if x.dtype == weight.dtype == torch.float32 else rms_norm_ref


def _rope_cpu(q, k, positions, cos_sin, meta=None):
    if rope_impl.native_fits(q, k, positions, cos_sin):
        return rope_native
    return rope_torch if q.dtype == k.dtype == torch.float32 else rope_ref


def _silu_and_mul_cpu(x):
    return silu_and_mul_native if activation.native_fits(x) else silu_and_mul_ref


def _write_kv_cpu(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, meta=None):
    return write_kv_native if kv_cache.native_fits(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping) \
        else write_kv_ref


_CHOICES = {  # op -> (its reference, its CPU choice)
    "rms_norm": (rms_norm_ref, _rms_norm_cpu),
    "rope": (rope_ref, _rope_cpu),
    "silu_and_mul": (silu_and_mul_ref, _silu_and_mul_cpu),
    "gelu_and_mul": (gelu_and_mul_ref, lambda x: gelu_and_mul_ref),
    "gelu_tanh_and_mul": (gelu_tanh_and_mul_ref, lambda x: gelu_tanh_and_mul_ref),
    "write_kv": (write_kv_ref, _write_kv_cpu),
}


def backend(name: str, *args):
    """The implementation that runs op `name` on these arguments (the op's own, in its order):
    CUDA tensors its Triton kernel, CPU tensors what the CPU choice picks for their shapes and
    dtypes; use_triton() overrides both. The hot ops below inline this rule (a batch-1 step makes
    about 150 such calls, and the generic call costs about half a microsecond more)."""
    ref, cpu = _CHOICES[name]
    if _FORCE is None and not args[0].is_cuda:
        return cpu(*args)
    return _pick(name, ref, args[0])


def rms_norm(x, weight, eps, residual=None):
    """-> (normed, x + residual). The CPU path adds the residual into x in place: callers pass
    a layer's fresh output, which nothing else reads."""
    with section("norm"):
        fn = _rms_norm_cpu(x, weight, eps, residual) if _FORCE is None and not x.is_cuda \
            else _pick("rms_norm", rms_norm_ref, x)
        return fn(x, weight, eps, residual)


def rope(q, k, positions, cos_sin, meta: AttentionMetadata | None = None):
    """-> rotated (q, k). The CPU path rotates them in place."""
    with section("rope"):
        fn = _rope_cpu(q, k, positions, cos_sin, meta) if _FORCE is None and not q.is_cuda \
            else _pick("rope", rope_ref, q)
        return fn(q, k, positions, cos_sin, meta)


def silu_and_mul(x):
    with section("act"):
        fn = _silu_and_mul_cpu(x) if _FORCE is None and not x.is_cuda else _pick("silu_and_mul", silu_and_mul_ref, x)
        return fn(x)


def gelu_and_mul(x):
    with section("act"):
        return backend("gelu_and_mul", x)(x)


def gelu_tanh_and_mul(x):
    with section("act"):
        return backend("gelu_tanh_and_mul", x)(x)


def layer_stack(specs, linears) -> decoder_native.NativeStack:
    """A model's layers as one C call may run them (kernels/decoder_native.py): specs() -> their
    LayerSpecs or None (not plain), linears: their product modules. Built once per model."""
    return decoder_native.NativeStack(specs, linears, attention_native.fits)


def decoder_layers(stack, h, positions, meta: AttentionMetadata, kv_caches, count: int):
    """The first `count` decoder layers over h in one C call where the step fits ridge's CPU
    kernels (decoder_native.fits): -> (h, residual), as the per-op loop leaves them; else None,
    and the model runs its layers one op at a time (always on a GPU)."""
    if h.is_cuda or _FORCE is not None or not decoder_native.fits(stack, h, positions, meta, kv_caches, count):
        return None
    with section("layers"):
        return decoder_native.decoder_layers_native(stack, h, positions, meta, kv_caches, count)


def fp8_linear(x, weight, weight_scale, bias=None, cpu: CpuLinear | None = None):
    """x @ (weight * weight_scale).T + bias. An FP8 weight (kept so on a GPU) runs its kernel by
    device; a weight upcast at load (CPU) or never quantized runs in the format its layer's
    CpuLinear chose for this step's size (cpu), or F.linear where it has none."""
    with section("linear"):
        if cpu is not None or weight.dtype != FP8:
            return fp8_linear_cpu(x, weight, bias, cpu)
        return _pick("fp8_linear", fp8_linear_ref, x)(x, weight, weight_scale, bias)


def fused_moe(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, *, b_gate_up=None,
              b_down=None, act="silu", swiglu_alpha=1.702, swiglu_limit=7.0, cpu=None):
    """A mixture-of-experts layer's experts: x [T, H] through the experts topk_ids [T, k] names,
    weighted by topk_weights [T, k] and summed (kernels/moe.py states the contract). CPU tensors
    take the grouped path (one product per active expert, in its CpuExperts' formats: cpu)."""
    with section("moe"):
        fn = _pick("fused_moe", fused_moe_ref, x, _fused_moe_cpu)
        return fn(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, b_gate_up=b_gate_up,
                  b_down=b_down, act=act, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, cpu=cpu)


def _silu_and_mul_any(h):
    return _silu_and_mul_cpu(h)(h)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] int64, each row's first largest value (kernels/sample.py): ridge's C kernel
    on a CPU where it takes x, torch's argmax elsewhere."""
    if not x.is_cuda and _FORCE is None and sample.native_fits(x):
        return sample.argmax_native(x)
    return sample.argmax_ref(x)


def moe_route(h, weight, bias, kind: str, k: int, norm: bool):
    """A mixture of experts' router: h [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32)
    by the family's rule (kernels/moe.py, moe_route_ref): on a CPU ridge's C kernel where it takes
    the call, which the one-call layers run too; else the torch reference."""
    with section("router"):
        if not h.is_cuda and _FORCE is None and native.library() is not None and moe.route_fits(weight, bias, kind, k):
            return moe.moe_route_native(h, weight, bias, kind, k, norm)
        return moe.moe_route_ref(h, weight, bias, kind, k, norm)


def _fused_moe_cpu(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, *, act="silu",
                   cpu=None, **kw):
    """The C kernel over the layer's e4m3 bytes where it takes the call (moe.native_fits: a layer
    loaded packed for it; faster at every row count measured, docs/benchmarks.md); else the
    grouped path, its experts' activation chosen as silu_and_mul's is."""
    args = (x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights)
    if moe.native_fits(x, topk_ids, cpu, act):
        return fused_moe_native(*args, act=act, cpu=cpu, **kw)
    return fused_moe_cpu(*args, act=act, cpu=cpu, act_fn=_silu_and_mul_any if act == "silu" else None, **kw)


FP8_KV_FORMAT = kv_cache.FP8_KV_FORMAT  # what an FP8 cache's bytes hold (the prefix disk tier's key)


def kv_rotation(k_cache: torch.Tensor, head_dim: int, dtype: torch.dtype, device) -> tuple | None:
    """(H, H / D) that the attention layer rotates q, k, v and its output by where k_cache is FP8
    (kernels/kv_cache.py rotation), else None."""
    return kv_cache.rotation(head_dim, dtype, device) if k_cache.dtype == FP8 else None


def write_kv(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, meta: AttentionMetadata | None = None):
    with section("kv_write"):
        args = (key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, meta)
        fn = _write_kv_cpu(*args) if _FORCE is None and not key.is_cuda else _pick("write_kv", write_kv_ref, key)
        return fn(*args)


def _paged_attention_cpu(q, k_cache, v_cache, k_scale, v_scale, meta, softmax_scale, window=None, softcap=None,
                         sinks=None):
    fn = paged_attention_native if attention_native.fits(q, k_cache, v_cache, k_scale, v_scale, meta,
                                                         window=window, softcap=softcap, sinks=sinks) \
        else paged_attention_ref
    return fn(q, k_cache, v_cache, k_scale, v_scale, meta, softmax_scale, window=window, softcap=softcap,
              sinks=sinks)


def paged_attention(q, k_cache, v_cache, k_scale, v_scale, meta: AttentionMetadata, softmax_scale: float,
                    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None):
    """window: a sliding window (a query at p sees keys p - window < j <= p; None: full causal);
    softcap: scaled scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2);
    sinks: [num_heads] fp32, one logit per head in its softmax's denominator with no value
    (gpt-oss). Every backend takes all three and skips the KV blocks wholly behind the window, and
    honours meta.spans (bidirectional image runs: a query in a run also sees its later keys)."""
    with section("attention"):
        return _pick("paged_attention", paged_attention_ref, q, _paged_attention_cpu)(
            q, k_cache, v_cache, k_scale, v_scale, meta, softmax_scale, window=window, softcap=softcap,
            sinks=sinks)


# -- the recurrent layers (issue 41): states in slot pools beside the paged KV (kernels/varlen.py).
# CPU: the C token loop where the call fits, for decode and for prefill alike. The chunked forms
# exist for parallel hardware: per token they cost about twice the recurrence's arithmetic (the
# chunk's products besides the state's), which a GPU's tensor cores repay and two CPU cores do
# not. Measured (`ridge bench recurrent`, AVX2, 2 threads, other jobs on the cores: best of 3), a
# 256-token prefill of one request ran 3-5x faster in the C loop than in the torch chunked form
# (gated delta rule, 32 heads of 128 x 128: 36 against 104 ms; Mamba2, 64 heads of 64 x 128: 22
# against 105 ms), and it was ahead at every size tried (64, 256 and 1,024 tokens). Without the
# library, the torch chunked forms.
def gated_delta_rule_chunk(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state=None, *,
                           scale=None, use_qk_l2norm=False):
    """kernels/gated_delta.py's chunked form (prefill)."""
    with section("recurrent"):
        cpu = _gdn_loop if gated_delta.native_fits(q, k, v, g, beta, state_pool) else None
        fn = _pick("gated_delta_rule_chunk", gated_delta.gated_delta_rule_chunk_ref, q, cpu)
        return fn(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale=scale,
                  use_qk_l2norm=use_qk_l2norm)


def _gdn_loop(*args, scale=None, use_qk_l2norm=False):
    return gated_delta.gated_delta_rule_recurrent_native(*args, scale=scale, use_qk_l2norm=use_qk_l2norm)


def _ssd_loop(*args, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, float("inf"))):
    return ssd_scan.ssd_state_update_native(*args, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)


def gated_delta_rule_recurrent(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state=None, *,
                               scale=None, use_qk_l2norm=False, token_state_slots=None):
    """kernels/gated_delta.py's recurrent form (decode, speculative verification)."""
    with section("recurrent"):
        cpu = gated_delta.gated_delta_rule_recurrent_native \
            if gated_delta.native_fits(q, k, v, g, beta, state_pool) else None
        fn = _pick("gated_delta_rule_recurrent", gated_delta.gated_delta_rule_recurrent_ref, q, cpu)
        return fn(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale=scale,
                  use_qk_l2norm=use_qk_l2norm, token_state_slots=token_state_slots)


def causal_conv1d(x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state=None, *, activation=None,
                  token_state_slots=None):
    """kernels/causal_conv.py's varlen form (prefill chunks, speculative verification, any mix)."""
    with section("recurrent"):
        cpu = causal_conv.causal_conv1d_native if causal_conv.native_fits(x, weight, bias, conv_state) else None
        fn = _pick("causal_conv1d", causal_conv.causal_conv1d_ref, x, cpu)
        return fn(x, weight, bias, conv_state, cu_seqlens, state_slots, has_initial_state, activation=activation,
                  token_state_slots=token_state_slots)


def causal_conv1d_update(x, weight, bias, conv_state, state_slots, *, activation=None):
    """kernels/causal_conv.py's decode form: one token a request."""
    with section("recurrent"):
        cpu = causal_conv.causal_conv1d_update_native if causal_conv.native_fits(x, weight, bias, conv_state) \
            else None
        fn = _pick("causal_conv1d_update", causal_conv.causal_conv1d_update_ref, x, cpu)
        return fn(x, weight, bias, conv_state, state_slots, activation=activation)


def ssd_chunk_scan(x, dt, A, B, C, state_pool, cu_seqlens, state_slots, has_initial_state=None, *, D=None,
                   dt_bias=None, dt_softplus=True, dt_limit=(0.0, float("inf"))):
    """kernels/ssd_scan.py's chunked form (prefill)."""
    with section("recurrent"):
        cpu = _ssd_loop if ssd_scan.native_fits(x, dt, A, B, C, D, dt_bias, state_pool) else None
        fn = _pick("ssd_chunk_scan", ssd_scan.ssd_chunk_scan_ref, x, cpu)
        return fn(x, dt, A, B, C, state_pool, cu_seqlens, state_slots, has_initial_state, D=D, dt_bias=dt_bias,
                  dt_softplus=dt_softplus, dt_limit=dt_limit)


def ssd_state_update(x, dt, A, B, C, state_pool, cu_seqlens, state_slots, has_initial_state=None, *, D=None,
                     dt_bias=None, dt_softplus=True, dt_limit=(0.0, float("inf")), token_state_slots=None):
    """kernels/ssd_scan.py's recurrent form (decode, speculative verification)."""
    with section("recurrent"):
        cpu = ssd_scan.ssd_state_update_native if ssd_scan.native_fits(x, dt, A, B, C, D, dt_bias, state_pool) \
            else None
        fn = _pick("ssd_state_update", ssd_scan.ssd_state_update_ref, x, cpu)
        return fn(x, dt, A, B, C, state_pool, cu_seqlens, state_slots, has_initial_state, D=D, dt_bias=dt_bias,
                  dt_softplus=dt_softplus, dt_limit=dt_limit, token_state_slots=token_state_slots)


if torch.cuda.is_available():
    load_triton()
