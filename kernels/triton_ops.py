"""Registers every Triton kernel with ops.py. Imported by ops.py on CUDA machines
(and by ops.use_triton() for interpreter tests); raises ImportError when Triton
itself is unusable, so that ops.py keeps the torch references."""
from __future__ import annotations

from . import ops
from .triton_utils import HAS_TRITON

if not HAS_TRITON:
    raise ImportError("triton is not importable on this machine")

from .activation import gelu_and_mul_triton, gelu_tanh_and_mul_triton, silu_and_mul_triton  # noqa: E402
from .attention import paged_attention_triton  # noqa: E402
from .kv_cache import write_kv_triton  # noqa: E402
from .linear import fp8_linear_triton  # noqa: E402
from .moe_triton import fused_moe_triton  # noqa: E402
from .norm import rms_norm_triton  # noqa: E402
from .rope import rope_triton  # noqa: E402
from .causal_conv import causal_conv1d_triton, causal_conv1d_update_triton  # noqa: E402
from .gated_delta import gated_delta_rule_chunk_triton, gated_delta_rule_recurrent_triton  # noqa: E402
from .ssd_scan import ssd_chunk_scan_triton, ssd_state_update_triton  # noqa: E402

KERNELS = {
    "rms_norm": rms_norm_triton,
    "rope": rope_triton,
    "silu_and_mul": silu_and_mul_triton,
    "gelu_and_mul": gelu_and_mul_triton,
    "gelu_tanh_and_mul": gelu_tanh_and_mul_triton,
    "fp8_linear": fp8_linear_triton,
    "write_kv": write_kv_triton,
    "paged_attention": paged_attention_triton,
    "fused_moe": fused_moe_triton,
    "gated_delta_rule_chunk": gated_delta_rule_chunk_triton,
    "gated_delta_rule_recurrent": gated_delta_rule_recurrent_triton,
    "causal_conv1d": causal_conv1d_triton,
    "causal_conv1d_update": causal_conv1d_update_triton,
    "ssd_chunk_scan": ssd_chunk_scan_triton,
    "ssd_state_update": ssd_state_update_triton,
}

for _name, _fn in KERNELS.items():
    ops.register_triton(_name, _fn)
