"""GPU check of ridge's kernels: correctness at realistic sizes, speed against measured ceilings.

    python tests/gpu/check.py           # one CUDA GPU; under 8 minutes on an H200
    python tests/gpu/check.py --tiny    # CPU, Triton interpreter, tiny sizes: proves the script runs

Needs only torch, triton and numpy (torch >= 2.6, triton >= 3.2): ridge's own
modules are imported from this checkout through a shim, never installed. Method:
ceilings (copy bandwidth, bf16 and FP8 matmul rates) are measured once; each
kernel is compared with its torch reference on a Llama-3-8B-shaped layer
(hidden 4096, 32 heads, 8 KV heads, head_dim 128, context 8K) and timed with
CUDA events (median of many runs after warm-up, inputs rotated over several
copies so that data exceed the L2 several times). A 1B-shaped model then runs
whole decode steps with FP8 weights, FP8 KV and CUDA graphs, against the
roofline (weight + KV bytes / copy bandwidth). JSON goes to $OUT if set.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path

TINY = "--tiny" in sys.argv
# --only=moe,attn: just these sections (small, attn, linear, moe, recurrent, tiers, e2e), after the ceilings.
ONLY = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)
if TINY:
    os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import
for _absent in ("zmq", "msgpack", "gguf", "textual"):  # the GPU machine lacks these: prove we never need them
    sys.modules.setdefault(_absent, None)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def import_ridge() -> None:
    """Map ridge.kernels, ridge.quant, ridge.cache onto the top-level folders (as
    pyproject's package-dir does) without running any package __init__."""
    pkg = types.ModuleType("ridge")
    pkg.__path__ = [str(ROOT / "ridge")]
    sys.modules["ridge"] = pkg
    for sub in ("kernels", "quant", "cache", "engine"):
        mod = types.ModuleType(f"ridge.{sub}")
        mod.__path__ = [str(ROOT / sub if sub != "engine" else ROOT / "ridge" / sub)]
        sys.modules[f"ridge.{sub}"] = mod
        setattr(pkg, sub, mod)


import_ridge()
from ridge.cache.kv_cache import KVCache  # noqa: E402
from ridge.config import ModelConfig  # noqa: E402
from ridge.kernels import ops  # noqa: E402
from ridge.kernels import activation  # noqa: E402
from ridge.kernels.activation import silu_and_mul_ref, silu_and_mul_triton  # noqa: E402
from ridge.kernels.attention import paged_attention_ref, paged_attention_triton  # noqa: E402
from ridge.engine.graphs import StepGraphs  # noqa: E402
from ridge.engine.step_batch import StepBuffers  # noqa: E402
from ridge.kernels.cuda_graph import GraphShape  # noqa: E402
from ridge.kernels.kv_cache import FP8, write_kv_ref, write_kv_triton  # noqa: E402
from ridge.kernels.linear import (_gemm_candidates, fp8_linear_ref, fp8_linear_triton, fp8_scaled_mm,  # noqa: E402
                                  fp8_w8a8_triton)
from ridge.kernels.metadata import AttentionMetadata  # noqa: E402
from ridge.kernels.moe import fused_moe_ref  # noqa: E402
from ridge.kernels.moe_triton import _candidates as moe_candidates, fused_moe_triton  # noqa: E402
from ridge.kernels.norm import rms_norm_ref, rms_norm_triton  # noqa: E402
from ridge.kernels.rope import rope_ref, rope_triton  # noqa: E402
from ridge.kernels.triton_utils import CONFIGS  # noqa: E402
from ridge.models.layers.decoder import CausalLM  # noqa: E402
from ridge.models.layers.rope import rope_cos_sin  # noqa: E402
from ridge.quant.fp8 import quantize_fp8  # noqa: E402

DEV = torch.device("cpu" if TINY else "cuda")
DT = torch.float32 if TINY else torch.bfloat16  # the CPU model runs fp32
# Llama-3-8B layer (or a toy one under the interpreter).
L = (dict(hidden=128, heads=4, kv=2, hd=64, inter=256, ctx=96, tokens=40) if TINY else
     dict(hidden=4096, heads=32, kv=8, hd=128, inter=14336, ctx=8192, tokens=4096))
ROWS: list[dict] = []
FAILED: list[str] = []


# ----------------------------------------------------------------------------- timing

def l2_bytes() -> int:
    return 1 << 20 if TINY else torch.cuda.get_device_properties(DEV).L2_cache_size


def copies_for(bytes_per_call: float) -> int:
    """Independent input sets to rotate through so that the data exceed 4x the L2."""
    return max(1, min(16, math.ceil(4 * l2_bytes() / max(bytes_per_call, 1))))


def bench(calls: list, iters: int = 50) -> float:
    """Median milliseconds of one call, cycling through `calls` (distinct data)."""
    if TINY:
        t0 = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t0) * 1e3
    for c in calls * 2:
        c()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (a, b) in enumerate(events):
        a.record()
        calls[i % len(calls)]()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def measure_ceilings() -> dict:
    n = (1 << 22) if TINY else (1 << 30)
    src, dst = torch.empty(n, dtype=torch.uint8, device=DEV), torch.empty(n, dtype=torch.uint8, device=DEV)
    ms = bench([lambda: dst.copy_(src)], 20)
    copy = 2 * n / ms / 1e6  # GB/s: read + write
    m = 256 if TINY else 8192
    a = torch.randn(m, m, device=DEV).to(DT)
    bf16 = 2 * m ** 3 / bench([lambda: a @ a], 20) / 1e9
    a8, w8 = a.to(FP8), a.to(FP8)
    sa, sb = torch.ones(m, 1, device=DEV), torch.ones(1, m, device=DEV)
    try:
        fp8 = 2 * m ** 3 / bench([lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb,
                                                            out_dtype=torch.bfloat16)], 20) / 1e9
    except RuntimeError as e:  # below sm_89 there is no FP8 MMA
        print("FP8 matmul unavailable:", str(e).splitlines()[0])
        fp8 = float("nan")
    c = dict(copy_GBps=copy, bf16_TFLOPs=bf16, fp8_TFLOPs=fp8)
    print("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in c.items()))
    return c


def record(name: str, shape: str, err: float, tol: float, ms: float, rate: float, unit: str, ceiling: float):
    ok = bool(err <= tol)
    if not ok:
        FAILED.append(name)
    ROWS.append(dict(name=name, shape=shape, err=err, tol=tol, ok=ok, ms=ms, rate=rate, unit=unit,
                     pct=100 * rate / ceiling if ceiling == ceiling and ceiling > 0 else float("nan")))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


# ----------------------------------------------------------------------------- small ops

def check_small_ops(ceil: dict) -> None:
    T, H = L["tokens"], L["hidden"]
    bw = ceil["copy_GBps"]
    k = copies_for(4 * T * H * 2)
    xs = [(torch.randn(T, H, device=DEV).to(DT), torch.randn(T, H, device=DEV).to(DT)) for _ in range(k)]
    w = torch.rand(H, device=DEV) + 0.5
    got, exp = rms_norm_triton(*xs[0][:1], w, 1e-5, xs[0][1]), rms_norm_ref(xs[0][0], w, 1e-5, xs[0][1])
    ms = bench([lambda x=x: rms_norm_triton(x[0], w, 1e-5, x[1]) for x in xs])
    record("rms_norm+residual", f"{T}x{H}", rel_err(got[0], exp[0]), 1e-2, ms, 4 * T * H * 2 / ms / 1e6, "GB/s", bw)

    nq, nk, hd = L["heads"], L["kv"], L["hd"]
    cs = rope_cos_sin(hd, max(L["ctx"], T), 500000.0).to(DEV)
    width = (nq + 2 * nk) * hd
    k = copies_for(T * width * 2)
    qkvs = [torch.randn(T, width, device=DEV).to(DT) for _ in range(k)]
    pos = torch.randint(0, cs.shape[0], (T,), device=DEV)

    def views(qkv):
        return qkv[:, : nq * hd].view(T, nq, hd), qkv[:, nq * hd: (nq + nk) * hd].view(T, nk, hd)

    exp = rope_ref(*views(qkvs[0]), pos, cs)
    got = rope_triton(*views(qkvs[0].clone()), pos, cs)
    ms = bench([lambda x=x: rope_triton(*views(x), pos, cs) for x in qkvs])  # in place: rotating is fine
    moved = 2 * T * (nq + nk) * hd * 2
    record("rope (in place)", f"{T}x({nq}+{nk})x{hd}", max(rel_err(got[0], exp[0]), rel_err(got[1], exp[1])),
           1e-2, ms, moved / ms / 1e6, "GB/s", bw)
    part = rope_cos_sin(hd * 3 // 4, cs.shape[0], 500000.0).to(DEV)  # partial rotary (Phi-4-mini's 0.75)
    exp = rope_ref(*views(qkvs[0]), pos, part)
    got = rope_triton(*views(qkvs[0].clone()), pos, part)
    record("rope partial 3/4", f"{T}x({nq}+{nk})x{hd}", max(rel_err(got[0], exp[0]), rel_err(got[1], exp[1])),
           1e-2, float("nan"), float("nan"), "GB/s", bw)

    inter = L["inter"]
    k = copies_for(T * 3 * inter * 2)
    xs = [torch.randn(T, 2 * inter, device=DEV).to(DT) for _ in range(k)]
    err = rel_err(silu_and_mul_triton(xs[0]), silu_and_mul_ref(xs[0]))
    ms = bench([lambda x=x: silu_and_mul_triton(x) for x in xs])
    record("silu_and_mul", f"{T}x{inter}", err, 1e-2, ms, 3 * T * inter * 2 / ms / 1e6, "GB/s", bw)
    for name in ("gelu_and_mul", "gelu_tanh_and_mul"):
        fn = getattr(activation, name + "_triton")
        err = rel_err(fn(xs[0]), getattr(activation, name + "_ref")(xs[0]))
        ms = bench([lambda x=x: fn(x) for x in xs])
        record(name, f"{T}x{inter}", err, 1e-2, ms, 3 * T * inter * 2 / ms / 1e6, "GB/s", bw)


def check_write_kv(ceil: dict) -> None:
    T, nk, hd, bs = L["tokens"], L["kv"], L["hd"], 16
    nb = 2 * T // bs + 8
    shape = (nb, bs, nk, hd)
    caches = [[torch.zeros(shape, dtype=FP8, device=DEV) for _ in range(2)] +
              [torch.ones(shape[:3], dtype=torch.float16, device=DEV) for _ in range(2)] for _ in range(2)]
    kv = torch.randn(T, 2, nk, hd, device=DEV).to(DT) * 3
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    write_kv_ref(kv[:, 0], kv[:, 1], *caches[0], slots)
    write_kv_triton(kv[:, 0], kv[:, 1], *caches[1], slots)
    bad = sum((a.view(torch.uint8) != b.view(torch.uint8)).sum().item() for a, b in zip(caches[0][:2], caches[1][:2]))
    bad += sum((a != b).sum().item() for a, b in zip(caches[0][2:], caches[1][2:]))
    ms = bench([lambda: write_kv_triton(kv[:, 0], kv[:, 1], *caches[1], slots)])
    moved = 2 * T * nk * (hd * 2 + hd + 2)  # read bf16 K/V, write fp8 + fp16 scale
    record("write_kv fp8", f"{T}x{nk}x{hd}", bad / (2 * T * nk * hd), 0.0, ms, moved / ms / 1e6, "GB/s",
           ceil["copy_GBps"])


# ----------------------------------------------------------------------------- attention

def paged_inputs(q_lens: list[int], ctx_lens: list[int], kv_dtype, copies: int = 1, bs: int = 16):
    """`copies` independent batches sharing one cache (distinct blocks), filled at random."""
    nq, nk, hd = L["heads"], L["kv"], L["hd"]
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    per = [math.ceil(s / bs) for s in seq_lens]
    nb = sum(per) * copies + 1
    cache = [torch.empty((nb, bs, nk, hd), device=DEV).uniform_(-2, 2).to(kv_dtype) for _ in range(2)]
    scales = [torch.empty((nb, bs, nk), device=DEV).uniform_(0.5, 1.5).half() for _ in range(2)]
    scales = scales if kv_dtype == FP8 else [None, None]
    perm = (torch.randperm(nb - 1) + 1).tolist()
    metas = []
    for _ in range(copies):
        tables = [[perm.pop() for _ in range(n)] for n in per]
        metas.append(AttentionMetadata.build(q_lens, seq_lens, tables, [-1] * sum(q_lens), DEV))
    qs = [torch.randn(sum(q_lens), nq, hd, device=DEV).to(DT) for _ in range(copies)]
    return cache, scales, metas, qs


def check_attention(name: str, q_lens: list[int], ctx_lens: list[int], kv_dtype, ceil: dict,
                    splits: int | None = None, window: int | None = None, softcap: float | None = None,
                    sinks: bool = False) -> None:
    """window: bandwidth counts the keys a sliding window reads (at a context of 4 windows a decode
    must run at the speed of one window's). sinks: gpt-oss's per-head logits, random."""
    nq, nk, hd = L["heads"], L["kv"], L["hd"]
    read = [c + n if window is None else min(c + n, window + n) for c, n in zip(ctx_lens, q_lens)]
    kv_bytes = sum(read) * nk * (2 * hd * kv_dtype.itemsize + (4 if kv_dtype == FP8 else 0))
    (kc, vc), (ks, vs), metas, qs = paged_inputs(q_lens, ctx_lens, kv_dtype, copies_for(kv_bytes))
    scale = hd ** -0.5
    kw = dict(window=window, softcap=softcap, sinks=torch.randn(nq, device=DEV) * 2 if sinks else None)
    exp = paged_attention_ref(qs[0], kc, vc, ks, vs, metas[0], scale, **kw)
    err = rel_err(paged_attention_triton(qs[0], kc, vc, ks, vs, metas[0], scale, num_splits=splits, **kw), exp)
    ms = bench([lambda q=q, m=m: paged_attention_triton(q, kc, vc, ks, vs, m, scale, num_splits=splits, **kw)
                for q, m in zip(qs, metas)])
    flops = sum(4 * nq * hd * sum(c + j + 1 for j in range(n)) for c, n in zip(ctx_lens, q_lens))
    shape = f"B={len(q_lens)} q={max(q_lens)} ctx={max(ctx_lens)} {'fp8' if kv_dtype == FP8 else 'bf16'}"
    if max(q_lens) == 1:  # decode: bandwidth-bound
        record(name, shape, err, 2e-2, ms, kv_bytes / ms / 1e6, "GB/s", ceil["copy_GBps"])
    else:
        record(name, shape, err, 2e-2, ms, flops / ms / 1e9, "TFLOP/s", ceil["bf16_TFLOPs"])


# ----------------------------------------------------------------------------- FP8 linear

def check_linear(name: str, M: int, N: int, K: int, ceil: dict) -> None:
    w8, ws = quantize_fp8(torch.randn(N, K, device=DEV) * 0.02)
    copies = copies_for(N * K)
    weights = [(w8, ws)] + [(w8.clone(), ws.clone()) for _ in range(copies - 1)]
    x = torch.randn(M, K, device=DEV).to(DT)
    out = fp8_linear_triton(x, w8, ws)
    try:
        exact = fp8_scaled_mm(x, w8, ws)  # the same W8A8 product through torch (CPU too)
    except RuntimeError:
        exact = fp8_w8a8_triton(x, w8, ws)
    err = rel_err(out, exact)
    ref_err = rel_err(out, fp8_linear_ref(x, w8, ws))  # W8A8 vs weight-only: activation rounding
    ms = bench([lambda w=w: fp8_linear_triton(x, *w) for w in weights])
    shape = f"{M}x{N}x{K} (vs ref {100 * ref_err:.1f}%)"
    if M <= 64:
        record(name, shape, err, 2e-2, ms, (N * K + 2 * M * (N + K)) / ms / 1e6, "GB/s", ceil["copy_GBps"])
        return
    flops = 2 * M * N * K
    # The target: the Triton dot at its best tile >= 70% of torch._scaled_mm on the same shape.
    sm = bench([lambda w=w: fp8_scaled_mm(x, *w) for w in weights])
    tri = min(bench([lambda w=w, c=c: fp8_w8a8_triton(x, *w, cfg=c) for w in weights])
              for c in _gemm_candidates(x, M))
    record(name + " triton dot", shape, err, 2e-2, tri, flops / tri / 1e9, "TFLOP/s", flops / sm / 1e9)
    record(name, shape, err, 2e-2, ms, flops / ms / 1e9, "TFLOP/s", ceil["fp8_TFLOPs"] if not TINY else
           ceil["bf16_TFLOPs"])


# ----------------------------------------------------------------------------- MoE experts

def moe_inputs(T: int, E: int, k: int, H: int, copies: int):
    """`copies` independent (x, topk_ids, topk_weights): each token's k distinct experts at random."""
    out = []
    for _ in range(copies):
        ids = torch.rand(T, E, device=DEV).topk(k, dim=-1).indices.to(torch.int32)
        out.append((torch.randn(T, H, device=DEV).to(DT), ids, torch.softmax(torch.randn(T, k, device=DEV), dim=-1)))
    return out


def check_moe(name: str, E: int, k: int, H: int, inter: int, act: str, bias: bool, token_counts, ceil: dict) -> None:
    """One MoE layer's experts (FP8, per-channel scales) at decode sizes (bytes: the distinct
    experts' weights, against copy bandwidth; each path's best tile) and at prefill sizes
    (FLOPs against FP8 _scaled_mm); errors against fused_moe_ref (W8A8 rounds activations twice)
    and, weight-only, against the same reference tightly."""
    w1, s1 = quantize_fp8(torch.randn(E, 2 * inter, H, device=DEV) * H ** -0.5, "absmax")
    w2, s2 = quantize_fp8(torch.randn(E, H, inter, device=DEV) * inter ** -0.5, "absmax")
    kw = dict(act=act, b_gate_up=torch.randn(E, 2 * inter, device=DEV) * 0.1 if bias else None,
              b_down=torch.randn(E, H, device=DEV) * 0.1 if bias else None)
    per_expert = 3 * inter * H + 4 * (2 * inter + H)
    for T in token_counts:
        sets = moe_inputs(T, E, k, H, copies_for(min(E, T * k) * per_expert) if T <= 64 else 1)
        x, ids, wts = sets[0]
        args = (w1, s1, w2, s2)
        exp = fused_moe_ref(x, *args, ids, wts, **kw)
        err = rel_err(fused_moe_triton(x, *args, ids, wts, **kw), exp)
        wo = rel_err(fused_moe_triton(x, *args, ids, wts, **kw, w8a8=False), exp)
        shape = f"T={T} E={E} k={k} H={H} I={inter} (w-only {wo:.1e})"
        if wo > 2e-2:
            FAILED.append(f"{name} weight-only T={T}")
        if T <= 64:
            touched = statistics.mean(int(i.unique().numel()) for _, i, _ in sets)
            moved = touched * per_expert + T * H * 4 + T * k * inter * 4
            best: dict = {}
            for c in moe_candidates(x, T):
                ms = bench([lambda s=s, c=c: fused_moe_triton(s[0], *args, s[1], s[2], **kw, cfg=c) for s in sets])
                best[c["path"]] = min(best.get(c["path"], float("inf")), ms)
            for path, ms in sorted(best.items()):
                record(f"{name} {path}", shape, err, 8e-2, ms, moved / ms / 1e6, "GB/s", ceil["copy_GBps"])
        else:
            ms = bench([lambda s=s: fused_moe_triton(s[0], *args, s[1], s[2], **kw) for s in sets], 20)
            flops = 2 * T * k * 3 * inter * H
            record(f"{name} sorted", shape, err, 8e-2, ms, flops / ms / 1e9, "TFLOP/s",
                   ceil["fp8_TFLOPs"] if not TINY else ceil["bf16_TFLOPs"])


# ----------------------------------------------------------------------------- end to end

def model_config() -> ModelConfig:
    if TINY:
        return ModelConfig("llama", 512, 128, 256, 2, 4, 2, 64, max_position=256, name="tiny")
    # Llama-3.2-1B's shape.
    return ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, rope_theta=500000.0, max_position=8192,
                       tie_word_embeddings=True, name="random-1B")


def random_model(cfg: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg, cfg.max_position)
    sd = {"embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, device=DEV) * 0.5,
          "norm.weight": torch.ones(cfg.hidden_size, device=DEV)}
    shapes = {"qkv_proj": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.q_size),
              "gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    for i in range(cfg.num_layers):
        for n, s in shapes.items():
            sd[f"layers.{i}.{n}.weight"], sd[f"layers.{i}.{n}.weight_scale"] = quantize_fp8(
                torch.randn(s, device=DEV) * s[1] ** -0.5)
        for n in ("input_layernorm", "post_attention_layernorm"):
            sd[f"layers.{i}.{n}.weight"] = torch.ones(cfg.hidden_size, device=DEV)
    model.load_weights(sd, DEV, DT)  # tied, as Llama-3.2-1B: the head is the compute-dtype embedding
    return model.eval()


def check_kv_tiers() -> None:
    """The KV tiers' block copies (cache/block_io.py): FP8 blocks of the 1B shape, with scales,
    to pinned host rows and back on the side stream, bit for bit; rate in GB/s of block bytes
    (a PCIe figure: no ceiling measured here)."""
    from ridge.cache.block_io import BlockLayout, block_io

    nb, n = (64, 8) if TINY else (4096, 1024)
    cache = KVCache(model_config(), nb, 16, "fp8", DEV)
    layout = BlockLayout([cache])
    for t in layout.tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape if t.element_size() == 1 else
                                                (*t.shape[:-1], t.shape[-1] * t.element_size()),
                                                dtype=torch.uint8, device=DEV))
    io = block_io(layout)
    ids = torch.randperm(nb)[:n].tolist()
    rows = torch.empty((n, layout.block_bytes), dtype=torch.uint8, pin_memory=not TINY)
    target = rows.numpy() if TINY else rows
    before = [t.view(torch.uint8)[ids].clone() for t in layout.tensors]

    def timed(fn) -> float:
        t0 = time.perf_counter()
        ev = fn()
        if ev is not None:
            ev.synchronize()
        return 1e3 * (time.perf_counter() - t0)

    save_ms = min(timed(lambda: io.save(ids, target, range(n))) for _ in range(3))
    for t in layout.tensors:
        t.view(torch.uint8)[ids] = 0
    load_ms = min(timed(lambda: io.load(ids, target, range(n))) for _ in range(3))
    bad = sum((t.view(torch.uint8)[ids] != b).sum().item() for t, b in zip(layout.tensors, before))
    moved = n * layout.block_bytes
    for name, ms in (("kv tier save (D2H)", save_ms), ("kv tier load (H2D)", load_ms)):
        record(name, f"{n} blocks x {layout.block_bytes} B", bad / moved, 0.0, ms, moved / ms / 1e6, "GB/s",
               float("nan"))


