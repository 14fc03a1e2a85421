"""`ridge plan`: KV-cache bytes per token and the hardware ridge point, as a tool.

Pure Python on purpose: planning must work on a machine without torch or a GPU.
"""
from __future__ import annotations

import argparse

import re
import sys
from dataclasses import dataclass, replace

from ridge.config import ModelShape, kv_bytes_per_request, kv_bytes_per_token, sliding_blocks_held
from ridge.options import Option

GIB = 2**30
# Bytes per parameter of each `--weights` (EngineConfig.weights, the option's one declaration):
# e4m3 (its per-channel scales are negligible), or the source's values in bf16 or fp32.
WEIGHT_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class GPUSpec:
    # memory_gib is the vendor's nominal capacity (NVIDIA's "GB" is binary-sized DRAM);
    # usable memory is a little less, so local_device_spec() substitutes the measured figure.
    name: str
    memory_gib: float
    bandwidth_gbs: float
    bf16_tflops: float
    fp8_tflops: float | None
    consumer: bool

    def ridge_point(self, dtype: str = "bf16") -> float:
        """Peak FLOP/s over bytes/s: below this many FLOPs per byte read, a kernel is bandwidth-bound."""
        if dtype not in ("bf16", "fp16", "fp8"):
            raise ValueError(f"unknown dtype {dtype!r}; use bf16, fp16 or fp8")
        tflops = self.fp8_tflops if dtype == "fp8" else self.bf16_tflops
        if tflops is None:
            raise ValueError(f"{self.name} has no FP8 tensor cores")
        return tflops * 1e12 / (self.bandwidth_gbs * 1e9)


# Dense (no 2:4 sparsity) tensor throughput. GeForce cards run BF16/FP16 with FP32 accumulate
# at half the FP16-accumulate rate, and real kernels accumulate in FP32, so that is the figure used.
GPUS: dict[str, GPUSpec] = {
    # GA102 whitepaper / RTX Blackwell whitepaper Table 3: BF16 FP32-acc 71.2/142.4; 936 GB/s.
    "rtx-3090": GPUSpec("RTX 3090", 24, 936, 71.2, None, True),
    # Ada whitepaper v2.02 App. A: BF16 FP32-acc 165.2/330.4, FP8 FP32-acc 330.3/660.6; 1008 GB/s.
    "rtx-4090": GPUSpec("RTX 4090", 24, 1008, 165.2, 330.3, True),
    # RTX Blackwell whitepaper Table 3: BF16 FP32-acc 209.5/419, FP8 FP32-acc 419/838; 1792 GB/s.
    # (A 5060 Ti measurement suggests cuBLASLt FP8 reaches the 2x FP16-acc tier: treat as a floor.)
    "rtx-5090": GPUSpec("RTX 5090", 32, 1792, 209.5, 419.0, True),
    # RTX A6000 datasheet / GA102 whitepaper: BF16 154.8/309.7 (no FP32-acc halving); 768 GB/s.
    "rtx-a6000": GPUSpec("RTX A6000", 48, 768, 154.8, None, False),
    # RTX 6000 Ada datasheet: FP8 1457 sparse -> 728.5 dense; BF16 364.2/728.5; 960 GB/s.
    "rtx-6000-ada": GPUSpec("RTX 6000 Ada", 48, 960, 364.2, 728.5, False),
    # L4 datasheet: BF16 242 and FP8 485 are with sparsity -> 121 / 242.5 dense; 300 GB/s.
    "l4": GPUSpec("L4", 24, 300, 121.0, 242.5, False),
    # L40S datasheet: BF16 362.05/733, FP8 733/1466; 864 GB/s.
    "l40s": GPUSpec("L40S", 48, 864, 362.05, 733.0, False),
    # A100 datasheet: BF16 312/624; 80GB SXM 2039 GB/s. Ampere: no FP8.
    "a100-80gb": GPUSpec("A100 80GB SXM", 80, 2039, 312.0, None, False),
    # H100 whitepaper/datasheet: BF16 989.4/1979, FP8 1978.9/3958; SXM5 3.35 TB/s.
    "h100-sxm": GPUSpec("H100 SXM", 80, 3350, 989.4, 1978.9, False),
    # H200 datasheet: same GH100 compute as H100 SXM; 141 GB HBM3e at 4.8 TB/s.
    "h200": GPUSpec("H200", 141, 4800, 989.4, 1978.9, False),
}

