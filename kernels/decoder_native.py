"""A dense decoder's layers in one C call for a CPU step of few rows (kernels/csrc/decoder.c).

The per-op path makes about ten calls a layer from Python (four products, two norms, RoPE, the
KV write, attention, the activation), each 5-30 us of dispatch around well under that of work at
one row: ~300 a step of a 30-layer model, several milliseconds against the ~10 ms its weights take
to read. decoder_layers runs the same C kernels in the same order with the same arguments, so its
bits are the per-op path's; it takes a step only where each of those kernels would have run:
every product in the streaming e4m3 kernel at this row count, ridge's attention and KV write on
a plain (fp32 or bf16) cache, no query past the attention kernel's length. Elsewhere the model
runs its layers one op at a time, as before.

The model states what a layer is (LayerSpec, ridge/models/layers/decoder.py: a plain llama-style
layer); this module checks what the kernels take and holds the C structs, rebuilt when a
product's format or a cache moves."""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from . import attention_native, moe, native
from .cpu_linear import CpuLinear, in_decode_step, tiles_offered
from .kv_cache import NATIVE_KV

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
PLAIN_KV = (torch.float32, torch.bfloat16)  # an FP8 cache rotates q, k and v first (ops.kv_rotation)


class _Linear(ctypes.Structure):
    _fields_ = [("w", _p), ("s", _p), ("bias", _p), ("sbf", _i64), ("gk", _i64), ("n", _i64), ("k", _i64),
                ("i8", _i64), ("isa", _i64), ("tb", _i64), ("bf16", _i64), ("gemm", _p), ("map", _p)]


class _Moe(ctypes.Structure):
    _fields_ = [("router_w", _p), ("router_b", _p), ("gu", _p), ("dn", _p), ("s_gu", _p), ("s_dn", _p), ("b_gu", _p),
                ("b_dn", _p), ("experts", _i64), ("topk", _i64), ("kind", _i64), ("norm", _i64), ("inter", _i64),
                ("act", _i64), ("isa", _i64), ("alpha", _f32), ("limit", _f32)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("moe", _Moe),
                ("norm1", _p), ("norm2", _p), ("cos_sin", _p), ("q_norm", _p), ("k_norm", _p), ("k_cache", _p),
                ("v_cache", _p),
                ("k_scale", _p), ("v_scale", _p), ("eps", _f32), ("scale", _f32),
                ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("rot", _i64), ("window", _i64),
                ("kind", _i64), ("num_slots", _i64), ("block_size", _i64), ("mlp", _i64)]


class _Step(ctypes.Structure):
    _fields_ = [("T", _i64), ("table_stride", _i64), ("num_seqs", _i64), ("max_q", _i64), ("nthreads", _i64),
                ("first", _i64), ("positions", _p), ("slots", _p), ("table", _p), ("seq_lens", _p), ("loc", _p),
                ("key_end", _p), ("work", _p), ("ids", _p), ("h", _p), ("res", _p), ("normed", _p), ("qkv", _p),
                ("q", _p), ("k", _p), ("attn", _p), ("gu", _p), ("act", _p), ("weights", _p)]


@dataclass
class MoeSpec:
    """A mixture of experts as the model holds it, for the C stack to run in place of the layer's
    own MLP where the kernels take it (moe_runs): its router (fp32 [E, H] weight, bias or None,
    the family's rule, k, renormalization) and its experts (a CpuExperts, their biases,
    activation and SwiGLU constants), as ops.moe_route and ops.fused_moe take them."""
    router_w: torch.Tensor
    router_b: torch.Tensor | None
    route: str
    k: int
    norm: bool
    experts: object
    b_gate_up: torch.Tensor | None
    b_down: torch.Tensor | None
    act: str
    alpha: float
    limit: float


def moe_runs(m: MoeSpec | None, hidden: int) -> bool:
    """Whether the C stack runs this mixture of experts: the per-op path's two C kernels would
    (moe.route_fits, and the packed experts moe.native_fits asks for), fp32 biases, the experts'
    hidden size the layer's."""
    if m is None or m.experts is None or m.experts.packed is None or m.act not in moe._ACT_CODE or m.k > 64:
        return False
    gu = m.experts.packed[0]
    wide = [t for t in (m.b_gate_up, m.b_down) if t is not None]
    return (moe.route_fits(m.router_w, m.router_b, m.route, m.k)
            and m.router_w.shape[1] == hidden and gu.shape[0] == m.router_w.shape[0] and gu.shape[2] * 2 == hidden
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in wide))


