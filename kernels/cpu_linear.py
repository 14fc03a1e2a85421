"""The CPU products of a linear layer, and the one that runs at each step size.

An FP8 weight stays e4m3 on a CPU (resident_e4m3): one byte a weight plus its scales, in the
layout pack_fp8 makes ([N/16, K/2, 16, 2], 16 output columns by pairs of k), read by ridge's
two e4m3 products (kernels/csrc/fp8_linear.c), each exact against the torch upcast it replaces
up to summation order:
- the streaming kernel (native.fp8_linear), which converts the bytes as it reads them: what a
  step of few rows, bound by the bytes it reads, wants;
- the blocked product (native.fp8_linear_tiles), which widens a tile of rows to fp32 once into
  a per-thread buffer that stays in cache and multiplies it with torch's own BLAS sgemm: a large
  step runs at fp32 GEMM speed while only the e4m3 bytes stay resident.
Which one runs at each size is measured at start-up per matrix shape (kernels/cpu_linear_plan.py).
No fp32 or bf16 copy of an e4m3 weight is made.

The same layout and products hold int8 codes in 1 x 32 groups (code "i8": llama.cpp's Q8_0
grid): the embedding table and head of an FP8 model whose recipe keeps them out of e4m3
(quant/embedding.py), one byte a weight as the layers are.

A weight never quantized (--weights fp32 / bf16, a recipe's bf16 exceptions), or an e4m3 one
where neither product runs (no C compiler: upcast once at load, fp8 * scale being exact in
fp32), keeps the formats of old: fp32 through MKL, or a bf16 copy (ridge's own bf16 product where
the CPU has AVX-512 BF16, else oneDNN's blocked layout) and ATen's bf16 GEMV for one row, where
measured faster (docs/benchmarks.md).

A layer's CpuLinear holds its weight and the copies its chosen formats read, as one table:
step-size bounds and, for each, the one product that runs there.

On a CPU with AMX the blocked product may run on the tile unit, the activations rounded to bf16
(CpuLinear.bf16_tiles, --cpu-amx): "decode" (the default) where the step has no prompt rows,
only sampled tokens and drafts (decode_step, set by the model runner), as the AVX-512 streaming
kernel of small steps already rounds them; "all" on every step; "off" never. A prompt's rows
stay fp32 by default: they are what the families' exactness against transformers measures, and
the KV cache every later token reads is written from them."""
from __future__ import annotations

import bisect
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import native
from .fp8_scales import column_groups, dequantize, scale_block

FP8 = torch.float8_e4m3fn
AMX_MODES = ("off", "decode", "all")  # where CpuLinear.bf16_tiles lets the blocked product run bf16 tiles
# Whether the step running now only continues sequences (decode_step): per thread, as each
# model's engine steps in its own.
_DECODE: ContextVar[bool] = ContextVar("ridge_decode_step", default=False)


@contextmanager
def decode_step(on: bool = True):
    """Within: the step's every row lies past its sequence's prompt (sampled tokens and drafts to
    verify, no prompt rows), so the layers whose bf16_tiles is "decode" run AMX tiles."""
    token = _DECODE.set(on)
    try:
        yield
    finally:
        _DECODE.reset(token)


def in_decode_step() -> bool:
    return _DECODE.get()


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


def resident_e4m3(device: torch.device, shape: tuple[int, int]) -> bool:
    """Whether an e4m3 weight of this [out, in] shape stays e4m3 on the device for ridge's CPU
    products: a CPU where they are built (native.fp8_linear_isa) and an even K (the layout's k
    pairs). Elsewhere on CPU it is upcast once at load (CpuLinear.upcast)."""
    return device.type == "cpu" and shape[1] % 2 == 0 and native.fp8_linear_isa() > 0


