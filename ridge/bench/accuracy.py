"""`ridge bench accuracy`: what FP8 costs, measured against fp32 on a few
hundred positions of each text (tests/data/eval_text.txt, prose, and
tests/data/eval_code.txt, code, or --text FILE ...): the FP8 recipe the
conversion chose or was given (--fp8-recipe) with its weight bytes, any recipes
listed with --recipes, FP8 weight scaling rules and the output head, KV cache
scaling, the CPU streaming e4m3 kernel against the blocked fp32 product, and the self-draft's
agreement per depth. On a CPU the FP8 models hold the embedding table and head in 8 bits too
(int8 codes, or e4m3 under +head: quant/embedding.py), as the engine does.
No text scored here is one the recipes were tuned or calibrated on."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
EVAL_TEXTS = (str(DATA / "eval_text.txt"), str(DATA / "eval_code.txt"))


def add_accuracy_parser(sub, common) -> None:
    a = sub.add_parser("accuracy", help="FP8 weights / KV vs fp32: top-1 agreement and KL over texts")
    common(a, workload=False)
    a.add_argument("--text", nargs="+", default=list(EVAL_TEXTS), help="text files to score (default: prose and code)")
    a.add_argument("--recipes", default="", help="more FP8 recipe specs to score, comma-separated (quant/recipe.py)")
    a.add_argument("--only-recipes", action="store_true", help="score the recipes only (no KV, CPU or self-draft rows)")


def agreement(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean().item()
    return {"top1": top1, "kl": kl}


def _model(conv, sd):
    from ridge.models.registry import model_class

    with torch.device("meta"):
        m = model_class(conv.config)(conv.config)
    m.load_weights(sd, torch.device("cpu"), torch.float32, conv.freq_factors)
    return m


def _scored(case: str, m, texts: dict[str, list[int]], refs: dict, kv: str = "fp32", **extra) -> dict:
    """One row: the case, then top-1 and KL per text (keys top1/kl for the first, top1_<name>...)."""
    from ridge.models.oneshot import prompt_logits

    row = {"case": case, **extra}
    for i, (name, ids) in enumerate(texts.items()):
        a = agreement(prompt_logits(m, ids, kv_dtype=kv), refs[name])
        row.update(a if i == 0 else {f"{k}_{name}": v for k, v in a.items()})
    return row


def _recipes(conv, chosen, specs: list[str], texts, refs) -> list[dict]:
    from ridge.models.fp8_calibrate import build, calibrate
    from ridge.quant.recipe import Recipe, linear_shapes

    shapes = linear_shapes(conv.state_dict)
    today = Recipe().weight_bytes(shapes)
    rows = []
    for spec, sd, how in [(chosen.recipe["spec"], chosen.state_dict, "chosen" if chosen.recipe.get("measured") else "given")] + \
            [(s, None, "listed") for s in specs]:
        r = Recipe.parse(spec)
        if sd is None:
            hess = calibrate(conv.config, conv.state_dict, conv.freq_factors, conv.tokenizer, spec)[1] \
                if r.calibrated else None
            sd = r.quantize(conv.state_dict, hessians=hess)
        m = build(conv.config, sd, conv.freq_factors)
        b = r.weight_bytes(shapes)
        case = f"FP8 recipe {spec} ({how}), {b / 1e6:.1f} MB linear weights ({b / today:.3f}x per-channel)"
        rows.append(_scored(case, m, texts, refs, recipe=spec, bytes=b))
        if how != "listed":
            rows.append(_scored(case + ", fp8 KV", m, texts, refs, "fp8", recipe=spec, bytes=b))
    return rows


def _weights(conv, texts, refs) -> list[dict]:
    from ridge.quant.fp8 import quantize_fp8, quantize_state_dict

    rows = []
    for rule in ("absmax", "mse"):
        m = _model(conv, quantize_state_dict(conv.state_dict, rule))
        rows.append(_scored(f"FP8 weights, {rule} per-channel scales, head kept", m, texts, refs))
    sd = quantize_state_dict(conv.state_dict)
    sd["lm_head.weight"], sd["lm_head.weight_scale"] = quantize_fp8(conv.state_dict["embed_tokens.weight"])
    rows.append(_scored("FP8 weights, mse, head quantized too", _model(conv, sd), texts, refs))
    return rows


def _kv(model, ids, ref) -> list[dict]:
    import ridge.kernels.kv_cache as kc
    from ridge.models.oneshot import prompt_logits

    rows = [{"case": f"{d} KV, per-(token, head) scales, K and V rotated" if d == "fp8" else f"{d} KV",
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


def _cpu_products(conv, chosen, texts, refs) -> list[dict]:
    """The chosen recipe's bytes as a CPU holds them (e4m3 layers, an int8 table and head: loaded,
    not widened) through each of ridge's CPU products at every step size, against fp32: the
    blocked product in fp32 tiles (as served past the streaming sizes), on AMX where the CPU has
    it (as --cpu-amx serves them: decode steps by default), and the streaming kernel (as served at
    few rows). None where the products are not built here."""
    from ridge.engine.cpu_format import choose_cpu_format, cpu_layers
    from ridge.kernels import native
    from ridge.kernels.cpu_linear import ShapeFormat

    m = _model(conv, chosen.state_dict)
    layers = cpu_layers(m)
    if not any(layer.is_packed for layer in layers):
        return []
    head = f"FP8 recipe {chosen.recipe['spec']} on this CPU's products"
    choose_cpu_format(m, 1 << 40, "fp32")  # the blocked product at every size
    rows = [_scored(f"{head}: blocked, fp32 tiles", m, texts, refs)]
    if native.tiles_bf16():
        for layer in layers:  # the blocked product as before, on AMX at every step (fp32 mode itself never is)
            layer.bf16_tiles = "all"
        rows.append(_scored(f"{head}: blocked, AMX tiles (--cpu-amx: decode steps by default)", m, texts, refs))
    isa = native.fp8_linear_isa()
    if isa:
        for layer in layers:
            layer.use(ShapeFormat([], fp8=[(1 << 30, True)]), isa)
        rows.append(_scored(f"{head}: streaming ({'AVX-512 BF16' if isa == 2 else 'AVX2'})", m, texts, refs))
    return rows


def run_accuracy(args, rep) -> None:
    from ridge.models.fp8_calibrate import calibrate
    from ridge.models.oneshot import prompt_logits
    from ridge.models.registry import convert

    conv = convert(args.model, quantize=False, use_cache=False, show_progress=False)
    chosen = convert(args.model, recipe=args.fp8_recipe, calibrate=calibrate, show_progress=False)
    texts = {Path(t).stem.removeprefix("eval_"): conv.tokenizer.encode(Path(t).read_text()) for t in args.text}
    ref_model = _model(conv, conv.state_dict)
    refs = {name: prompt_logits(ref_model, ids) for name, ids in texts.items()}
    specs = [s.strip() for s in args.recipes.split(",") if s.strip()]
    rows = _recipes(conv, chosen, specs, texts, refs)
    first = next(iter(texts))
    ids, ref = texts[first], refs[first]
    if not args.only_recipes:
        rows += _weights(conv, texts, refs) + _kv(ref_model, ids, ref) + _cpu_products(conv, chosen, texts, refs)
        rows += _self_draft(ref_model, ids)
    rep.data["env"].update(model=conv.config.name, positions={n: len(i) for n, i in texts.items()}, text=args.text,
                           fp8_recipe=chosen.recipe)
    rep.add("accuracy", rows)
    _print(rep, chosen, texts, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.data, f, indent=1, default=str)
        print(f"wrote {args.json}", file=sys.stderr)


def _print(rep, chosen, texts: dict, rows: list[dict]) -> None:
    names = list(texts)
    print(f"\n# accuracy against fp32, {', '.join(f'{n}: {len(texts[n])}' for n in names)} positions; FP8 recipe "
          f"{chosen.recipe['spec']} (asked: {chosen.recipe['asked']}) — command: {rep.data['command']}", file=rep.out)
    head = " | ".join(f"top-1 {n} | KL {n}" for n in names)
    print(f"| case | {head} |\n|---|{'---|---|' * len(names)}", file=rep.out)
    for r in rows:
        cells = []
        for i, n in enumerate(names):
            sfx = "" if i == 0 else f"_{n}"
            top1, kl = r.get("top1" + sfx), r.get("kl" + sfx)
            cells += ["-" if top1 is None else f"{top1:.4f}", "-" if kl is None else f"{kl:.5f}"]
        print(f"| {r['case']} | {' | '.join(cells)} |", file=rep.out)
