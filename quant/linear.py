"""Runtime FP8 linear layer: consumes what quant/fp8.py produced.

On CUDA the weight stays FP8 in memory and runs through the FP8 kernels. On CPU
torch's fp8 -> fp32 cast is far too slow to run every step, so the weight is
upcast once at load; fp8 * scale is exact in fp32, so both devices compute
with the same quantized numbers.

CPU small-batch format: a step of few tokens is bandwidth-bound, and a bf16
GEMV reads half the bytes of an fp32 one, while bf16 GEMMs are slower than
fp32 at large batch on AVX2. So the engine may enable a bf16 copy used for
the step sizes where it is faster, measured per matrix shape at start-up
(engine/cpu_format.py). The copy holds each weight times its channel's scale
rounded to bf16 (8 significant bits around the e4m3 value's 4: a relative
error of at most 2^-9, measured in docs/benchmarks.md), so a product is one op
with no scale to apply; activations and outputs are rounded to bf16, as on a
GPU. The copy is laid out once in oneDNN's
blocked format where torch has oneDNN: a plain bf16 F.linear re-lays the weight
out on every call, a cost that grows with the step's token count; packed, a
verification of k drafts costs about what one token does (docs/benchmarks.md).
A one-row step may instead take a plain bf16 copy through ATen's own GEMV
(gemv_bf16), where that measures faster still.

Fastest where it applies: ridge's own e4m3 product (kernels/csrc/fp8_linear.c),
which streams the FP8 weight itself, one byte a weight, in the layout pack_fp8
makes; chosen per shape and step size by the same measurement."""
from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F
from torch import nn

from ridge.kernels import native, ops
from ridge.kernels.timing import section

