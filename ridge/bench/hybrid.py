"""`ridge bench hybrid`: a Qwen3.5-shaped hybrid against a dense model of equal parameters.

Three of every four Qwen3.5 layers are Gated DeltaNet: a request holds a fixed [Dk, Dv] state per
value head and a convolution window there, not a KV that grows with the context, so the hybrid's
decode step should barely grow from 1K to 32K tokens while the dense model's attention reads 4x
the KV at every layer. Three sections:

- decode tokens/s at 1 and 16 streams (short context), the models' steps interleaved;
- the decode step at 1K, 8K and 32K tokens of context, one stream, on models of the same layer
  shapes but `--context-layers` layers (a 32K prefill of all 24 dense layers is an hour of a
  2-core CPU's attention; the step's growth per layer is what the section shows);
- a request's cache bytes at 32K: KV for the attention layers plus, for the hybrid, its fixed
  recurrent states (ridge plan's arithmetic, ModelConfig.state_bytes_per_request).

Both are random, built by transformers (qwen3_5_text and a dense qwen3 whose MLP width makes its
parameter count equal), bf16 safetensors with a byte-level tokenizer, kept under
$XDG_CACHE_HOME/ridge/bench-hybrid keyed by shape, and loaded through ridge's loader. Default
shape: Qwen3.5-0.8B's layers (hidden 1024, 24 layers, 8 query and 2 KV heads of 256, 16 key and
16 value heads of 128 in the linear layers, MLP 3584), its 248,320-row vocabulary cut to --vocab."""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

SHAPE = dict(hidden=1024, layers=24, heads=8, kv_heads=2, head_dim=256, linear_key_heads=16, linear_value_heads=16,
             linear_head_dim=128, intermediate=3584, vocab=32768, full_every=4)


def add_hybrid_parser(sub, common) -> None:
    h = sub.add_parser("hybrid", help="a Qwen3.5-shaped hybrid against a dense model of equal parameters")
    common(h, workload=False)
    h.add_argument("--batches", default="1,16", help="pure-decode batch sizes (short context)")
    h.add_argument("--context", type=int, default=64, help="context tokens per request for --batches")
    h.add_argument("--contexts", default="1024,8192,32768", help="contexts of the one-stream step section")
    h.add_argument("--context-layers", type=int, default=4,
                   help="decoder layers of the models the context section runs (same layer shapes)")
    h.add_argument("--steps", type=int, default=12, help="timed steps per batch size or context")
    for key, value in SHAPE.items():
        h.add_argument(f"--{key.replace('_', '-')}", type=int, default=value, help=f"model shape (default {value})")


def _configs(shape: dict, layers: int) -> dict[str, dict]:
    """model_type -> config.json fields: the hybrid, then the dense model of equal parameters."""
    import torch
    import transformers

    common = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=layers,
                  num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                  head_dim=shape["head_dim"], max_position_embeddings=65536, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, rope_theta=10_000_000.0)
    types = ["full_attention" if (i + 1) % shape["full_every"] == 0 else "linear_attention" for i in range(layers)]
    hybrid = dict(common, intermediate_size=shape["intermediate"], layer_types=types,
                  linear_num_key_heads=shape["linear_key_heads"], linear_num_value_heads=shape["linear_value_heads"],
                  linear_key_head_dim=shape["linear_head_dim"], linear_value_head_dim=shape["linear_head_dim"],
                  linear_conv_kernel_dim=4, partial_rotary_factor=0.25)

    def count(model_type: str, fields: dict) -> int:
        with torch.device("meta"):
            m = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **fields))
        return sum(p.numel() for p in m.parameters())

    want = count("qwen3_5_text", hybrid)
    base = count("qwen3", dict(common, intermediate_size=64))
    per_unit = 3 * shape["hidden"] * layers  # one more MLP column in every layer
    width = max(64, round((want - base) / per_unit / 64) * 64 + 64)
    return {"qwen3_5_text": hybrid, "qwen3": dict(common, intermediate_size=width)}


