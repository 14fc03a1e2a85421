"""A mixture-of-experts layer's expert computation: each token through the k experts its
router chose, the outputs summed with the routing weights.

The contract every backend keeps (ops.fused_moe dispatches; the signature is the op's):

    fused_moe(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, *,
              b_gate_up=None, b_down=None, act="silu", swiglu_alpha=1.702, swiglu_limit=7.0,
              cpu=None) -> [T, H] in x's dtype

    x             [T, H]       the layer's normed hidden states (fp32 / bf16)
    w_gate_up     [E, 2I, H]   each expert's fused gate and up rows, [gate | up] (ridge's dense
                               gate_up layout; gpt-oss's interleaved columns are split at load);
                               float8_e4m3fn with w_gate_up_scale [E, 2I] fp32 (one scale per
                               output channel per expert), or float with w_gate_up_scale None
    w_down        [E, H, I]    with w_down_scale [E, H] fp32, or float with None
    topk_ids      [T, k]       int32 or int64, each in [0, E); a token's k ids are distinct
    topk_weights  [T, k]       fp32, the routing weights (already normalised as the family does)
    b_gate_up     [E, 2I]      optional biases (gpt-oss), in any float dtype
    b_down        [E, H]
    act           "silu" | "gelu" | "gelu_pytorch_tanh": act(gate) * up;
                  "swigluoai" (gpt-oss): gate clamped above at swiglu_limit, up to
                  [-swiglu_limit, swiglu_limit], then (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    cpu           a CpuExperts (the CPU formats of each expert's two products), or None

    out[t] = sum_j topk_weights[t, j] * (down_e(act(gate_up_e(x[t]) + b_gate_up[e])) + b_down[e]),
             e = topk_ids[t, j]

The products accumulate in fp32; the routing weight multiplies each expert's output (down's
epilogue), and a token's k terms are added in ascending expert order (transformers' order).

fused_moe_ref is the oracle: per expert, a mask over the routed slots (transformers' loop).
fused_moe_native is the CPU path where ridge's C kernel runs (kernels/csrc/fp8_linear.c,
fp8_moe): the whole layer in one call over the experts' e4m3 bytes, packed at load
(CpuExperts.packed). fused_moe_cpu is the CPU path elsewhere: the T * k routed slots sorted
by expert once, then one product per active expert over its contiguous run of gathered rows
(no per-token Python loop), each through the format its CpuLinear chose for that many rows
(kernels/cpu_linear.py). A GPU backend registers as "fused_moe" (ops.register_triton).

The router before it (ops.moe_route) has its own small contract: moe_route_ref(h, weight, bias,
kind, k, norm) -> (topk_ids [T, k] int64, topk_weights [T, k] fp32) from fp32 logits h @ W.T
(+ bias): "softmax_topk" takes the k largest of the softmax over all E (renormalized where
norm), "topk_softmax" the softmax over the k largest logits. moe_route_native is the C kernel
(kernels/csrc/small_ops.c), which the one-call layers run too (kernels/decoder_native.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import native
from .activation import gelu_and_mul_ref, gelu_tanh_and_mul_ref, silu_and_mul_ref
from .cpu_linear import FP8, CpuLinear, fp8_linear_cpu, unpack_fp8

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "swigluoai")
ROUTES = {"softmax_topk": 0, "topk_softmax": 1}  # the routers moe_route takes (moe_route's kind)


def moe_route_ref(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, k: int,
                  norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(h.float(), weight, bias)  # [T, E]
    if kind == "softmax_topk":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if norm:
            weights /= weights.sum(dim=-1, keepdim=True)
        return ids, weights
    top, ids = torch.topk(logits, k, dim=-1)
    return ids, torch.softmax(top, dim=-1)


def route_fits(weight: torch.Tensor, bias: torch.Tensor | None, kind: str, k: int) -> bool:
    """Whether moe_route_native takes a router, where the library is built: a rule it knows,
    fp32 contiguous weights of at most 1024 experts."""
    E = weight.shape[0]
    return (kind in ROUTES and 0 < k <= E <= 1024 and weight.dtype == torch.float32 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def moe_route_native(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, k: int,
                     norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_route_ref's contract in one C call, for a router that route_fits. A tie across the
    top-k cut (two experts' values equal where one is taken: a router's copied rows) routes the
    call by torch, whose topk breaks it as transformers does."""
    E, H = weight.shape
    assert h.shape[-1] == H, (h.shape, weight.shape)
    x = h.contiguous() if h.dtype == torch.float32 else h.float().contiguous()
    T = x.shape[0]
    ids, weights = torch.empty(T, k, dtype=torch.int64), torch.empty(T, k)
    rc = native.library().moe_route(x.data_ptr(), T, H, weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                    E, k, ROUTES[kind], int(norm), ids.data_ptr(), weights.data_ptr(),
                                    torch.get_num_threads())
    assert rc >= 0, "moe_route refused a router route_fits took"
    return (ids, weights) if rc == 0 else moe_route_ref(h, weight, bias, kind, k, norm)


