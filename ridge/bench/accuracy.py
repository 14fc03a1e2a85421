"""`ridge bench accuracy`: what FP8 costs, measured against fp32 on a few
hundred positions of text (tests/data/eval_text.txt or --text FILE):
FP8 weight scaling rules and the output head, KV cache scaling, the CPU
small-step bf16 format, and the self-draft's agreement per depth."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

EVAL_TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "eval_text.txt"


def add_accuracy_parser(sub, common) -> None:
    a = sub.add_parser("accuracy", help="FP8 weights / KV vs fp32: top-1 agreement and KL over a text")
    common(a, workload=False)
    a.add_argument("--text", default=str(EVAL_TEXT), help="text file to score")


def agreement(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean().item()
    return {"top1": top1, "kl": kl}


def _model(conv, sd):
    from ridge.models.families import model_class

    with torch.device("meta"):
        m = model_class(conv.config)(conv.config)
    m.load_weights(sd, torch.device("cpu"), torch.float32, conv.freq_factors)
    return m


def _weights(conv, ids, ref) -> list[dict]:
    from ridge.models.oneshot import prompt_logits
    from ridge.quant.fp8 import quantize_fp8, quantize_state_dict

    rows = []
    for rule in ("absmax", "mse"):
        m = _model(conv, quantize_state_dict(conv.state_dict, rule))
        rows.append({"case": f"FP8 weights, {rule} per-channel scales, head kept", **agreement(prompt_logits(m, ids), ref)})
    sd = quantize_state_dict(conv.state_dict)
    sd["lm_head.weight"], sd["lm_head.weight_scale"] = quantize_fp8(conv.state_dict["embed_tokens.weight"])
    m = _model(conv, sd)
    rows.append({"case": "FP8 weights, mse, head quantized too", **agreement(prompt_logits(m, ids), ref)})
    return rows


def _kv(model, ids, ref) -> list[dict]:
    import ridge.kernels.kv_cache as kc
    from ridge.models.oneshot import prompt_logits

    rows = [{"case": f"{d} KV, per-(token, head) scales" if d == "fp8" else f"{d} KV",
             **agreement(prompt_logits(model, ids, kv_dtype=d), ref)} for d in ("fp8", "bf16", "fp16")]
    rule = kc.fp8_kv_scale
    try:
        kc.fp8_kv_scale = lambda x: torch.ones(x.shape[:-1], dtype=kc.SCALE_DTYPE)
        rows.append({"case": "fp8 KV, one static scale (1.0)", **agreement(prompt_logits(model, ids, kv_dtype="fp8"), ref)})
    finally:
        kc.fp8_kv_scale = rule
    return rows


def _self_draft(model, ids) -> list[dict]:
    from ridge.cache.kv_cache import KVCache
    from ridge.kernels.metadata import AttentionMetadata

    n, bs = len(ids), 16
    cache = KVCache(model.cfg, -(-n // bs), bs, "fp32")
    meta = AttentionMetadata.build([n], [n], [list(range(-(-n // bs)))], list(range(n)))
    x, pos = torch.tensor(ids), torch.arange(n)
    full = model.compute_logits(model(x, pos, meta, cache.layers)).argmax(-1)
    rows = []
    for L in range(4, model.cfg.num_layers, 4):
        early = model.compute_logits(model(x, pos, meta, cache.layers, num_layers=L)).argmax(-1)
        rows.append({"case": f"self:{L} greedy agreement with the full model", "top1": (early == full).float().mean().item()})
    return rows


def run_accuracy(args, rep) -> None:
    from ridge.engine.cpu_format import choose_cpu_format, cpu_layers
    from ridge.kernels import native
    from ridge.kernels.cpu_linear import ShapeFormat
    from ridge.models.oneshot import prompt_logits
    from ridge.quant.fp8 import quantize_state_dict
    from ridge.quant.convert import convert

    conv = convert(args.model, quantize=False, use_cache=False, show_progress=False)
    ids = conv.tokenizer.encode(Path(args.text).read_text())
    ref_model = _model(conv, conv.state_dict)
    ref = prompt_logits(ref_model, ids)
    rows = _weights(conv, ids, ref) + _kv(ref_model, ids, ref)
    fp8 = _model(conv, quantize_state_dict(conv.state_dict))
    base = prompt_logits(fp8, ids)
    choose_cpu_format(fp8, 1 << 40, "bf16:100000")
    rows.append({"case": "CPU bf16 small-step format vs the fp32 FP8 path", **agreement(prompt_logits(fp8, ids), base)})
    isa = native.fp8_linear_isa()
    if isa:  # every product of the layers through ridge's e4m3 kernel (the head is not FP8)
        for layer in cpu_layers(fp8):
            layer.use(ShapeFormat([], fp8=[(1 << 30, True)]), isa)
        rows.append({"case": f"CPU e4m3 kernel ({'AVX-512 BF16' if isa == 2 else 'AVX2'}) vs the fp32 FP8 path",
                     **agreement(prompt_logits(fp8, ids), base)})
    rows += _self_draft(ref_model, ids)
    rep.data["env"].update(model=conv.config.name, positions=len(ids), text=args.text)
    rep.add("accuracy", rows)
    print(f"\n# accuracy against fp32, {len(ids)} positions — command: {rep.data['command']}", file=rep.out)
    print("| case | top-1 agreement | mean KL (nats) |\n|---|---|---|", file=rep.out)
    for r in rows:
        kl = "-" if "kl" not in r else f"{r['kl']:.5f}"
        print(f"| {r['case']} | {r['top1']:.4f} | {kl} |", file=rep.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.data, f, indent=1, default=str)
        print(f"wrote {args.json}", file=sys.stderr)