def decode_step_inputs(cfg: ModelConfig, batch: int, ctx: int, bs: int = 16):
    per = math.ceil((ctx + 1) / bs)
    cache = KVCache(cfg, per * batch + 1, bs, "fp8", DEV)
    for layer in cache.layers:  # random contents, so attention does real work
        for t in (layer.k, layer.v):
            t.copy_(torch.empty(t.shape, device=DEV).uniform_(-3, 3).to(FP8))
    tables = [list(range(1 + b * per, 1 + (b + 1) * per)) for b in range(batch)]
    slots = [t[ctx // bs] * bs + ctx % bs for t in tables]
    meta = AttentionMetadata.build([1] * batch, [ctx + 1] * batch, tables, slots, DEV)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=DEV)
    return cache, meta, ids, torch.full((batch,), ctx, device=DEV)


def check_decode_step(model: CausalLM, batch: int, ctx: int, bw: float) -> dict:
    cfg = model.cfg
    cache, meta, ids, pos = decode_step_inputs(cfg, batch, ctx)

    def step(i, p, m):
        return model.compute_logits(model(i, p, m, cache.layers))

    with ops.use_triton(False):
        ref = step(ids, pos, meta).clone()
    with ops.use_triton():
        eager = step(ids, pos, meta).clone()
        # The engine's graph path: static buffers at capacity, one decode graph of this batch.
        width = meta.block_table.shape[1]
        bufs = StepBuffers(batch, batch, width, DEV)
        graphs = StepGraphs(step, bufs, 16, batch, batch, ctx + 1, enabled=True)
        shape = GraphShape("decode", batch)
        d = bufs.dev

        def replay():
            d["input_ids"][:batch].copy_(ids)
            d["positions"][:batch].copy_(pos)
            d["slot_mapping"][:batch].copy_(meta.slot_mapping)
            d["seq_lens"][:batch].copy_(meta.seq_lens)
            d["query_start_loc"][:batch + 1].copy_(meta.query_start_loc)
            d["block_table"][:batch, :width].copy_(meta.block_table)
            return graphs.pool.replay(shape) if graphs.pool is not None else graphs.run_static(shape)

        if graphs.pool is not None:
            graphs.capture([shape])
        graph = replay().clone()
        eager_ms = bench([lambda: step(ids, pos, meta)], 20)
        graph_ms = bench([replay], 50)
    linear = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if hasattr(m, "is_fp8"))
    weight_bytes = linear + batch * cfg.hidden_size * 2 + (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
    kv_bytes = batch * (ctx + 1) * cache.bytes_per_token
    roofline_ms = (weight_bytes + kv_bytes) / bw / 1e6
    res = dict(batch=batch, ctx=ctx, eager_ms=eager_ms, graph_ms=graph_ms, roofline_ms=roofline_ms,
               pct_of_roofline=100 * roofline_ms / graph_ms, weight_MB=weight_bytes / 1e6, kv_MB=kv_bytes / 1e6,
               graph_vs_eager_err=rel_err(graph, eager), vs_reference_err=rel_err(graph, ref),
               top1_agree=(graph.argmax(-1) == ref.argmax(-1)).float().mean().item())
    # W8A8 activation rounding compounds over the layers; a broken kernel gives errors near 1.
    ok = res["graph_vs_eager_err"] < 1e-3 and res["vs_reference_err"] < 0.25
    if not ok:
        FAILED.append(f"decode step B={batch}")
    print(f"decode B={batch:<3} ctx={ctx:<5} graph {graph_ms:.3f} ms  eager {eager_ms:.3f} ms  roofline "
          f"{roofline_ms:.3f} ms ({res['pct_of_roofline']:.0f}%)  err vs eager {res['graph_vs_eager_err']:.1e}"
          f"  vs reference {res['vs_reference_err']:.1e}  top-1 agree {res['top1_agree']:.2f}"
          f"  {'ok' if ok else 'FAIL'}")
    return res


# ----------------------------------------------------------------------------- main

def print_table() -> None:
    print(f"\n{'kernel':<26} {'shape':<38} {'rel err':>9} {'ms':>9} {'rate':>10} {'unit':<8} {'% ceil':>7}  ok")
    for r in ROWS:
        print(f"{r['name']:<26} {r['shape']:<38} {r['err']:>9.2e} {r['ms']:>9.4f} {r['rate']:>10.1f} "
              f"{r['unit']:<8} {r['pct']:>6.0f}%  {'ok' if r['ok'] else 'FAIL'}")


def wanted(section: str) -> bool:
    return ONLY is None or section in ONLY


def check_attentions(ceil: dict) -> None:
    ctx, big = L["ctx"], L["tokens"]
    check_attention("attn decode (split-K)", [1], [ctx], FP8, ceil, splits=2 if TINY else None)
    check_attention("attn decode", [1] * (4 if TINY else 32), [ctx] * (4 if TINY else 32), FP8, ceil)
    check_attention("attn decode bf16 KV", [1] * (4 if TINY else 32), [ctx] * (4 if TINY else 32),
                    torch.bfloat16, ceil)
    check_attention("attn prefill chunk", [big // 2], [ctx - big // 2], FP8, ceil)
    check_attention("attn mixed", [1] * 8 + [big // 8], [ctx // 2] * 8 + [ctx // 4], FP8, ceil)
    for c in (ctx // 4, ctx):  # a window of ctx/4 at 1 and at 4 windows: the same time
        check_attention("attn decode window+softcap", [1] * (4 if TINY else 32), [c] * (4 if TINY else 32), FP8,
                        ceil, window=ctx // 4, softcap=50.0)
    # gpt-oss: sinks on its sliding layers and full ones, decode split or not, and a prefill chunk.
    check_attention("attn decode sinks+window", [1] * (4 if TINY else 32), [ctx] * (4 if TINY else 32), FP8,
                    ceil, window=ctx // 4, sinks=True)
    check_attention("attn decode sinks (split-K)", [1], [ctx], FP8, ceil, splits=2 if TINY else None, sinks=True)
    check_attention("attn prefill sinks", [big // 2], [ctx - big // 2], FP8, ceil, sinks=True)


def check_linears(ceil: dict) -> None:
    H, I, Q, KV = L["hidden"], L["inter"], L["heads"] * L["hd"], L["kv"] * L["hd"]
    for M in ((1, 40, 100) if TINY else (1, 16, 4096)):
        check_linear("fp8 qkv", M, Q + 2 * KV, H, ceil)
        check_linear("fp8 gate_up", M, 2 * I, H, ceil)
        check_linear("fp8 down", M, H, I, ceil)


def check_recurrent(ceil: dict) -> None:
    """Issue 41's recurrent layers, Qwen3-Next's gated delta rule (16 key / 32 value heads of 128, a
    conv of 4 taps over q/k/v) and a Mamba2 layer (64 heads x 64, state 128, 1 group): decode
    (32 requests, a token each: bound by the states' bytes, read and written once) and a prefill
    chunk (4 requests x 1024 tokens, the chunked forms), fp32 state pools, against the references."""
    from ridge.kernels import causal_conv as cc, gated_delta as gd, ssd_scan as ss
    hk, hv, dk, dv, taps = (2, 4, 32, 32, 4) if TINY else (16, 32, 128, 128, 4)
    sh, sp, sn = (4, 16, 16) if TINY else (64, 64, 128)
    bw = ceil["copy_GBps"]
    for n, length in (((3, 1), (2, 70)) if TINY else ((32, 1), (4, 1024))):
        t = n * length
        cu = torch.arange(n + 1, device=DEV) * length
        slots = torch.randperm(4 * n, device=DEV)[:n]
        q, k = torch.randn(t, hk, dk, device=DEV).to(DT), torch.randn(t, hk, dk, device=DEV).to(DT)
        v = torch.randn(t, hv, dv, device=DEV).to(DT)
        g = -torch.nn.functional.softplus(torch.randn(t, hv, device=DEV)) * 0.5
        beta = torch.rand(t, hv, device=DEV).to(DT)
        pool = torch.randn(4 * n, hv, dk, dv, device=DEV) * 0.1
        pools = [pool.clone(), pool.clone()]
        ref_fn, fn = ((gd.gated_delta_rule_recurrent_ref, gd.gated_delta_rule_recurrent_triton) if length == 1 else
                      (gd.gated_delta_rule_chunk_ref, gd.gated_delta_rule_chunk_triton))
        exp = ref_fn(q, k, v, g, beta, pools[0], cu, slots, use_qk_l2norm=True)
        got = fn(q, k, v, g, beta, pools[1], cu, slots, use_qk_l2norm=True)
        err = max(rel_err(got, exp), rel_err(pools[1][slots], pools[0][slots]))
        ms = bench([lambda: fn(q, k, v, g, beta, pools[1], cu, slots, use_qk_l2norm=True)])
        moved = 2 * n * hv * dk * dv * 4 + t * (2 * hk * dk + 2 * hv * dv) * 2
        record(f"gated delta rule {'decode' if length == 1 else 'chunk'}", f"{n}x{length}x({hk},{hv})x{dk}", err,
               1e-2, ms, moved / ms / 1e6, "GB/s", bw)

        c = 2 * hk * dk + hv * dv
        x, w = torch.randn(t, c, device=DEV).to(DT), torch.randn(c, taps, device=DEV) * 0.5
        cpool = torch.randn(4 * n, taps - 1, c, device=DEV).to(DT)
        cpools = [cpool.clone(), cpool.clone()]
        exp = cc.causal_conv1d_ref(x, w, None, cpools[0], cu, slots, activation="silu")
        got = cc.causal_conv1d_triton(x, w, None, cpools[1], cu, slots, activation="silu")
        err = max(rel_err(got, exp), rel_err(cpools[1][slots], cpools[0][slots]))
        ms = bench([lambda: cc.causal_conv1d_triton(x, w, None, cpools[1], cu, slots, activation="silu")])
        record(f"causal conv {'decode' if length == 1 else 'chunk'}", f"{n}x{length}x{c}", err, 1e-2, ms,
               (2 * t * c + 2 * n * (taps - 1) * c) * 2 / ms / 1e6, "GB/s", bw)

        sx, sdt = torch.randn(t, sh, sp, device=DEV).to(DT), torch.randn(t, sh, device=DEV).to(DT)
        sB, sC = (torch.randn(t, 1, sn, device=DEV) * sn ** -0.5).to(DT), torch.randn(t, 1, sn, device=DEV).to(DT)
        sA, sD, sbias = -torch.rand(sh, device=DEV), torch.randn(sh, device=DEV), torch.randn(sh, device=DEV) * 0.5
        spool = torch.randn(4 * n, sh, sp, sn, device=DEV) * 0.1
        spools = [spool.clone(), spool.clone()]
        ref_fn, fn = ((ss.ssd_state_update_ref, ss.ssd_state_update_triton) if length == 1 else
                      (ss.ssd_chunk_scan_ref, ss.ssd_chunk_scan_triton))
        kw = dict(D=sD, dt_bias=sbias, dt_softplus=True)
        exp = ref_fn(sx, sdt, sA, sB, sC, spools[0], cu, slots, **kw)
        got = fn(sx, sdt, sA, sB, sC, spools[1], cu, slots, **kw)
        err = max(rel_err(got, exp), rel_err(spools[1][slots], spools[0][slots]))
        ms = bench([lambda: fn(sx, sdt, sA, sB, sC, spools[1], cu, slots, **kw)])
        moved = 2 * n * sh * sp * sn * 4 + t * (2 * sh * sp + 2 * sn) * 2
        record(f"mamba2 {'decode' if length == 1 else 'chunk'}", f"{n}x{length}x{sh}x{sp}x{sn}", err, 1e-2, ms,
               moved / ms / 1e6, "GB/s", bw)


def check_moes(ceil: dict) -> None:
    """Qwen3-30B-A3B's experts (128, top-8, hidden 2048, 768 each) and gpt-oss-20b's (32, top-4,
    2880 and 2880, clamped SwiGLU with biases); toy ones under the interpreter."""
    if TINY:
        check_moe("moe qwen3-like", 8, 2, 64, 32, "silu", False, (1, 3, 80), ceil)
        check_moe("moe gpt-oss-like", 4, 2, 48, 48, "swigluoai", True, (2, 70), ceil)
        return
    check_moe("moe qwen3-30b-a3b", 128, 8, 2048, 768, "silu", False, (1, 16, 4096), ceil)
    check_moe("moe gpt-oss-20b", 32, 4, 2880, 2880, "swigluoai", True, (1, 16, 2048), ceil)


def main() -> int:
    t0 = time.time()
    torch.manual_seed(0)
    dev_name = "CPU (Triton interpreter)" if TINY else torch.cuda.get_device_name(DEV)
    print(f"device: {dev_name}; torch {torch.__version__}; tiny={TINY}")
    ceil = measure_ceilings()
    # Kernels are called directly; on CPU, ops must be told to take Triton (the interpreter).
    with torch.inference_mode(), (ops.use_triton() if TINY else contextlib.nullcontext()):
        if wanted("small"):
            check_small_ops(ceil)
            check_write_kv(ceil)
        if wanted("attn"):
            check_attentions(ceil)
        if wanted("linear"):
            check_linears(ceil)
        if wanted("moe"):
            check_moes(ceil)
        if wanted("recurrent"):
            check_recurrent(ceil)
        if wanted("tiers"):
            check_kv_tiers()
    print_table()
    e2e = []
    if wanted("e2e"):
        model = random_model(model_config())
        e2e = [check_decode_step(model, b, c, ceil["copy_GBps"]) for b, c in (((1, 40), (3, 60)) if TINY else
                                                                              ((1, 1024), (32, 2048)))]
    print(f"\ntotal {time.time() - t0:.0f} s; {'all ok' if not FAILED else 'FAILED: ' + ', '.join(FAILED)}")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "gpu_check.json"
        out.write_text(json.dumps(dict(device=dev_name, torch=torch.__version__, tiny=TINY, ceilings=ceil,
                                       kernels=ROWS, decode_steps=e2e, failed=FAILED,
                                       tuned_configs=CONFIGS.all()), indent=1))
        print("wrote", out)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
