"""The CPU weight formats of an FP8 linear layer, and the product in the one chosen per step size.

On CPU torch's fp8 -> fp32 cast is far too slow to run every step, so a layer's FP8 weight is
upcast once at load (fp8 * scale is exact in fp32). A step of few tokens is bandwidth-bound,
though, so other formats of the same numbers may run faster at some sizes; which one runs at
each size is measured at start-up (kernels/cpu_linear_plan.py), per matrix shape:

- fp32 through MKL, the upcast weight itself;
- a bf16 copy (each weight times its scale rounded to bf16: 8 significant bits around the
  e4m3 value's 4, a relative error of at most 2^-9, docs/benchmarks.md), through ridge's own
  bf16 product where the CPU has AVX-512 BF16 (fp32 result: oneDNN rounds its result to bf16),
  else laid out once in oneDNN's blocked format: a plain bf16 F.linear re-lays the weight out
  on every call, a cost that grows with the step's token count;
- for one-row steps where ridge's bf16 product does not run, a plain bf16 copy through ATen's
  own GEMV (gemv_bf16), which streams the weight at close to memory bandwidth where oneDNN's
  one-row kernel does not;
- ridge's e4m3 product (kernels/csrc/fp8_linear.c), which streams the FP8 weight itself, one
  byte a weight, in the layout pack_fp8 makes.

A layer's CpuLinear holds its weight and the copies its chosen formats read, as one table:
step-size bounds and, for each, the one product that runs there."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import native
from .fp8_scales import expand_scale

FP8 = torch.float8_e4m3fn


def native_bf16() -> bool:
    """Whether ridge's own bf16 product runs here (AVX-512 BF16): it sums in fp32 and returns
    fp32, where oneDNN's and ATen's bf16 products round their results to bf16 (8 bits: a head's
    logits 20 apart by 1/8, so that near ones tie and greedy takes the lower id)."""
    return native.fp8_linear_isa() == 2


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """A bf16 [out, in] weight as the bf16 product reads it: in ridge's kernel's layout
    ([out/16, in/2, 16, 2] words, the e4m3 weights' own) where that kernel runs and takes the
    shape; else in oneDNN's blocked layout; else w itself."""
    n, k = w.shape
    if n % 16 == 0 and k % 2 == 0 and native_bf16():
        return w.view(torch.int16).view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 1)
    except (AttributeError, RuntimeError):  # no oneDNN in this torch build
        return w


_SET_MKLDNN = getattr(torch._C, "_set_mkldnn_enabled", None)  # private: None where a torch lacks it
HAS_GEMV = _SET_MKLDNN is not None


def gemv_offered() -> bool:
    """ATen's bf16 GEMV as a one-row format: where torch lets it be chosen, and not where ridge's
    bf16 product runs (the GEMV's result is rounded to bf16)."""
    return HAS_GEMV and not native_bf16()


def pack_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """An e4m3 [out, in] weight (w, or w / scale rounded back to e4m3 where w is its upcast
    copy: exact, as fp8 * scale was) as native.fp8_linear's [out/16, in/2, 16, 2] bytes;
    None for a shape the kernel does not take (out % 16, in % 2). scale: [out], or
    [groups, out] as native.fp8_linear takes it."""
    n, k = w.shape
    if n % 16 or k % 2:
        return None
    if w.dtype != FP8:
        w = (w.float() / expand_scale(scale.t() if scale.dim() == 2 else scale, (n, k))).to(FP8)
    return w.view(torch.uint8).view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for one bf16 row and a plain bf16 [out, in] weight, through ATen's own bf16 GEMV
    (fp32 accumulation) rather than oneDNN: with oneDNN switched off for the call, torch takes
    its native path (docs/benchmarks.md, issue 17). The switch is a global flag read at
    dispatch, restored at once; the engine runs its steps on one thread."""
    if not HAS_GEMV:
        return F.linear(x, w)
    _SET_MKLDNN(False)
    try:
        return F.linear(x, w)
    finally:
        _SET_MKLDNN(True)


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for a weight from pack_bf16: x bf16 (fp32 for ridge's kernel, which rounds it
    itself), the result bf16 from oneDNN, fp32 from ridge's kernel."""
    if w.dim() == 4:
        return native.bf16_linear(x.float(), w)
    if w.is_mkldnn:
        if x.shape[0] == 2:  # oneDNN's two-row kernel is slower than its three-row one (docs/benchmarks.md)
            return torch.ops.mkldnn._linear_pointwise(torch.cat((x, x[:1])), w, None, "none", [None], "")[:2]
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
    return F.linear(x, w)


@dataclass
class ShapeFormat:
    """The formats one weight shape runs in: packed bf16 by step size (plan: [(size bound, use
    bf16)] ascending; a step of n rows takes the first bound >= n, the last one's past the end),
    else fp32; one-row steps through gemv_bf16 where that beat both; and ridge's e4m3 product at
    the sizes fp8 marks (over all of them)."""
    plan: list[tuple[int, bool]]
    gemv: bool = False
    fp8: list[tuple[int, bool]] | None = None

    @classmethod
    def bf16_up_to(cls, rows: int) -> "ShapeFormat":
        """bf16 for steps of at most `rows` rows, fp32 above (0: fp32 throughout)."""
        return cls([(rows, True), (rows + 1, False)] if rows > 0 else [])