def write_models(shape: dict, layers: int, root: Path | None = None) -> dict[str, Path]:
    """model_type -> its checkpoint directory, written once per shape and depth (reused after)."""
    import hashlib

    import torch
    import transformers

    from .window import write_byte_tokenizer

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = root or Path(base) / "ridge" / "bench-hybrid"
    key = hashlib.sha256(json.dumps([shape, layers], sort_keys=True).encode()).hexdigest()[:12]
    dirs = {}
    for model_type, fields in _configs(shape, layers).items():
        d = root / f"{model_type}-{key}"
        if not (d / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=d.name + ".", dir=root if root.is_dir() else None))
            torch.manual_seed(0)
            cfg = transformers.AutoConfig.for_model(model_type, **fields)
            transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(str(tmp))
            write_byte_tokenizer(tmp)
            root.mkdir(parents=True, exist_ok=True)
            tmp.rename(d)
        dirs[model_type] = d
    return dirs


def checkpoint_params(d: Path) -> int:
    """Every parameter the checkpoint holds (norms, convolutions and the attention's output gate
    included), from the safetensors headers."""
    from safetensors import safe_open

    total = 0
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                total += math.prod(st.get_slice(name).get_shape())
    return total


def _load(args, dirs: dict[str, Path], max_num_seqs: int, kv_gib: float) -> tuple[dict, dict]:
    """name -> engine and name -> the model's facts; each at the same thread count."""
    import torch

    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine
    from ridge.models.loader import load_model

    from .runs import warm_up

    threads = torch.get_num_threads()
    engines, info = {}, {}
    for name, d in zip(("hybrid", "dense"), (dirs["qwen3_5_text"], dirs["qwen3"])):
        torch.set_num_threads(threads)
        loaded = load_model(d, device=args.device, weights=args.weights, show_progress=False)
        cfg = replace(engine_config(args), model=str(d), max_num_seqs=max_num_seqs, kv_disk=False, kv_host_gib=0,
                      kv_memory_gib=kv_gib, max_model_len=4096)
        engines[name] = LLMEngine(cfg, loaded=loaded)
        warm_up(engines[name])
        info[name] = {"path": str(d), "params": checkpoint_params(d), "weight_bytes": loaded.weight_bytes,
                      "config": loaded.config}
    return engines, info


def request_bytes(cfg, kv_dtype: str, context: int) -> dict:
    """A request's cache at `context` tokens: KV of the attention layers, the recurrent states."""
    from ridge.config import kv_bytes_per_token

    kv = kv_bytes_per_token(cfg, kv_dtype) * context
    state = cfg.state_bytes_per_request()
    return {"kv_bytes": kv, "state_bytes": state, "total_bytes": kv + state}


def _throughput(args, rep, shape: dict) -> dict:
    from .moe import time_batch

    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    t0 = time.perf_counter()
    dirs = write_models(shape, shape["layers"])
    write_s = time.perf_counter() - t0
    # The pool holds the hybrid's state slots too (its prefix checkpoints among them), tens of MiB each.
    engines, info = _load(args, dirs, max(batches), 3.0)
    rep.set_env(engines["hybrid"])
    rows = []
    for b in batches:
        r = time_batch(engines, b, args.context, args.steps, args.retries)
        hy, de = r["step_s"]["hybrid"], r["step_s"]["dense"]
        rows.append({"batch": b, "hybrid_step_ms": 1e3 * hy, "dense_step_ms": 1e3 * de, "hybrid_tok_s": b / hy,
                     "dense_tok_s": b / de, "ratio": de / hy, "cpu_util": r["cpu_util"], "tries": r["tries"]})
    kv_dtype = engines["hybrid"].config.resolved_kv_dtype(engines["hybrid"].device)
    memory = {name: request_bytes(v.pop("config"), kv_dtype, 32768) for name, v in info.items()}
    del engines
    hi, di = info["hybrid"], info["dense"]
    rep.add("hybrid", {"shape": shape, "models": info, "write_s": write_s, "rows": rows, "kv_dtype": kv_dtype,
                       "memory_32k": memory})
    rep.table(f"decode: qwen3_5_text {hi['params'] / 1e9:.3f}B ({shape['layers']} layers, 1 full in "
              f"{shape['full_every']}) against dense qwen3 {di['params'] / 1e9:.3f}B, {args.weights} weights, "
              f"context {args.context} (medians)",
              ["batch", "hybrid ms", "hybrid tok/s", "dense ms", "dense tok/s", "hybrid / dense", "cpu util"],
              [[r["batch"], f"{r['hybrid_step_ms']:.1f}", f"{r['hybrid_tok_s']:.1f}", f"{r['dense_step_ms']:.1f}",
                f"{r['dense_tok_s']:.1f}", f"{r['ratio']:.2f}", f"{r['cpu_util']:.2f}"] for r in rows],
              note="hybrid / dense: tok/s ratio; parameters: every tensor of each checkpoint")
    rep.table(f"a request's cache at 32,768 tokens, {kv_dtype} KV (MiB)",
              ["model", "KV", "recurrent states", "total", "x dense"],
              [[name, f"{m['kv_bytes'] / 2**20:.1f}", f"{m['state_bytes'] / 2**20:.1f}",
                f"{m['total_bytes'] / 2**20:.1f}", f"{m['total_bytes'] / memory['dense']['total_bytes']:.3f}"]
               for name, m in memory.items()],
              note="the states are fp32 and the same size at any context; KV grows with it")
    return memory