def swigluoai_and_mul_ref(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """h: [T, 2I] as [gate | up] -> [T, I], gpt-oss's clamped SwiGLU (transformers' order of
    operations: (up + 1) * (gate * sigmoid(alpha * gate)))."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


_ACT_AND_MUL = {"silu": silu_and_mul_ref, "gelu": gelu_and_mul_ref, "gelu_pytorch_tanh": gelu_tanh_and_mul_ref}


def act_and_mul(h: torch.Tensor, act: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    if act == "swigluoai":
        return swigluoai_and_mul_ref(h, alpha, limit)
    return _ACT_AND_MUL[act](h)


def check_args(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights,
               b_gate_up=None, b_down=None, act="silu") -> None:
    """The contract's shapes and dtypes, for every backend's wrapper."""
    E, I2, H = w_gate_up.shape
    T, k = topk_ids.shape
    assert x.dim() == 2 and x.shape[1] == H, (x.shape, w_gate_up.shape)
    assert I2 % 2 == 0 and w_down.shape == (E, H, I2 // 2), (w_gate_up.shape, w_down.shape)
    assert topk_weights.shape == (T, k) and x.shape[0] == T and 1 <= k <= E, (topk_ids.shape, topk_weights.shape)
    assert not topk_ids.dtype.is_floating_point and topk_weights.dtype == torch.float32
    for w, s, rows in ((w_gate_up, w_gate_up_scale, I2), (w_down, w_down_scale, H)):
        assert (w.dtype == FP8) == (s is not None), "an FP8 weight needs its scales, a float one none"
        assert s is None or (s.shape == (E, rows) and s.dtype == torch.float32), (None if s is None else s.shape)
    assert b_gate_up is None or b_gate_up.shape == (E, I2)
    assert b_down is None or b_down.shape == (E, H)
    assert act in ACTIVATIONS, act


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int, dtype: torch.dtype,
                   cpu: "CpuExperts | None" = None, which: int = 0) -> torch.Tensor:
    """Expert e's [out, in] weight in dtype (FP8 times its channel scales: exact in fp32), from
    the CPU layer's e4m3 bytes where it holds them (cpu)."""
    if cpu is not None and (got := cpu.expert_weight(which, e)) is not None:
        return got.to(dtype)
    if scale is None:
        return w[e].to(dtype)
    return (w[e].float() * scale[e][:, None]).to(dtype)


def fused_moe_ref(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, *,
                  b_gate_up=None, b_down=None, act="silu", swiglu_alpha=1.702, swiglu_limit=7.0, cpu=None):
    """The contract (module docstring) the plainest way: for each expert, the slots routed to
    it found by a mask, its two products in fp32, the weighted output added to its tokens."""
    check_args(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, b_gate_up, b_down, act)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        h = F.linear(x[token].float(), _expert_weight(w_gate_up, w_gate_up_scale, e, torch.float32, cpu, 0),
                     None if b_gate_up is None else b_gate_up[e].float())
        h = act_and_mul(h, act, swiglu_alpha, swiglu_limit)
        y = F.linear(h, _expert_weight(w_down, w_down_scale, e, torch.float32, cpu, 1),
                     None if b_down is None else b_down[e].float())
        out.index_add_(0, token, y * topk_weights[token, slot, None])
    return out.to(x.dtype)


@dataclass(eq=False)
class CpuExperts:
    """One MoE layer's CPU expert products, in one of two forms.
    packed (where the C kernel takes the layer, native_takes): the e4m3 bytes of every expert in
    the kernel's layout, gate_up [E, 2I/16, H/2, 16, 2] and down [E, H/16, I/2, 16, 2] (uint8),
    and their channel scales times 256 ([E, 2I], [E, H]); the layer holds no upcast copy and has
    no per-expert formats to choose (gate_up and down empty).
    Else per expert the CpuLinear of its gate_up [2I, H] and of its down [H, I] weight (views of
    the layer's stacked upcast weights), whose formats the start-up measurement chooses per
    shape and row count like any linear layer's (kernels/cpu_linear_plan.py): an expert's
    product sees the rows routed to it."""
    gate_up: list[CpuLinear]
    down: list[CpuLinear]
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def layers(self) -> list[CpuLinear]:
        return self.gate_up + self.down

    @classmethod
    def packed_from(cls, w_gate_up: torch.Tensor, s_gate_up: torch.Tensor, w_down: torch.Tensor,
                    s_down: torch.Tensor) -> "CpuExperts":
        """The packed form from the stacked e4m3 weights and their [E, rows] scales."""
        return cls([], [], make_packed(w_gate_up, s_gate_up, w_down, s_down))

    def copies(self) -> list[torch.Tensor]:
        """What the products read beyond the layer's buffers: the e4m3 bytes and their scales,
        and any copy a never-quantized expert's format made."""
        e4m3 = [t for m in self.layers() if m.is_packed for t in (m.packed, m.scale)]
        return [t for m in self.layers() for t in m.copies.values()] + e4m3 + list(self.packed or ())

    def expert_weight(self, which: int, e: int) -> torch.Tensor | None:
        """Expert e's gate_up (which 0) or down (1) weight in fp32 from its e4m3 bytes, for the
        torch paths (the reference, and the grouped path where ridge's kernels are off): the
        layer's stacked buffers are stand-ins then. None where the layer holds its own weights."""
        if self.packed is not None:
            w, s = self.packed[2 * which], self.packed[2 * which + 1]
            return unpack_fp8(w[e], s[e], s.shape[1])
        layer = (self.gate_up, self.down)[which][e]
        return unpack_fp8(layer.packed, layer.scale, layer.shape[0]) if layer.is_packed else None


def pack_experts(w: torch.Tensor) -> torch.Tensor:
    """e4m3 [E, N, K] -> the C kernel's [E, N/16, K/2, 16, 2] bytes (cpu_linear.pack_fp8's layout
    per expert)."""
    E, n, k = w.shape
    return w.view(torch.uint8).view(E, n // 16, 16, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()


_ACT_CODE = {"silu": 0, "swigluoai": 1, "gelu": 2, "gelu_pytorch_tanh": 3}  # fp8_moe's act


def native_takes(num_experts: int, hidden: int, inter: int) -> bool:
    """Whether the C kernel (kernels/csrc/fp8_linear.c, fp8_moe) can run a layer of these shapes
    on this machine: the library built with its AVX2 product (native.fp8_linear_isa), widths in
    whole 16-column blocks. Decided once at load, since the layer then keeps only the e4m3
    bytes."""
    return native.fp8_linear_isa() >= 1 and hidden % 16 == 0 and inter % 16 == 0 and num_experts > 0


def make_packed(w_gate_up: torch.Tensor, s_gate_up: torch.Tensor, w_down: torch.Tensor,
                s_down: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """CpuExperts.packed from the stacked e4m3 weights and their [E, rows] scales."""
    return (pack_experts(w_gate_up), (s_gate_up.float() * 256).contiguous(), pack_experts(w_down),
            (s_down.float() * 256).contiguous())


def native_fits(x, topk_ids, cpu: CpuExperts | None, act: str) -> bool:
    """Whether fused_moe_native takes this call: a layer packed for the kernel, the library
    loaded (native.off() turns it off), a contract activation."""
    return cpu is not None and cpu.packed is not None and native.library() is not None and act in _ACT_CODE \
        and topk_ids.shape[1] <= 64


def fused_moe_native(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, *,
                     b_gate_up=None, b_down=None, act="silu", swiglu_alpha=1.702, swiglu_limit=7.0, cpu=None):
    """The contract in one C call over the e4m3 bytes of cpu.packed (w_* are the layer's e4m3
    buffers, read only for their shapes): the slots sorted by expert, each active expert's
    gate_up, activation, down, bias and routing weight, the k terms summed in ascending expert
    order; the thread team shares (expert, 16-column block) items. fp32 throughout (AVX2 FMA)."""
    check_args(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, b_gate_up, b_down, act)
    E, I2, H = w_gate_up.shape
    T, k = topk_ids.shape
    gu, s_gu, dn, s_dn = cpu.packed
    assert gu.shape == (E, I2 // 16, H // 2, 16, 2) and dn.shape == (E, H // 16, I2 // 4, 16, 2), (gu.shape, dn.shape)
    out = torch.empty((T, H), dtype=torch.float32)
    if T == 0:
        return out.to(x.dtype)
    xf = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    w = topk_weights.contiguous()
    bg = None if b_gate_up is None else b_gate_up.float().contiguous()
    bd = None if b_down is None else b_down.float().contiguous()
    rc = native.library().fp8_moe(xf.data_ptr(), T, H, I2 // 2, E, k, ids.data_ptr(), w.data_ptr(), gu.data_ptr(),
                                  s_gu.data_ptr(), None if bg is None else bg.data_ptr(), dn.data_ptr(),
                                  s_dn.data_ptr(), None if bd is None else bd.data_ptr(), _ACT_CODE[act],
                                  swiglu_alpha, swiglu_limit, out.data_ptr(), native.fp8_linear_isa(),
                                  torch.get_num_threads())
    assert rc == 0, "fp8_moe: no AVX2 product in this build"
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def fused_moe_cpu(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, *,
                  b_gate_up=None, b_down=None, act="silu", swiglu_alpha=1.702, swiglu_limit=7.0, cpu=None,
                  act_fn=None):
    """The contract grouped per expert: the T * k slots sorted by expert (stable, so each
    token's terms stay in ascending expert order), the rows gathered once, one gate_up and one
    down product per active expert over its run, the weighted rows added back in one pass.
    cpu: the layer's CpuExperts (each product in its chosen format); None: F.linear on the
    stacked weights (an FP8 one upcast per active expert). act_fn: h [n, 2I] -> [n, I], the
    activation's CPU implementation (ops chooses it; None: act_and_mul). One token (a batch-1
    decode step) skips the sort, gather and scatter: its k experts run on its row in order.
    A CpuExperts in the packed form (no per-expert layers: native.off() after a packed load)
    gives its experts' weights from the packed bytes (the stacked buffers are stand-ins then)."""
    packed = cpu if cpu is not None and not cpu.gate_up and cpu.packed is not None else None
    if cpu is not None and not cpu.gate_up:
        cpu = None

    def weight(which: int, w, scale, e: int) -> torch.Tensor:
        return _expert_weight(w, scale, e, torch.float32, packed, which)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = _product(rows, lambda: weight(0, w_gate_up, w_gate_up_scale, e), b_gate_up, e,
                     None if cpu is None else cpu.gate_up[e])
        h = act_fn(h) if act_fn is not None else act_and_mul(h, act, swiglu_alpha, swiglu_limit)
        return _product(h, lambda: weight(1, w_down, w_down_scale, e), b_down, e, None if cpu is None else cpu.down[e])

    xf = x if x.dtype == torch.float32 else x.float()
    T, k = topk_ids.shape
    if T == 1:
        out = None
        for e, w in sorted(zip(topk_ids[0].tolist(), topk_weights[0].tolist())):
            y = expert(e, xf).mul_(w)
            out = y if out is None else out.add_(y)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots by expert
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    tokens = order // k  # [T * k] the token of each sorted slot
    xs = xf[tokens]
    ys = torch.empty((T * k, w_down.shape[1]), dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = expert(e, xs[start:start + n])
            start += n
    ys.mul_(topk_weights.reshape(-1)[order, None])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, ys)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _product(x, weight, bias, e: int, cpu: CpuLinear | None) -> torch.Tensor:
    """x through expert e's product: its CpuLinear's, else F.linear on weight() (fp32)."""
    b = None if bias is None else bias[e].float()
    if cpu is not None:
        return fp8_linear_cpu(x, cpu.weight, b, cpu)
    return F.linear(x, weight(), b)