FP8 = torch.float8_e4m3fn


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """A bf16 [out, in] weight in oneDNN's blocked layout, or w itself where that is unavailable."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 1)
    except (AttributeError, RuntimeError):  # no oneDNN in this torch build
        return w


_SET_MKLDNN = getattr(torch._C, "_set_mkldnn_enabled", None)  # private: None where a torch lacks it
HAS_GEMV = _SET_MKLDNN is not None


def pack_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """An e4m3 [out, in] weight (w, or w / scale rounded back to e4m3 where w is its upcast
    copy: exact, as fp8 * scale was) as native.fp8_linear's [out/16, in/2, 16, 2] bytes;
    None for a shape the kernel does not take (out % 16, in % 2)."""
    n, k = w.shape
    if n % 16 or k % 2:
        return None
    if w.dtype != FP8:
        w = (w.float() / scale.float()[:, None]).to(FP8)
    return w.view(torch.uint8).view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for one bf16 row and a plain bf16 [out, in] weight, through ATen's own bf16 GEMV
    (fp32 accumulation) rather than oneDNN: with oneDNN switched off for the call, torch takes
    its native path, which streams the weight at close to memory bandwidth where oneDNN's
    one-row kernel does not (docs/benchmarks.md, issue 17). The switch is a global flag read
    at dispatch, restored at once; the engine runs its steps on one thread."""
    if not HAS_GEMV:
        return F.linear(x, w)
    _SET_MKLDNN(False)
    try:
        return F.linear(x, w)
    finally:
        _SET_MKLDNN(True)


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for bf16 x and a weight from pack_bf16."""
    if w.is_mkldnn:
        if x.shape[0] == 2:  # oneDNN's two-row kernel is slower than its three-row one (docs/benchmarks.md)
            return torch.ops.mkldnn._linear_pointwise(torch.cat((x, x[:1])), w, None, "none", [None], "")[:2]
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
    return F.linear(x, w)


class FP8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.register_buffer("weight", torch.empty(0))
        self.register_buffer("weight_scale", None)
        self.register_buffer("bias", None)
        self.cpu_scale: torch.Tensor | None = None  # per-channel scale of an upcast FP8 weight (marks it FP8)
        self.fp8_device = False  # the weight stays FP8 on the device (CUDA), set by load
        self.lowp: torch.Tensor | None = None  # bf16 copy for the CPU step sizes where it is faster
        # Step sizes (ascending bounds) and whether bf16 runs at each: a step of n rows takes the
        # choice of the first bound >= n, the last one's past the end.
        self.lowp_bounds: list[int] = []
        self.lowp_use: list[bool] = []
        self.gemv: torch.Tensor | None = None  # plain bf16 copy for one-row steps, where gemv_bf16 is faster
        # e4m3 bytes for native.fp8_linear (pack_fp8), the scale times 256, the instruction set to
        # run, and the step sizes it runs at (as lowp_bounds / lowp_use).
        self.fp8: torch.Tensor | None = None
        self.fp8_packed: torch.Tensor | None = None  # pack_fp8 of the loaded bytes, until the format is chosen
        self.fp8_scale: torch.Tensor | None = None
        self.fp8_isa = 0
        self.fp8_bounds: list[int] = []
        self.fp8_use: list[bool] = []

    def load(self, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
             device: torch.device, dtype: torch.dtype) -> None:
        assert weight.shape == (self.out_features, self.in_features), (weight.shape, self.out_features, self.in_features)
        assert (bias is not None) == self.has_bias
        self.fp8_device = weight.dtype == FP8 and device.type == "cuda"  # FP8 kept: the FP8 kernels run
        if self.fp8_device:
            self.weight = weight.to(device)
            self.weight_scale = scale.float().to(device)
        elif weight.dtype == FP8:
            self.weight = (weight.float() * scale.float()[:, None]).to(dtype).to(device)
            self.cpu_scale = scale.float().to(device)
            # The e4m3 kernel's layout from the bytes at hand (a permute: recovering them from the
            # upcast copy costs a slow fp32 -> e4m3 cast); kept until the CPU format is chosen.
            self.fp8_packed = pack_fp8(weight, scale)
        else:
            self.weight = weight.to(device=device, dtype=dtype)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8

    def enable_lowp(self, plan: int | list[tuple[int, bool]], packed: torch.Tensor | None = None) -> None:
        """Keep a bf16 copy for the CPU step sizes where it runs: plan is [(size bound, use bf16)]
        ascending, or N for "steps of at most N rows" (0 drops the copy). packed: that copy,
        where the format measurement already made it (pack_bf16 of the weight)."""
        if isinstance(plan, int):
            plan = [(plan, True), (plan + 1, False)] if plan > 0 else []
        if not any(use for _, use in plan) or self.is_fp8:
            self.lowp, self.lowp_bounds, self.lowp_use = None, [], []
            return
        self.lowp = packed if packed is not None else pack_bf16(self.weight.to(torch.bfloat16))
        self.lowp_bounds, self.lowp_use = [b for b, _ in plan], [u for _, u in plan]

    def enable_gemv(self, on: bool, plain: torch.Tensor | None = None) -> None:
        """Keep a plain bf16 copy (plain, where already made) for one-row steps: gemv_bf16."""
        if not on or self.is_fp8:
            self.gemv = None
            return
        self.gemv = plain if plain is not None else self.weight.to(torch.bfloat16)

    def enable_fp8(self, plan: list[tuple[int, bool]], isa: int, packed: torch.Tensor | None = None) -> None:
        """Run the step sizes plan marks through ridge's e4m3 kernel (plan as in enable_lowp; no
        size, or isa 0, drops it). packed: pack_fp8 of the weight, where already made."""
        if packed is None:
            packed = self.fp8_packed if self.fp8_packed is not None else (
                pack_fp8(self.weight, self.cpu_scale) if self.cpu_scale is not None else None)
        self.fp8_packed = None
        if not isa or packed is None or not any(use for _, use in plan):
            self.fp8, self.fp8_scale, self.fp8_isa, self.fp8_bounds, self.fp8_use = None, None, 0, [], []
            return
        self.fp8, self.fp8_scale, self.fp8_isa = packed, (self.cpu_scale * 256).contiguous(), isa
        self.fp8_bounds, self.fp8_use = [b for b, _ in plan], [u for _, u in plan]

    @staticmethod
    def _runs(bounds: list[int], use: list[bool], rows: int) -> bool:
        return bool(use) and use[min(bisect.bisect_left(bounds, rows), len(use) - 1)]

    def uses_lowp(self, rows: int) -> bool:
        return self.lowp is not None and self._runs(self.lowp_bounds, self.lowp_use, rows)

    def uses_fp8(self, rows: int) -> bool:
        return self.fp8 is not None and self._runs(self.fp8_bounds, self.fp8_use, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_device:
            return ops.fp8_linear(x, self.weight, self.weight_scale, self.bias)
        with section("linear"):
            return self._cpu_forward(x)

    def _cpu_forward(self, x: torch.Tensor) -> torch.Tensor:
        # Buffers (weight, bias) are looked up through nn.Module.__getattr__, about a microsecond
        # each: a batch-1 step makes ~120 of these calls, so has_bias guards the bias lookups.
        if self.fp8 is not None and x.dtype == torch.float32 and self.uses_fp8(x.shape[0]):
            y = native.fp8_linear(x, self.fp8, self.fp8_scale, self.fp8_isa)
        elif self.gemv is not None and x.shape[0] == 1:
            y = gemv_bf16(x.to(torch.bfloat16), self.gemv).to(x.dtype)
        elif self.lowp is not None and self.uses_lowp(x.shape[0]):
            y = bf16_linear(x.to(torch.bfloat16), self.lowp).to(x.dtype)
        else:
            return F.linear(x, self.weight, self.bias)
        return y + self.bias if self.has_bias else y