def pack_fp8(w: torch.Tensor) -> torch.Tensor:
    """An e4m3 [out, in] weight (in even) as the e4m3 products' [ceil(out/16), in/2, 16, 2] bytes;
    rows past out (to a whole block of 16) are zeros, their outputs cut off."""
    n, k = w.shape
    assert w.dtype == FP8 and k % 2 == 0, (w.dtype, w.shape)
    w = w.view(torch.uint8)
    if n % 16:
        w = torch.cat((w, w.new_zeros(16 - n % 16, k)))
    # A k pair moves as one 16-bit word: torch's strided copy then moves half as many elements
    # (about 3x faster than permuting the bytes; this copy is most of a cached start's load).
    pairs = w.contiguous().view(torch.int16).view(-1, 16, k // 2).transpose(1, 2).contiguous()
    return pairs.view(torch.uint8).view(-1, k // 2, 16, 2)


def kernel_scales(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A weight's stored scales (kernels/fp8_scales.py layouts) as the e4m3 products read them,
    times 256 (exact): one fp32 a row ([N padded to 16]) per channel; else per row and group
    along K, by block of 16 rows ([N/16, groups, 16]), in the stored dtype (bf16 for groups:
    2 bytes per G weights, where fp32 would be 4)."""
    n = shape[0]
    pad = -n % 16
    if scale.dim() == 2 and scale_block(scale, shape)[0] == 1 and scale.shape[1] > 1:
        # 1 x G groups, [N, G] as stored: one pass into [N/16, G, 16] (times 256 is exact in bf16)
        s = torch.cat((scale, scale.new_zeros(pad, scale.shape[1]))) if pad else scale
        s = s.view(-1, 16, s.shape[1]).transpose(1, 2)
        return torch.mul(s, 256, out=torch.empty(s.shape, dtype=scale.dtype))
    groups, _ = column_groups(scale, shape)
    s = groups.to(scale.dtype if scale.dim() == 2 else torch.float32) * 256
    if pad:
        s = torch.cat((s, s.new_zeros(s.shape[0], pad)), 1)
    return s[0].contiguous() if s.shape[0] == 1 else native.scale_blocks(s)


Q8_GROUP = 32  # int8 codes per scale: llama.cpp's Q8_0 block


def quantize_q8(w: torch.Tensor, gk: int = Q8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of native.q8_pack, its oracle: [N, K] -> (int8 codes [N, K], bf16 scales
    [N, ceil(K/gk)]). A group's scale is amax / 127 rounded up to bf16, so that no code passes
    127; a code is x / scale rounded to nearest, ties to even (an all-zero group: scale 0)."""
    n, k = w.shape
    groups = -(-k // gk)
    x = torch.nn.functional.pad(w.float(), (0, groups * gk - k)).view(n, groups, gk)
    bits = (x.abs().amax(-1) / 127).view(torch.int32)
    s = ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s[..., None] > 0, (x / safe[..., None]).round().clamp(-127, 127), torch.zeros_like(x))
    return q.view(n, groups * gk)[:, :k].to(torch.int8), s.to(torch.bfloat16)


def pack_q8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_q8's codes and scales in the products' layouts (as native.q8_pack writes them)."""
    n = codes.shape[0]
    nb = -(-n // 16)
    packed = pack_fp8(codes.view(FP8))  # the layout takes any byte; rows past n are zeros
    s = torch.cat((scales, scales.new_zeros(nb * 16 - n, scales.shape[1])))
    return packed, s.view(nb, 16, -1).transpose(1, 2).contiguous()


def unpack_fp8(packed: torch.Tensor, scale256: torch.Tensor, n: int, code: str = "e4m3") -> torch.Tensor:
    """The torch reference of the e4m3 products' weight: pack_fp8's bytes times kernel_scales'
    scales -> [n, K] fp32, e4m3 * scale rounded once (the oracle, and the product where the C
    kernels are off). code "i8": int8 codes times their scales as they are."""
    nb, kp = packed.shape[:2]
    w = packed.permute(0, 2, 1, 3).reshape(nb * 16, 2 * kp)[:n].view(torch.int8 if code == "i8" else FP8).float()
    s = scale256.float() / (1 if code == "i8" else 256)
    if s.dim() == 1:
        return w * s[:n, None]
    g = s.shape[1]
    gk = 1 << (-(-2 * kp // g) - 1).bit_length()
    return w * s.permute(0, 2, 1).reshape(nb * 16, g)[:n].repeat_interleave(gk, 1)[:, : 2 * kp]


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
    """The formats one weight shape runs in. An e4m3 weight: ridge's streaming kernel at the sizes
    fp8 marks (size bounds ascending, as plan's), the blocked product at the others (fp8 None:
    at every size). A weight in the compute dtype: packed bf16 by step size (plan: [(size bound,
    use bf16)] ascending; a step of n rows takes the first bound >= n, the last one's past the
    end), else fp32; one-row steps through gemv_bf16 where that beat both."""
    plan: list[tuple[int, bool]]
    gemv: bool = False
    fp8: list[tuple[int, bool]] | None = None

    @classmethod
    def bf16_up_to(cls, rows: int) -> "ShapeFormat":
        """bf16 for steps of at most `rows` rows, fp32 above (0: fp32 throughout); for an e4m3
        weight, the streaming kernel up to `rows`, the blocked product above."""
        plan = [(rows, True), (rows + 1, False)] if rows > 0 else []
        return cls(plan, fp8=plan or None)


def _runs(plan: list[tuple[int, bool]], rows: int) -> bool:
    if not plan:
        return False
    i = min(bisect.bisect_left([b for b, _ in plan], rows), len(plan) - 1)
    return plan[i][1]


def _kind(fmt: ShapeFormat, rows: int) -> str:
    """A weight in the compute dtype: the GEMV for one row where chosen; else bf16 or fp32 by the plan."""
    return "gemv" if fmt.gemv and rows == 1 else "bf16" if _runs(fmt.plan, rows) else "fp32"


def _bf16_run(w: torch.Tensor):
    if w.dim() == 4:  # ridge's kernel: fp32 in and out
        return lambda x: bf16_linear(x, w).to(x.dtype)
    return lambda x: bf16_linear(x.to(torch.bfloat16), w).to(x.dtype)


def _gemv_run(w: torch.Tensor):
    return lambda x: gemv_bf16(x.to(torch.bfloat16), w).to(x.dtype)


def tiles_offered() -> bool:
    """Whether the blocked product runs here: ridge's kernels built and torch's BLAS exporting sgemm."""
    return native.fp8_linear_isa() > 0 and native.sgemm() is not None


@dataclass(eq=False)
class CpuLinear:
    """One layer's CPU weight and its products. e4m3 (packed set): pack_fp8's bytes, their scales
    as kernel_scales makes them, shape the weight's [N, K]; weight None. Else weight, in the
    compute dtype (never quantized, or e4m3 upcast where the e4m3 products do not run).
    runs[i] is the product of the steps whose rows fall in bounds[i] (the first bound >= rows,
    the last one's past the end): x -> x @ W.T without the bias, or None (also the product's
    answer to an input it does not take) for the layer's default product (__call__)."""
    weight: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    shape: tuple[int, int] = (0, 0)
    bounds: list[int] = field(default_factory=list)
    runs: list = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # "fp8" | "tiles" | "gemv" | "bf16" | "fp32" per bound
    copies: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> the copy its runs read (bf16, gemv)
    code: str = "e4m3"  # what packed's bytes are: e4m3, or "i8" (int8 codes, scales not times 256)
    isa: int = 0  # the streaming kernel's instruction set (native.fp8_linear_isa) where its runs use it
    bf16_tiles: str = "off"  # AMX_MODES: where the blocked product runs on AMX (x rounded to bf16), if tiles_bf16()
    # e4m3: the k pairs holding a subnormal or NaN code (native.special_map), made with the
    # packing; the AVX-512 streaming product converts the others by shifts
    special: torch.Tensor | None = None

    def __post_init__(self):
        if self.weight is not None:
            self.shape = tuple(self.weight.shape)
        if self.packed is not None and self.code == "e4m3" and self.special is None:
            self.special = native.special_map(self.packed)

    @classmethod
    def from_fp8(cls, w: torch.Tensor, scale: torch.Tensor) -> "CpuLinear":
        """An e4m3 weight and its stored scales, as the e4m3 products hold them (resident_e4m3)."""
        return cls(packed=pack_fp8(w), scale=kernel_scales(scale, tuple(w.shape)), shape=tuple(w.shape))

    @classmethod
    def from_q8(cls, w: torch.Tensor) -> "CpuLinear":
        """A wide [N, K] weight (fp32 or bf16, K even) as int8 codes in 1 x 32 groups, quantized
        and packed in one pass (native.q8_pack; quantize_q8 + pack_q8 where the C kernels are off)."""
        if w.dtype not in (torch.float32, torch.bfloat16) or w.stride(-1) != 1:
            w = w.float().contiguous()
        packed, scale = native.q8_pack(w, Q8_GROUP) if native.library() is not None else pack_q8(*quantize_q8(w))
        return cls(packed=packed, scale=scale, shape=tuple(w.shape), code="i8")

    @classmethod
    def upcast(cls, w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> "CpuLinear":
        """An e4m3 weight where its products do not run: upcast once (exact in fp32)."""
        return cls(dequantize(w, scale, dtype))

    @property
    def is_packed(self) -> bool:
        """8-bit bytes in the products' layout: e4m3, or int8 codes (code)."""
        return self.packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T in the product chosen for x's row count, else the default: the blocked product
        for an e4m3 weight (the torch reference where ridge's kernels are off), F.linear otherwise."""
        run = self.runs[min(bisect.bisect_left(self.bounds, x.shape[0]), len(self.runs) - 1)] if self.runs else None
        y = run(x) if run is not None else None
        if y is not None:
            return y
        if self.packed is None:
            return F.linear(x, self.weight)
        if native.library() is None or not tiles_offered():
            return self.reference(x)
        return self._tiles(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch oracle of an e4m3 weight's products, for x's row count: the streaming kernel
        on AVX-512 BF16 and the blocked product on AMX round the activations to bf16
        (fp8_linear.c), the other products read them in fp32; each multiplies the exact weights."""
        xf, w = x.float(), unpack_fp8(self.packed, self.scale, self.shape[0], self.code)
        kind = self.kind(x.shape[0])
        if (self.isa == 2 and kind == "fp8") or (kind == "tiles" and self.tiles_in_bf16()):
            xf = xf.bfloat16().float()
        return F.linear(xf, w).to(x.dtype)

    def tiles_in_bf16(self) -> bool:
        """Whether this weight's blocked product runs bf16 tiles now (native.fp8_linear_tiles): on
        AMX, in every step ("all") or in a decode step ("decode")."""
        mode = self.bf16_tiles
        return (mode == "all" or (mode == "decode" and _DECODE.get())) and native.tiles_bf16()

    def _cut(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = y if y.shape[1] == self.shape[0] else y[:, : self.shape[0]]
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _stream(self, x: torch.Tensor, isa: int) -> torch.Tensor | None:
        if native.library() is None:
            return None
        return self._cut(native.fp8_linear(x.float(), self.packed, self.scale, isa, self.code == "i8", self.special), x)

    def _streamer(self, isa: int):
        """The streaming product bound to this weight (native.fp8_linear_call): a one-row step
        makes about 120 of these calls, so the checks are made once. A weight replaced since
        (packed rebound) takes the checked path."""
        packed, n = self.packed, self.shape[0]
        call = native.fp8_linear_call(packed, self.scale, isa, self.code == "i8", self.special)

        def run(x: torch.Tensor) -> torch.Tensor | None:
            y = call(x) if self.packed is packed else None
            if y is None:
                return self._stream(x, isa)
            return y if y.shape[1] == n else y[:, :n]
        return run

    def _tiles(self, x: torch.Tensor) -> torch.Tensor | None:
        if native.library() is None:
            return None
        return self._cut(native.fp8_linear_tiles(x.float(), self.packed, self.scale, i8=self.code == "i8",
                                                 bf16=self.tiles_in_bf16()), x)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of a packed weight times their scales, [*ids.shape, K] fp32: an embedding
        lookup that widens only the gathered rows."""
        i8 = self.code == "i8"
        if native.library() is None:
            nb = ids.reshape(-1)
            w = self.packed[nb // 16, :, nb % 16, :].reshape(nb.numel(), -1).view(torch.int8 if i8 else FP8).float()
            s = self.scale.float() / (1 if i8 else 256)
            s = s[nb][:, None] if s.dim() == 1 else s[nb // 16, :, nb % 16].repeat_interleave(
                -(-w.shape[1] // s.shape[1]), 1)[:, : w.shape[1]]
            out = w * s
        else:
            out = native.fp8_rows(self.packed, self.scale, ids, i8)
        return out.reshape(*ids.shape, self.shape[1])

    def use(self, fmt: ShapeFormat, isa: int = 0, made: dict[str, torch.Tensor] | None = None) -> None:
        """Run the formats fmt marks (isa: the streaming kernel's instruction set, 0 for none).
        made: "packed" | "plain" -> the bf16 copy the measurement already made of a weight in
        the compute dtype."""
        if self.packed is not None:
            return self._use_e4m3(fmt, isa)
        made = made or {}
        bounds = sorted({b for b, _ in fmt.plan} | ({1} if fmt.gemv else set()))
        kinds = [_kind(fmt, b) for b in bounds]
        copies: dict[str, torch.Tensor] = {}
        if "bf16" in kinds:
            w = made.get("packed")
            copies["bf16"] = w if w is not None else pack_bf16(self.weight.to(torch.bfloat16))
        if "gemv" in kinds:
            w = made.get("plain")
            copies["gemv"] = w if w is not None else self.weight.to(torch.bfloat16)
        products = {"fp32": None, **{k: (_bf16_run if k == "bf16" else _gemv_run)(w) for k, w in copies.items()}}
        runs = [products[k] for k in kinds]
        if all(k == "fp32" for k in kinds):
            bounds, runs, kinds = [], [], []
        self.bounds, self.runs, self.kinds, self.copies = bounds, runs, kinds, copies

    def _use_e4m3(self, fmt: ShapeFormat, isa: int) -> None:
        plan = (fmt.fp8 or []) if isa else []
        if not tiles_offered():  # the streaming kernel takes every size where the blocked product cannot run
            plan = [(1, True)] if isa else []
        plan = plan or [(1, False)]
        kinds = ["fp8" if use else "tiles" for _, use in plan]
        stream = self._streamer(isa) if "fp8" in kinds and native.library() is not None else None
        runs = [(stream or (lambda x, isa=isa: self._stream(x, isa))) if k == "fp8" else self._tiles for k in kinds]
        self.bounds, self.runs, self.kinds, self.copies, self.isa = [b for b, _ in plan], runs, kinds, {}, isa

    def kind(self, rows: int) -> str:
        """The format a step of `rows` rows runs in."""
        if not self.runs:
            return "tiles" if self.packed is not None else "fp32"
        return self.kinds[min(bisect.bisect_left(self.bounds, rows), len(self.kinds) - 1)]

    def max_rows(self, kind: str) -> int:
        """The largest step-size bound that runs `kind` (0: none)."""
        return max((b for b, k in zip(self.bounds, self.kinds) if k == kind), default=0)


def fp8_linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   cpu: CpuLinear | None) -> torch.Tensor:
    """x @ weight.T + bias on CPU: through the layer's CpuLinear (its product for this step's
    size), F.linear on weight where it has none."""
    if cpu is None:
        return F.linear(x, weight, bias)
    y = cpu(x)
    return y if bias is None else y + bias