def _contexts(args, rep, shape: dict) -> None:
    from ridge.config import kv_bytes_per_token
    from ridge.models.registry import read_config

    from .window import run_contexts

    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    dirs = write_models(shape, args.context_layers)
    pad = 4 * args.steps + 256
    sections = {}
    for name, d in (("hybrid", dirs["qwen3_5_text"]), ("dense", dirs["qwen3"])):
        per_token = kv_bytes_per_token(read_config(d), "fp32")
        engines, loaded = {}, None
        for ctx in contexts:
            gib = 0.5 + 2 * (ctx + pad) * per_token / 2 ** 30  # + the state slots
            engines[ctx] = _context_engine(args, d, loaded, gib, max(contexts) + pad)
            loaded = engines[ctx].loaded
        sections[name] = run_contexts(engines, 1, args.steps, args.retries)
        del engines, loaded
    rep.add("hybrid_contexts", {"layers": args.context_layers, "contexts": contexts, "rows": sections})
    rep.table(f"decode step against context, one stream, {args.context_layers}-layer models of the same layer "
              f"shapes, {args.weights} weights (medians, ms)",
              ["context", "hybrid ms", "x first", "dense ms", "x first", "dense / hybrid"],
              [[c, f"{h['step_ms']:.1f}", f"{h['step_vs_first']:.2f}", f"{d['step_ms']:.1f}",
                f"{d['step_vs_first']:.2f}", f"{d['step_ms'] / h['step_ms']:.2f}"]
               for c, h, d in zip(contexts, sections["hybrid"], sections["dense"])],
              note="x first: against the first context; the hybrid's attention runs on 1 layer in "
                   f"{shape['full_every']}, its linear layers' step is the same at any context")


def _context_engine(args, d: Path, loaded, gib: float, max_model_len: int):
    """An engine of one stream and a pool of `gib` on the model (loaded once, shared)."""
    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine
    from ridge.models.loader import load_model

    from .runs import warm_up

    if loaded is None:
        loaded = load_model(d, device=args.device, weights=args.weights, show_progress=False)
    cfg = replace(engine_config(args), model=str(d), max_num_seqs=1, kv_disk=False, kv_host_gib=0,
                  kv_memory_gib=gib, max_model_len=max_model_len)
    engine = LLMEngine(cfg, loaded=loaded)
    warm_up(engine, n=1)
    return engine


def run_hybrid(args, rep) -> None:
    shape = {k: getattr(args, k) for k in SHAPE}
    if shape["layers"] % shape["full_every"] or args.context_layers % shape["full_every"]:
        raise ValueError(f"--layers and --context-layers must be multiples of --full-every {shape['full_every']}")
    if args.batches.strip():
        _throughput(args, rep, shape)
    if args.contexts.strip():
        _contexts(args, rep, shape)
