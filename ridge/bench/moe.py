"""`ridge bench moe`: a mixture of experts' decode against a dense model of its active size.

Decode is bound by the bytes a step reads. A one-token step of a mixture of experts reads its
dense part and k of the E experts in each layer: about what a dense model of the same active
parameters reads, so it should decode about as fast. A step of B tokens touches
E * (1 - (1 - k/E)^B) experts a layer (uniform routing), so at batch 16 it reads much more
than the dense model and falls behind it; `ridge plan` gives the same arithmetic.

Both models are random and Qwen3-shaped (qwen3_moe and its dense qwen3 twin: the same
attention, embeddings and layers, a dense MLP of k * moe_intermediate_size), written as FP8
checkpoints (e4m3 with a scale per output channel, the experts one tensor each as Hugging Face
ships them) so that loading skips the quantizer's search, and loaded through ridge's loader
(kept under $XDG_CACHE_HOME/ridge/bench-moe, keyed by shape, for the next run). Each batch size
is a fixture of pure-decode requests on each engine, the two models' steps interleaved."""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

SHAPE = dict(hidden=1024, layers=16, heads=16, kv_heads=4, head_dim=64, experts=32, top_k=4, moe_inter=512,
             vocab=32768)


def add_moe_parser(sub, common) -> None:
    m = sub.add_parser("moe", help="a random Qwen3-MoE-shaped model against a dense one of its active size (decode)")
    common(m, workload=False)
    m.add_argument("--batches", default="1,16", help="pure-decode batch sizes")
    m.add_argument("--context", type=int, default=64, help="context tokens per request")
    m.add_argument("--steps", type=int, default=12, help="timed steps per batch size")
    for key, value in SHAPE.items():
        m.add_argument(f"--{key.replace('_', '-')}", type=int, default=value, help=f"model shape (default {value})")


def _configs(shape: dict) -> dict[str, dict]:
    """model_type -> config.json fields of the two models."""
    common = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                  num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                  max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    return {"qwen3_moe": dict(common, intermediate_size=shape["top_k"] * shape["moe_inter"],
                              num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                              moe_intermediate_size=shape["moe_inter"], norm_topk_prob=True),
            "qwen3": dict(common, intermediate_size=shape["top_k"] * shape["moe_inter"])}


def _fp8(w):
    """A float [N, K] -> (e4m3, its per-row scale [N, 1]): absmax scaling (the model is random)."""
    import torch

    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    return (w / scale).to(torch.float8_e4m3fn), scale.float()


def _tensors(model_type: str, c: dict, gen) -> dict:
    """The checkpoint's tensors, Hugging Face names: the linear layers FP8 with weight_scale."""
    import torch

    H, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (torch.randn(c["vocab_size"], H, generator=gen) * 0.02).bfloat16(),
           "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}

    def linear(name: str, rows: int, cols: int) -> None:
        out[name + ".weight"], out[name + ".weight_scale"] = _fp8(torch.randn(rows, cols, generator=gen) * 0.02)

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm, n in (("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.q_norm", hd),
                        ("self_attn.k_norm", hd)):
            out[p + norm + ".weight"] = torch.ones(n, dtype=torch.bfloat16)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            linear(p + "self_attn." + name, rows, H)
        linear(p + "self_attn.o_proj", H, q)
        if model_type == "qwen3_moe":
            out[p + "mlp.gate.weight"] = (torch.randn(c["num_experts"], H, generator=gen) * 0.02).bfloat16()
            for e in range(c["num_experts"]):
                x = f"{p}mlp.experts.{e}."
                linear(x + "gate_proj", c["moe_intermediate_size"], H)
                linear(x + "up_proj", c["moe_intermediate_size"], H)
                linear(x + "down_proj", H, c["moe_intermediate_size"])
        else:
            for name, rows, cols in (("gate_proj", c["intermediate_size"], H), ("up_proj", c["intermediate_size"], H),
                                     ("down_proj", H, c["intermediate_size"])):
                linear(p + "mlp." + name, rows, cols)
    return out