def _runs(plan: list[tuple[int, bool]], rows: int) -> bool:
    if not plan:
        return False
    i = min(bisect.bisect_left([b for b, _ in plan], rows), len(plan) - 1)
    return plan[i][1]


def _kind(fmt: ShapeFormat, fp8: list[tuple[int, bool]], rows: int) -> str:
    """The e4m3 kernel where it runs; else the GEMV for one row; else bf16 or fp32 by the plan."""
    if fp8 and _runs(fp8, rows):
        return "fp8"
    return "gemv" if fmt.gemv and rows == 1 else "bf16" if _runs(fmt.plan, rows) else "fp32"


def _bf16_run(w: torch.Tensor):
    if w.dim() == 4:  # ridge's kernel: fp32 in and out
        return lambda x: bf16_linear(x, w).to(x.dtype)
    return lambda x: bf16_linear(x.to(torch.bfloat16), w).to(x.dtype)


def _gemv_run(w: torch.Tensor):
    return lambda x: gemv_bf16(x.to(torch.bfloat16), w).to(x.dtype)


def _fp8_run(packed: torch.Tensor, scale256: torch.Tensor, isa: int, otherwise):
    def run(x: torch.Tensor):
        if x.dtype != torch.float32:  # the kernel takes fp32 activations only
            return otherwise(x) if otherwise is not None else None
        return native.fp8_linear(x, packed, scale256, isa)
    return run


@dataclass(eq=False)
class CpuLinear:
    """One layer's CPU weight (weight: in the compute dtype, FP8 values times their scales or a
    weight never quantized; scale: the FP8 scales as native.fp8_linear takes them, [N] or
    [groups, N], None for the latter) and its formats.
    runs[i] is the product of the steps whose rows fall in bounds[i] (the first bound >= rows,
    the last one's past the end): x -> x @ W.T without the bias, or None (also the product's
    answer to an input it does not take) for F.linear on the weight itself."""
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    fp8_bytes: torch.Tensor | None = None  # pack_fp8 of the loaded bytes, until the formats are chosen
    bounds: list[int] = field(default_factory=list)
    runs: list = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # "fp8" | "gemv" | "bf16" | "fp32" per bound
    copies: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> the copy its runs read

    def use(self, fmt: ShapeFormat, isa: int = 0, made: dict[str, torch.Tensor] | None = None) -> None:
        """Run the formats fmt marks (isa: the e4m3 kernel's instruction set, 0 for none). made:
        "packed" | "plain" | "fp8" -> the copy the measurement already made of this weight."""
        made = made or {}
        packed8 = made.get("fp8", self.fp8_bytes)
        wants8 = bool(isa) and any(u for _, u in fmt.fp8 or [])
        if packed8 is None and wants8 and self.scale is not None:
            packed8 = pack_fp8(self.weight, self.scale)
        fp8 = fmt.fp8 if wants8 and packed8 is not None else []
        bounds = sorted({b for b, _ in fmt.plan} | {b for b, _ in fp8} | ({1} if fmt.gemv else set()))
        kinds = [_kind(fmt, fp8, b) for b in bounds]
        others = [_kind(fmt, [], b) for b in bounds]  # what runs where the e4m3 kernel refuses an input
        copies: dict[str, torch.Tensor] = {}
        if "bf16" in others:
            w = made.get("packed")
            copies["bf16"] = w if w is not None else pack_bf16(self.weight.to(torch.bfloat16))
        if "gemv" in others:
            w = made.get("plain")
            copies["gemv"] = w if w is not None else self.weight.to(torch.bfloat16)
        products = {"fp32": None, **{k: (_bf16_run if k == "bf16" else _gemv_run)(w) for k, w in copies.items()}}
        if "fp8" in kinds:
            copies["fp8"] = packed8
            scale256 = native.scale_blocks(self.scale * 256)
        runs = [_fp8_run(packed8, scale256, isa, products[other]) if kind == "fp8" else products[other]
                for kind, other in zip(kinds, others)]
        if all(k == "fp32" for k in kinds):
            bounds, runs, kinds = [], [], []
        self.bounds, self.runs, self.kinds, self.copies = bounds, runs, kinds, copies
        self.fp8_bytes = None

    def kind(self, rows: int) -> str:
        """The format a step of `rows` rows runs in."""
        if not self.runs:
            return "fp32"
        return self.kinds[min(bisect.bisect_left(self.bounds, rows), len(self.kinds) - 1)]

    def max_rows(self, kind: str) -> int:
        """The largest step-size bound that runs `kind` (0: none)."""
        return max((b for b, k in zip(self.bounds, self.kinds) if k == kind), default=0)


def fp8_linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   cpu: CpuLinear | None) -> torch.Tensor:
    """x @ weight.T + bias for a weight upcast at load (or never quantized), in the format its
    layer's CpuLinear runs at this step's size; F.linear where it has none."""
    run = cpu.runs[min(bisect.bisect_left(cpu.bounds, x.shape[0]), len(cpu.runs) - 1)] if cpu and cpu.runs else None
    y = run(x) if run is not None else None
    if y is not None:
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)