@dataclass
class LayerSpec:
    """One plain decoder layer as the model holds it: x + attn(norm1(x)), then + down(silu(gate) * up)
    of norm2; products (qkv, o, gate_up, down) with their biases (fp32 or None); cos_sin None
    for a layer without RoPE; window None for full attention; q_norm, k_norm: per-head RMSNorm
    weights (qwen3) or None. mlp: None where the MLP is that SiLU-gated one (run in C), else the
    layer's own (h -> h: a mixture of experts), run in Python on norm2's output, gate_up and
    down then None; moe: that MLP as the C stack runs it in its place where it can (moe_runs)."""
    products: tuple
    biases: tuple
    norm1: torch.Tensor
    norm2: torch.Tensor
    eps: float
    scale: float
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    cos_sin: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    mlp: Callable | None = None
    moe: MoeSpec | None = None  # the mlp as the C stack may run it (a mixture of experts), or None


def spec_fits(spec: LayerSpec) -> bool:
    """What the C stack takes of a layer, whatever the step: packed 8-bit weights whose outputs
    fill whole blocks of 16 (no padding column to cut), fp32 norms, biases and RoPE table."""
    qkv, o, gate_up, down = spec.products
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    hidden = qkv.shape[1]
    shapes = [(q + 2 * kv, hidden), (hidden, q)]
    if spec.mlp is None:
        shapes += [(gate_up.shape[0], hidden), (hidden, gate_up.shape[0] // 2)]
    products = [p for p in spec.products if p is not None]
    wide = [spec.norm1, spec.norm2, *(t for t in (*spec.biases, spec.cos_sin, spec.q_norm, spec.k_norm) if t is not None)]
    return (len(products) == len(shapes) and all(p.is_packed and p.shape[0] % 16 == 0 for p in products)
            and [p.shape for p in products] == shapes and (spec.mlp is not None or gate_up.shape[0] % 2 == 0)
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in wide)
            and spec.norm1.numel() == spec.norm2.numel() == hidden
            and (spec.q_norm is None) == (spec.k_norm is None)
            and (spec.q_norm is None or spec.q_norm.numel() == spec.k_norm.numel() == spec.head_dim)
            and all(b is None or b.numel() == p.shape[0] for p, b in zip(products, spec.biases)))


def _linear(p: CpuLinear, bias: torch.Tensor | None, rows: int, keep: list) -> _Linear | None:
    """p's product at `rows` rows as the per-op path runs it (CpuLinear.__call__): the streaming
    kernel (isa), or the blocked product (tb blocks a tile and torch's sgemm, or AMX); None for
    another."""
    kind = p.kind(rows)
    if not (kind == "fp8" and p.isa > 0) and not (kind == "tiles" and tiles_offered()):
        return None
    scale, gk, sbf = native._scales(p.packed, p.scale)
    keep.append(scale)  # _scales may rearrange: its pointer must outlive the structs
    tiles = kind != "fp8"
    bf16 = tiles and p.tiles_in_bf16()
    return _Linear(p.packed.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(), sbf, gk,
                   p.shape[0], p.shape[1], int(p.code == "i8"), 0 if tiles else p.isa,
                   native.tile_blocks(p.shape[1]) if tiles else 0, int(bf16), native.sgemm() if tiles else None,
                   None if tiles or p.special is None else p.special.data_ptr())


def _moe(m: MoeSpec) -> _Moe:
    """The struct of a mixture of experts that moe_runs; its tensors are the spec's, which the
    model holds."""
    gu, s_gu, dn, s_dn = m.experts.packed
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return _Moe(m.router_w.data_ptr(), ptr(m.router_b), gu.data_ptr(), dn.data_ptr(), s_gu.data_ptr(),
                s_dn.data_ptr(), ptr(m.b_gate_up), ptr(m.b_down), gu.shape[0], m.k, moe.ROUTES[m.route], int(m.norm),
                gu.shape[1] * 8, moe._ACT_CODE[m.act], native.fp8_linear_isa(), m.alpha, m.limit)


_STATE = {"on": True}


@contextmanager
def off():
    """Run the layers one op at a time within (tests compare the two paths; benchmarks time them)."""
    saved, _STATE["on"] = _STATE["on"], False
    try:
        yield
    finally:
        _STATE["on"] = saved


class NativeStack:
    """The C structs of a model's layers, built as steps need them (takes). specs() -> the
    layers' LayerSpecs as they are now, or None where one is not a plain layer; linears: the
    layers' product modules, whose CpuLinear (.cpu) and its formats (runs) key the built structs;
    attention_fits: attention_native.fits, as ops chooses with it."""

    def __init__(self, specs: Callable[[], list[LayerSpec] | None], linears: list, attention_fits: Callable):
        self.make_specs, self.linears = specs, linears
        self.attention_fits = attention_fits  # whether the attention kernel takes a layer's caches (ops gives it)
        self.specs: list[LayerSpec] = []
        self.c_moe: list[bool] = []  # per layer: its own MLP (a mixture of experts) runs in the C call
        self._built: tuple | None = None  # (key, the caches' (k, v), or None where the layers are not taken)
        # (rows, decode step) -> (layer structs, tensors they point into) or None: a decode step's
        # blocked products may run AMX's bf16 tiles where a prompt's of the same size do not
        self._rows: dict[tuple[int, bool], tuple | None] = {}
        self._plain = True  # False once specs() said no: a model's layer classes do not change

    def _key(self, kv_caches) -> tuple:
        """What the structs were built from: each product's CpuLinear and chosen formats (use()
        rebinds runs), and each cache's tensors."""
        return (tuple((id(m.cpu), id(getattr(m.cpu, "runs", None))) for m in self.linears)
                + tuple(id(getattr(kv, "k", kv)) for kv in kv_caches))  # a recurrent layer's state: no k

    def _build(self, key: tuple, kv_caches) -> bool:
        """Check the layers and caches afresh (a product's formats or a cache changed)."""
        self._built, self._rows = (key, None), {}
        specs = self.make_specs()
        self._plain = specs is not None
        if specs is None or len(kv_caches) < len(specs) or not all(spec_fits(s) for s in specs):
            return False
        for s, kv in zip(specs, kv_caches):
            k, v = kv.k, kv.v
            if not (k.dtype in PLAIN_KV and v.dtype == k.dtype and k.is_contiguous() and v.is_contiguous()
                    and k.shape[2:] == (s.kv_heads, s.head_dim)
                    and self.attention_fits(torch.empty(0, s.heads, s.head_dim), k, v, None, None, _NO_SEQS)):
                return False
        self.specs, self._built = specs, (key, [(kv.k, kv.v) for kv in kv_caches[: len(specs)]])
        self.c_moe = [moe_runs(s.moe, s.products[0].shape[1]) if s.mlp is not None else False for s in specs]
        return True

    def _layers(self, rows: int):
        """The layers' structs for a step of `rows` rows, each product in the kernel its CpuLinear
        runs at that size (the streaming kernel or the blocked product); None where one runs
        another format (a bf16 or fp32 copy)."""
        key = (rows, in_decode_step())
        if key in self._rows:
            return self._rows[key]
        layers, keep = (_Layer * len(self.specs))(), []
        self._rows[key] = None
        for lay, s, (k, v), c_moe in zip(layers, self.specs, self._built[1], self.c_moe):
            lins = [_linear(p, b, rows, keep) for p, b in zip(s.products, s.biases) if p is not None]
            if None in lins:
                return None
            lay.qkv, lay.o = lins[:2]
            if s.mlp is None:
                lay.gate_up, lay.down = lins[2:]
            lay.mlp = 1 if s.mlp is None else 2 if c_moe else 0
            if c_moe:
                lay.moe = _moe(s.moe)
            lay.q_norm, lay.k_norm = (None, None) if s.q_norm is None else (s.q_norm.data_ptr(), s.k_norm.data_ptr())
            lay.norm1, lay.norm2 = s.norm1.data_ptr(), s.norm2.data_ptr()
            lay.cos_sin, lay.rot = (None, 0) if s.cos_sin is None else (s.cos_sin.data_ptr(), s.cos_sin.shape[1])
            lay.k_cache, lay.v_cache, lay.k_scale, lay.v_scale = k.data_ptr(), v.data_ptr(), None, None
            lay.eps, lay.scale, lay.heads, lay.kv_heads, lay.head_dim = s.eps, s.scale, s.heads, s.kv_heads, s.head_dim
            lay.window = 0 if s.window is None else min(s.window, 2 ** 31 - 1)
            lay.kind, lay.num_slots, lay.block_size = NATIVE_KV[k.dtype], k.shape[0] * k.shape[1], k.shape[1]
        self._rows[key] = (layers, keep)
        return self._rows[key]

    def took(self, rows: int) -> bool:
        """Whether a step of `rows` rows ran in one call (its structs built), decode or prompt."""
        return any(self._rows.get((rows, decode)) is not None for decode in (False, True))

    def takes(self, h: torch.Tensor, positions: torch.Tensor, meta, kv_caches, count: int):
        """The structs of the first `count` layers for this step, or None where it does not fit."""
        t = h.shape[0]
        if (not self._plain or not _STATE["on"] or not 0 < t <= attention_native.NATIVE_MAX_Q or meta.mrope is not None
                or meta.max_query_len > attention_native.NATIVE_MAX_Q or h.dtype != torch.float32
                or not h.is_contiguous() or positions.dtype != torch.int64 or not positions.is_contiguous()
                or meta.slot_mapping.dtype != torch.int64 or not meta.slot_mapping.is_contiguous()
                or meta.slot_mapping.shape != (t,)):
            return None
        key = self._key(kv_caches)
        if (self._built is None or self._built[0] != key) and not self._build(key, kv_caches):
            return None
        return self._layers(t) if self._built[1] is not None and count <= len(self.specs) else None


def fits(stack: NativeStack, h: torch.Tensor, positions: torch.Tensor, meta, kv_caches, count: int) -> bool:
    """Whether the C stack takes this step's first `count` layers (ops.decoder_layers asks): the
    library built, every layer plain (the model's specs), each product in a ridge kernel at this
    row count, plain caches, no query past the attention kernel's length."""
    return native.library() is not None and stack.takes(h, positions, meta, kv_caches, count) is not None


def decoder_layers_native(stack: NativeStack, h: torch.Tensor, positions: torch.Tensor, meta, kv_caches,
                          count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first `count` layers over h [T, hidden] (the embeddings) for a step that fits(): ->
    (h, residual) as the per-op loop leaves them; None where a router met a tie across its
    top-k cut (moe.moe_route_native): the caller runs the step per op."""
    t = h.shape[0]
    built = stack._layers(t)  # built by fits() for this step a moment ago
    specs, first = stack.specs[:count], stack.specs[0]
    plan = meta.state_for(attention_native._NativePlan, (kv_caches[0].k.shape[1], first.kv_heads, t),
                          torch.empty(t, first.heads, first.head_dim), kv_caches[0].k)
    qkv_n = max(s.products[0].shape[0] for s in specs)  # scratch for the widest layer
    gu_n = max((s.products[2].shape[0] for s in specs if s.mlp is None), default=0)
    top_k = max((s.moe.k for s, c in zip(specs, stack.c_moe) if c), default=0)
    q_size, kv_size = max(s.heads * s.head_dim for s in specs), max(s.kv_heads * s.head_dim for s in specs)
    h = h.clone()  # the caller's embeddings stay as they were
    res, normed = torch.empty_like(h), torch.empty_like(h)
    qkv, gu, act = torch.empty(t, qkv_n), torch.empty(t, gu_n), torch.empty(t, gu_n // 2)
    ids, weights = torch.empty(t, top_k, dtype=torch.int64), torch.empty(t, top_k)
    q, k, attn = torch.empty(t, q_size), torch.empty(t, kv_size), torch.empty(t, q_size)
    table, stride, seq_lens, loc, num_seqs, _ = plan.batch
    work, threads = plan.tail
    st = _Step(t, stride, num_seqs, plan.max_q, threads, 1, positions.data_ptr(), meta.slot_mapping.data_ptr(),
               table, seq_lens, loc, plan.key_end, work, ids.data_ptr(), h.data_ptr(), res.data_ptr(),
               normed.data_ptr(), qkv.data_ptr(), q.data_ptr(), k.data_ptr(), attn.data_ptr(), gu.data_ptr(),
               act.data_ptr(), weights.data_ptr())
    lib, base, size = native.library(), ctypes.addressof(built[0]), ctypes.sizeof(_Layer)
    start = 0
    python_mlp = [i + 1 for i, (s, c) in enumerate(zip(specs, stack.c_moe)) if s.mlp is not None and not c]
    for stop in python_mlp + [count]:
        if stop > start:  # layers start..stop-1 in one call, the last one's MLP in Python where C does not run it
            rc = lib.decoder_layers(base + start * size, stop - start, ctypes.byref(st))
            if rc > 0:  # a router's tie, which torch breaks its own way: the step runs per op (the
                return None  # same kernels: what was written to the caches is written again, the same)
            if rc:
                raise RuntimeError(f"decoder_layers: layer {start - rc - 1}'s kernels refused the step "
                                   "(a slot past the cache, or a shape past the attention kernel's limits)")
            st.first = 0
            if stop in python_mlp:
                h.copy_(specs[stop - 1].mlp(normed))
        start = stop
    return h, res


class _NoSeqs:
    num_seqs = 0


_NO_SEQS = _NoSeqs()  # attention_native.fits reads only the batch's size of the metadata