def write_models(shape: dict, root: Path | None = None) -> dict[str, Path]:
    """model_type -> its checkpoint directory, written once per shape (reused after)."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    from .window import write_byte_tokenizer

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = root or Path(base) / "ridge" / "bench-moe"
    key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    dirs = {}
    for model_type, c in _configs(shape).items():
        d = root / f"{model_type}-{key}"
        if not (d / "config.json").is_file():
            tmp = d.with_name(d.name + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            save_file(_tensors(model_type, c, torch.Generator().manual_seed(0)), str(tmp / "model.safetensors"))
            write_byte_tokenizer(tmp)
            (tmp / "config.json").write_text(json.dumps({"model_type": model_type, **c}))
            tmp.rename(d)
        dirs[model_type] = d
    return dirs


def time_batch(engines: dict, batch: int, context: int, steps: int, retries: int) -> dict:
    """name -> the median pure-decode step (s) at `batch`, the engines' steps interleaved."""
    from .decode import DecodeFixture, interleaved_steps

    fixtures = {name: DecodeFixture(e, batch, context, f"moe-{name}-{batch}", steps * (2 + retries) + 16)
                for name, e in engines.items()}
    try:
        times, util, tries = interleaved_steps(fixtures, steps, retries, warm=3)
    finally:
        for fx in fixtures.values():
            fx.close()
    return {"step_s": {name: statistics.median(t) for name, t in times.items()}, "cpu_util": util, "tries": tries}


def run_moe(args, rep) -> None:
    import torch

    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine
    from ridge.models.loader import load_model
    from ridge.plan import WEIGHT_BYTES

    from .runs import warm_up

    shape = {k: getattr(args, k) for k in SHAPE}
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    t0 = time.perf_counter()
    dirs = write_models(shape)
    write_s = time.perf_counter() - t0
    engines, info = {}, {}
    threads = torch.get_num_threads()
    for name, d in (("moe", dirs["qwen3_moe"]), ("dense", dirs["qwen3"])):
        # Each engine chooses its CPU formats at the same thread count (the first one's warm-up
        # may have let the thread governor shrink the team), so that both run what one machine picks.
        torch.set_num_threads(threads)
        loaded = load_model(d, device=args.device, weights=args.weights, use_cache=False, show_progress=False)
        cfg = replace(engine_config(args), model=str(d), max_num_seqs=max(batches), kv_disk=False, kv_host_gib=0,
                      kv_memory_gib=0.5)
        engines[name] = LLMEngine(cfg, loaded=loaded)
        warm_up(engines[name])
        s = loaded.config.shape()
        info[name] = {"path": str(d), "total_params": s.num_params, "active_params": s.num_active_params,
                      "weight_bytes": loaded.weight_bytes, "shape": s}
    rep.set_env(engines["moe"])
    rows = []
    for b in batches:
        r = time_batch(engines, b, args.context, args.steps, args.retries)
        moe, dense = r["step_s"]["moe"], r["step_s"]["dense"]
        m = info["moe"]["shape"]
        rows.append({"batch": b, "moe_step_ms": 1e3 * moe, "dense_step_ms": 1e3 * dense, "moe_tok_s": b / moe,
                     "dense_tok_s": b / dense, "ratio": dense / moe, "experts_touched": m.experts_touched(b),
                     "moe_bytes_per_token": m.params_read(b) * WEIGHT_BYTES[args.weights] / b,
                     "dense_bytes_per_token": info["dense"]["shape"].params_read(b) * WEIGHT_BYTES[args.weights] / b,
                     "cpu_util": r["cpu_util"], "tries": r["tries"]})
    for v in info.values():
        v.pop("shape")
    rep.add("moe", {"shape": shape, "models": info, "write_s": write_s, "rows": rows})
    mi, di = info["moe"], info["dense"]
    rep.table(f"decode: qwen3_moe {mi['total_params'] / 1e9:.2f}B ({shape['experts']} experts, top {shape['top_k']}, "
              f"{mi['active_params'] / 1e9:.3f}B active) against dense qwen3 {di['total_params'] / 1e9:.3f}B, "
              f"{args.weights} weights, context {args.context} (medians)",
              ["batch", "moe ms", "moe tok/s", "dense ms", "dense tok/s", "moe / dense", "experts a layer",
               "MiB read a token: moe", "dense", "cpu util"],
              [[r["batch"], f"{r['moe_step_ms']:.1f}", f"{r['moe_tok_s']:.1f}", f"{r['dense_step_ms']:.1f}",
                f"{r['dense_tok_s']:.1f}", f"{r['ratio']:.2f}", f"{r['experts_touched']:.1f}",
                f"{r['moe_bytes_per_token'] / 2**20:.0f}", f"{r['dense_bytes_per_token'] / 2**20:.0f}",
                f"{r['cpu_util']:.2f}"] for r in rows],
              note="moe / dense: tok/s ratio; experts a layer: E(1-(1-k/E)^B) expected under uniform routing; "
                   "MiB read: the weights a step reads per token (ridge plan's count)")