# A name matches a row when it has all `need` tokens and no `avoid` token. The avoids keep
# look-alikes with different figures (H100 PCIe/NVL, A100 40GB/PCIe, 4090 D, laptops) unmatched.
_DEVICE_RULES = {
    "rtx-3090": ({"3090"}, {"ti", "laptop"}), "rtx-4090": ({"4090"}, {"d", "laptop"}),
    "rtx-5090": ({"5090"}, {"d", "laptop"}), "rtx-a6000": ({"a6000"}, set()),
    "rtx-6000-ada": ({"6000", "ada"}, set()), "l4": ({"l4"}, set()), "l40s": ({"l40s"}, set()),
    "a100-80gb": ({"a100"}, {"pcie", "40gb"}), "h100-sxm": ({"h100"}, {"pcie", "nvl"}),
    "h200": ({"h200"}, {"nvl"}),
}


def _squash(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def get_gpu(name: str) -> GPUSpec:
    """Look a card up by a forgiving name: "4090", "rtx-4090", "RTX 4090", "h100" all work."""
    exact = [g for k, g in GPUS.items() if _squash(name) in (_squash(k), _squash(g.name))]
    spec = exact[0] if exact else match_device_name(name)
    if spec is None:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return spec


def match_device_name(device_name: str) -> GPUSpec | None:
    """The row a name such as torch's "NVIDIA H100 80GB HBM3" denotes, or None."""
    tokens = set(re.findall(r"[a-z0-9]+", device_name.lower()))
    for key, (need, avoid) in _DEVICE_RULES.items():
        if need <= tokens and not avoid & tokens:
            return GPUS[key]
    return None


def _local_cuda() -> tuple[str, float] | None:
    try:
        import torch  # lazy: the rest of the module must work without torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / GIB


def local_device_spec() -> GPUSpec | None:
    """The table row for CUDA device 0, with its measured memory; None if absent or unknown."""
    local = _local_cuda()
    spec = match_device_name(local[0]) if local else None
    return replace(spec, memory_gib=round(local[1], 2)) if spec else None


def kv_tokens_that_fit(memory_bytes: float, bytes_per_token: int) -> int:
    return max(0, int(memory_bytes // bytes_per_token))


def concurrent_requests(tokens: int, context_len: int) -> int:
    return tokens // context_len


def token_budget_knee(ridge_point: float, bytes_per_weight: float) -> float:
    """T*: tokens per step at which the weight GEMMs stop being bandwidth-bound.

    A step over T tokens does ~2*T*P FLOPs (a multiply-add per weight per token) while
    reading the P*b bytes of weights once, so its intensity is 2T/b FLOP/byte; it reaches
    the ridge point at T* = ridge * b / 2. Below T* extra tokens in a step are nearly free,
    which is why batching and chunked-prefill budgets are sized against it. KV-cache reads
    are per-sequence and not amortised, so long-context decode turns compute-bound later.
    """
    return ridge_point * bytes_per_weight / 2


def moe_token_budget_knee(shape: ModelShape, ridge_point: float, bytes_per_weight: float) -> float:
    """T* for a mixture of experts: a step of T tokens does 2*T*P_active FLOPs but reads only the
    experts its tokens route to (ModelShape.params_read), so its intensity 2*T*P_active /
    (params_read(T) * b) grows faster than a dense model's at small T and reaches the ridge
    point later: where it does, found by bisection (params_read tends to every parameter, so it
    does). For a dense shape this is token_budget_knee."""
    active = shape.num_active_params

    def intensity(t: float) -> float:
        return 2 * t * active / (shape.params_read(t) * bytes_per_weight)

    lo, hi = 0.0, 1.0
    while intensity(hi) < ridge_point:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if intensity(mid) < ridge_point else (lo, mid)
    return hi


@dataclass
class MoERow:
    """What a decode step reads from a mixture of experts' weights, at batch 1 and at `batch`."""
    total_params: int
    active_params: int
    batch: int
    experts_touched: float  # per MoE layer, at `batch` (E * (1 - (1 - k/E)^batch))
    bytes_per_token_1: float  # weight bytes a one-token step reads
    bytes_per_token_batch: float  # a `batch`-token step's weight bytes, per token


def moe_row(m: ModelShape, weights: str, batch: int) -> MoERow | None:
    if not m.num_experts or m.num_params is None:
        return None
    b = WEIGHT_BYTES[weights]
    return MoERow(m.num_params, m.num_active_params, batch, m.experts_touched(batch), m.params_read(1) * b,
                  m.params_read(batch) * b / batch)


@dataclass
class KVRow:
    dtype: str
    bytes_per_token: int  # every layer's (the seed's formula)
    tokens: int | None  # of context, at the plan's context length
    requests: int | None
    bytes_per_request: int  # at the plan's context: a sliding layer's KV at most its window's blocks

    @property
    def kib_per_token(self) -> float:
        return self.bytes_per_token / 1024


@dataclass
class Plan:
    model: ModelShape
    context_len: int
    gpu: GPUSpec | None
    memory_bytes: float | None
    weight_bytes: float | None
    kv_memory_bytes: float | None
    rows: list[KVRow]
    ridge: dict[str, float]  # math dtype -> FLOP/byte
    knees: dict[str, float]  # "weights, math" -> T*
    notes: list[str]
    weights: str  # what the weights are held in (WEIGHT_BYTES)
    block_size: int  # the KV block (`--block-size`), the unit a sliding layer holds its window in
    moe: MoERow | None = None  # a mixture of experts' weight reads per decode token


def _kv_budget(memory: float | None, weight_bytes: float | None) -> tuple[float | None, list[str]]:
    if memory is None:
        return None, []
    notes = [] if weight_bytes is not None else ["weight size unknown: not subtracted from memory"]
    kv_memory = memory - (weight_bytes or 0)
    if kv_memory <= 0:
        notes.append("weights do not fit in memory")
    return kv_memory, notes + ["upper bound: activations and runtime overhead not reserved"]


def _kv_rows(m: ModelShape, kv_memory: float | None, context_len: int, block_size: int) -> list[KVRow]:
    """Requests at context_len that fit, each holding every full layer's KV for its context and
    each sliding layer's for its window (kv_bytes_per_request); for a model of full layers,
    tokens // context_len."""
    rows = []
    for label, kv_dtype in (("fp16/bf16", "bf16"), ("fp8", "fp8")):
        bpt = kv_bytes_per_token(m, kv_dtype)
        per_request = kv_bytes_per_request(m, kv_dtype, context_len, block_size)
        tokens = reqs = None
        if kv_memory is not None:
            tokens = kv_tokens_that_fit(kv_memory * context_len, per_request)
            reqs = concurrent_requests(tokens, context_len)
        rows.append(KVRow(label, bpt, tokens, reqs, per_request))
    return rows


def _ridge_and_knees(spec: GPUSpec, shape: ModelShape) -> tuple[dict[str, float], dict[str, float]]:
    moe = shape.num_experts and shape.num_params is not None

    def knee(r: float, b: float) -> float:
        return moe_token_budget_knee(shape, r, b) if moe else token_budget_knee(r, b)

    ridge = {"bf16": spec.ridge_point("bf16")}
    knees = {"bf16 weights, bf16 math": knee(ridge["bf16"], 2)}
    if spec.fp8_tflops is not None:
        ridge["fp8"] = spec.ridge_point("fp8")
        knees["fp8 weights, fp8 math"] = knee(ridge["fp8"], 1)
    else:  # weight-only FP8: half the bytes, but the math still runs at the bf16 rate
        knees["fp8 weights, bf16 math"] = knee(ridge["bf16"], 1)
    return ridge, knees


def make_plan(model_shape: ModelShape, memory_gib: float | None = None,
              gpu: GPUSpec | str | None = None, context_len: int = 4096,
              weight_bytes: float | None = None, *, weights: str, block_size: int, batch: int = 16) -> Plan:
    """weights: what `--weights` holds (WEIGHT_BYTES), which sizes the weights from the parameter
    count unless weight_bytes gives their size; block_size: the engine's KV block; batch: the
    decode batch a mixture of experts' weight reads are counted at (beside batch 1)."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if memory_gib is None and spec is not None:
        memory_gib = spec.memory_gib
    memory = memory_gib * GIB if memory_gib is not None else None
    if weight_bytes is None and model_shape.num_params is not None:
        weight_bytes = float(model_shape.num_params * WEIGHT_BYTES[weights])
    kv_memory, notes = _kv_budget(memory, weight_bytes)
    ridge, knees = _ridge_and_knees(spec, model_shape) if spec else ({}, {})
    rows = _kv_rows(model_shape, kv_memory, context_len, block_size)
    m = model_shape
    if m.sliding_layers:
        held = min(sliding_blocks_held(m.sliding_window, block_size) * block_size, context_len)
        notes.append(f"{m.sliding_layers} sliding layers (window {m.sliding_window}) hold {held} tokens of KV each "
                     f"at context {context_len}: min(window + block, context); bytes/token counts every layer")
    if m.state_layers:
        notes.append(f"{m.state_layers} of {m.num_layers} layers are linear attention (Gated DeltaNet), Mamba2 or "
                     f"short convolutions: no KV, "
                     f"{m.state_bytes_per_request / 1024:.1f} KiB of recurrent state per request at any context, "
                     f"counted in bytes/request; bytes/token counts the {m.num_kv_layers} attention layers")
    return Plan(model_shape, context_len, spec, memory, weight_bytes, kv_memory, rows, ridge, knees, notes, weights,
                block_size, moe_row(m, weights, batch))


def format_plan(plan: Plan) -> str:
    m = plan.model
    params = f", {m.num_params / 1e9:.1f}B params" if m.num_params else ""
    sliding = f" ({m.sliding_layers} sliding over {m.sliding_window})" if m.sliding_layers else ""
    out = [f"model {m.name}: {m.num_layers} layers{sliding}, {m.num_kv_heads} KV heads, head_dim {m.head_dim}{params}"]
    if g := plan.gpu:
        out.append(f"gpu   {g.name}: {g.memory_gib:g} GiB, {g.bandwidth_gbs:g} GB/s, "
                   f"{g.bf16_tflops:g} TFLOPS bf16")
    if plan.kv_memory_bytes is not None:
        w = f"{plan.weight_bytes / GIB:.1f}" if plan.weight_bytes is not None else "?"
        kv = max(plan.kv_memory_bytes, 0) / GIB
        out.append(f"memory {plan.memory_bytes / GIB:.1f} GiB - {plan.weights} weights {w} GiB = KV {kv:.1f} GiB")
    if e := plan.moe:
        out.append(f"moe   {m.num_experts} experts, {m.experts_per_tok} a token, in {m.moe_layers} layers: "
                   f"{e.total_params / 1e9:.2f}B params, {e.active_params / 1e9:.2f}B active a token")
        out.append(f"      {plan.weights} weights read per decode token: batch 1 {e.bytes_per_token_1 / GIB:.3f} GiB; "
                   f"batch {e.batch} {e.bytes_per_token_batch / GIB:.3f} GiB ({e.experts_touched:.1f} of "
                   f"{m.num_experts} experts a layer touched)")
    out.append("")
    reqs_at = f"reqs @{plan.context_len}"
    out.append(f"{'KV dtype':<10} {'bytes/token':>12} {'KiB/token':>10} {'tokens fit':>12} {reqs_at:>11}")
    for r in plan.rows:
        tokens, reqs = (f"{x:,}" if x is not None else "-" for x in (r.tokens, r.requests))
        out.append(f"{r.dtype:<10} {r.bytes_per_token:>12,} {r.kib_per_token:>10.1f} {tokens:>12} {reqs:>11}")
    if plan.ridge:
        out.append("")
        out.append("ridge point: " + ", ".join(f"{k} {v:.0f} FLOP/byte" for k, v in plan.ridge.items()))
        out.append("T* (tokens/step where weight GEMMs turn compute-bound):")
        out.extend(f"  {k}: {v:.0f}" for k, v in plan.knees.items())
    out.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(out)


def format_gpu_table() -> str:
    out = [f"{'key':<13} {'name':<14} {'GiB':>5} {'GB/s':>6} {'bf16 TF':>8} {'fp8 TF':>7} "
           f"{'ridge bf16':>10} {'ridge fp8':>9}"]
    for key, g in GPUS.items():
        fp8 = f"{g.fp8_tflops:g}" if g.fp8_tflops else "-"
        r8 = f"{g.ridge_point('fp8'):.0f}" if g.fp8_tflops else "-"
        out.append(f"{key:<13} {g.name:<14} {g.memory_gib:>5g} {g.bandwidth_gbs:>6g} {g.bf16_tflops:>8g} "
                   f"{fp8:>7} {g.ridge_point('bf16'):>10.0f} {r8:>9}")
    return "\n".join(out)


def _count(text: str) -> int:
    """Parameter counts as people write them: 70e9, 70B, 7.6b, 8000000000."""
    t = text.strip().lower()
    scale = {"b": 1e9, "m": 1e6}.get(t[-1:], 1)
    return int(float(t.rstrip("bm")) * scale)


def add_plan_parser(subparsers, read_model_shape, weights: Option, block_size: Option) -> None:
    """read_model_shape(path) -> ModelShape reads a model file's metadata; weights and block_size
    are the engine's `--weights` and `--block-size` options. They are passed in because they live
    above this module (and bring torch)."""
    p = subparsers.add_parser("plan", help="KV-cache and ridge-point arithmetic for a model on a GPU")
    p.add_argument("model_path", nargs="?", help="a .gguf file or a Hugging Face model directory")
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--params", type=_count, help="parameter count, e.g. 70e9 or 70B")
    p.add_argument("--sliding-window", type=int, help="the sliding layers' window (with --sliding-layers)")
    p.add_argument("--sliding-layers", type=int, help="how many of the layers slide over --sliding-window")
    p.add_argument("--experts", type=int, help="a mixture of experts: experts per MoE layer")
    p.add_argument("--experts-per-tok", type=int, help="the experts each token is routed to (with --experts)")
    p.add_argument("--expert-params", type=_count, help="one expert's parameters (with --experts)")
    p.add_argument("--moe-layers", type=int, help="how many layers are MoE (default: every layer, with --experts)")
    p.add_argument("--batch", type=int, default=16, help="the decode batch a mixture of experts' reads are counted at")
    p.add_argument("--gpu", help="a name from --list-gpus, or 'local' for CUDA device 0")
    p.add_argument("--memory-gib", type=float)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--list-gpus", action="store_true")
    p.add_argument("--image", action="append", type=_image_size, default=[], metavar="WxH",
                   help="count an image of this size in the prompt (its tokens by the model's own rules); repeatable")
    weights.add_to(p)  # the weights' bytes per parameter, as `ridge serve --weights` would hold them
    block_size.add_to(p)  # the unit a sliding layer's window is held in
    p.set_defaults(func=run_plan, read_model_shape=read_model_shape)


def _shape_from_args(args) -> ModelShape:
    if args.model_path:
        if args.read_model_shape is None:
            raise ValueError("reading a MODEL_PATH needs ridge's model loaders; give --layers, --kv-heads, --head-dim")
        shape = args.read_model_shape(args.model_path)
    elif None in (args.layers, args.kv_heads, args.head_dim):
        raise ValueError("give a MODEL_PATH or all of --layers, --kv-heads, --head-dim")
    else:
        shape = ModelShape("custom", args.layers, args.kv_heads, args.head_dim)
    overrides = {"num_layers": args.layers, "num_kv_heads": args.kv_heads,
                 "head_dim": args.head_dim, "num_params": args.params,
                 "sliding_window": args.sliding_window, "sliding_layers": args.sliding_layers}
    shape = replace(shape, **{k: v for k, v in overrides.items() if v is not None})
    if shape.sliding_layers and (shape.sliding_window is None or shape.sliding_layers > shape.num_layers):
        raise ValueError("--sliding-layers needs --sliding-window, and at most --layers of them")
    return _moe_from_args(shape, args)


def _moe_from_args(shape: ModelShape, args) -> ModelShape:
    moe = {"num_experts": args.experts, "experts_per_tok": args.experts_per_tok, "expert_params": args.expert_params,
           "moe_layers": args.moe_layers}
    shape = replace(shape, **{k: v for k, v in moe.items() if v is not None})
    if args.experts and not args.moe_layers and not shape.moe_layers:
        shape = replace(shape, moe_layers=shape.num_layers)
    if shape.num_experts and not (0 < shape.experts_per_tok <= shape.num_experts and shape.expert_params
                                  and 0 < shape.moe_layers <= shape.num_layers):
        raise ValueError("a mixture of experts needs --experts-per-tok (at most --experts), --expert-params and at "
                         "most --layers MoE layers")
    if shape.num_experts and shape.num_params is not None and shape.num_active_params <= 0:
        raise ValueError("--params must count every expert's parameters")
    if args.batch < 1:
        raise ValueError("--batch must be at least 1")
    return shape


def _gpu_from_args(args) -> GPUSpec | None:
    if args.gpu != "local":
        return get_gpu(args.gpu) if args.gpu else None
    spec = local_device_spec()
    if spec is None:
        raise ValueError("--gpu local: no CUDA device, or one not in the table; use --memory-gib")
    return spec


def _image_size(text: str) -> tuple[int, int]:
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or not int(w) or not int(h):
        raise argparse.ArgumentTypeError(f"{text!r}: expected WIDTHxHEIGHT, e.g. 896x896")
    return int(w), int(h)


def image_tokens(model_path, sizes: list[tuple[int, int]]) -> str:
    """The prompt tokens each image of `sizes` takes in this model (its directory's rules,
    ridge/vision/prompt.py), as a line of the plan."""
    from ridge.vision.prompt import read_prompt_rules

    rules = read_prompt_rules(model_path) if model_path else None
    if rules is None:
        raise ValueError("--image: this model takes no image input (its directory has no image processor)")
    counts = [rules.num_image_tokens(h, w) for w, h in sizes]
    each = ", ".join(f"{w}x{h}: {n}" for (w, h), n in zip(sizes, counts))
    return f"images: {sum(counts)} prompt tokens ({each})"


def run_plan(args) -> int:
    if args.list_gpus:
        print(format_gpu_table())
        return 0
    try:
        gpu, shape = _gpu_from_args(args), _shape_from_args(args)
        images = image_tokens(args.model_path, args.image) if args.image else None
    except (ValueError, OSError) as e:  # bad flags, unknown GPU, unreadable model path
        print(f"ridge plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(make_plan(shape, args.memory_gib, gpu, args.context, weights=args.weights,
                                block_size=args.block_size, batch=args.batch)))
    if images:
        print(images)
    return 0
