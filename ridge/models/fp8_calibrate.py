"""The measured half of FP8 conversion: a model's fp32 forward on the calibration text
shipped with ridge (quant/calibration.txt, never an evaluation text) gives

- each linear layer's input statistics X^T X, which GPTQ rounding needs (quant/gptq.py);
- each linear weight's sensitivity: the KL from fp32 when it alone is quantized;
- the KL of a whole recipe, by which `--fp8-recipe auto` picks the fewest bytes that meet
  the budget (FP8_KL_BUDGET, nats per position on the calibration text).

auto fits and judges on different parts of the text: the statistics (GPTQ's X^T X, +act's
mean squares) come from the first two thirds and the KL from the last third. Judged on the
text it was fitted to, GPTQ looked within the budget there and missed it on unseen text
(docs/benchmarks.md, issue 29).

quant/ cannot run a model (it sits below models/), so convert() takes calibrate() as its
calibrate callback from the loader."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ridge.cache.kv_cache import KVCache
from ridge.kernels.fp8_scales import dequantize
from ridge.kernels.metadata import AttentionMetadata
from ridge.quant.convert import CALIBRATION
from ridge.quant.fp8 import GROUPINGS, is_linear_weight, quantize_fp8
from ridge.quant.recipe import Recipe, linear_shapes, short_name

from .families import model_class
from .oneshot import prompt_logits

log = logging.getLogger("ridge.quant")
FP8_KL_BUDGET = 0.006  # on the calibration text: the evaluation target is 0.008 on texts it never saw
MAX_BF16 = 8  # the most sensitive weights auto tries keeping in bf16, one at a time
SENSITIVITY_TOKENS = 128  # the ranking's slice of the calibration text: a ranking needs less than a KL
JUDGE_SHARE = 1 / 3  # the calibration text's last part, which auto's statistics never see


def kl(logits: torch.Tensor, ref: torch.Tensor) -> float:
    return F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                    reduction="none").sum(-1).mean().item()


def build(cfg, sd: dict[str, torch.Tensor], freq) -> torch.nn.Module:
    with torch.device("meta"):
        m = model_class(cfg)(cfg)
    m.load_weights(sd, torch.device("cpu"), torch.float32, freq)
    return m.eval()


def calibration_ids(tokenizer, cfg) -> list[int]:
    """The calibration text's tokens, as many as the model's positions hold."""
    return tokenizer.encode(CALIBRATION.read_text())[:cfg.max_position]


@torch.inference_mode()
def hessians(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """Weight name -> X^T X (fp64 summed, returned fp32) of its layer's inputs over ids."""
    out: dict[str, torch.Tensor] = {}
    mods = [(name + ".weight", mod) for name, mod in model.named_modules() if is_linear_weight(name + ".weight")]

    def wrap(key, forward):
        def seen(x):  # the layers call .forward directly (no module hooks run): an instance attribute
            x2 = x.reshape(-1, x.shape[-1]).double()
            out[key] = out.get(key, 0) + x2.t() @ x2
            return forward(x)
        return seen

    for key, mod in mods:
        mod.forward = wrap(key, mod.forward)
    try:
        prompt_logits(model, ids)
    finally:
        for _, mod in mods:
            del mod.forward
    return {k: v.float() for k, v in out.items()}


@torch.inference_mode()
def sensitivity(model, sd: dict[str, torch.Tensor], ids: list[int], grouping: str) -> dict[str, float]:
    """Weight name -> the KL from fp32 with only that weight quantized (MSE scales, grouping)."""
    ref = prompt_logits(model, ids)
    out = {}
    for name in linear_shapes(sd):
        mod = model.get_submodule(name.removesuffix(".weight"))
        q, s = quantize_fp8(sd[name], "mse", grouping)
        orig = mod.weight
        mod.weight = dequantize(q, s)
        try:
            out[name] = kl(prompt_logits(model, ids), ref)
        finally:
            mod.weight = orig
    return out


def split_calibration(ids: list[int]) -> tuple[list[int], list[int]]:
    """-> (the tokens statistics are fitted on, the held-out tokens auto judges on)."""
    cut = len(ids) - max(1, int(len(ids) * JUDGE_SHARE))
    return ids[:cut], ids[cut:]


def recipe_kl(cfg, sd, freq, recipe: Recipe, ids, ref, hess=None) -> float:
    return kl(prompt_logits(build(cfg, recipe.quantize(sd, hessians=hess), freq), ids), ref)


@torch.inference_mode()
def stream_act_importance(cfg, globals_sd: dict[str, torch.Tensor], layer, freq, tokenizer, done) -> None:
    """+act's statistics a layer at a time, for a streamed conversion (quant/convert.py): the
    calibration text runs through the fp32 model as CausalLM.forward runs it, but each layer's
    weights exist only while that layer runs. layer(i) -> layer i's fused, unquantized tensors;
    done(i, those tensors, importance) is called once layer i has run, importance mapping each
    linear weight's name to its inputs' sum of squares per column (fp64 summed, returned fp32:
    the diagonal of the X^T X hessians() sums). What stays is the embedding table, the layer
    inputs (calibration tokens x hidden) and the KV cache of the calibration text."""
    cpu = torch.device("cpu")
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model.load_globals(globals_sd, cpu, torch.float32, freq)
    ids = calibration_ids(tokenizer, cfg)
    n, block = len(ids), 16
    nb = -(-n // block)
    cache = KVCache(cfg, nb, block, "fp32", cpu)
    meta = AttentionMetadata.build([n], [n], [list(range(nb))], list(range(n)), cpu)
    positions = torch.arange(n)
    h, residual = model.embed(torch.tensor(ids)), None
    for i in range(cfg.num_layers):
        fused = layer(i)
        model.load_layer(i, fused, cpu, torch.float32)
        sums: dict[str, torch.Tensor] = {}
        mods = [(name + ".weight", mod) for name, mod in model.layers[i].named_modules(prefix=f"layers.{i}")
                if is_linear_weight(name + ".weight")]

        def wrap(key, forward):
            def seen(x):  # the layers call .forward directly (no module hooks run): an instance attribute
                x2 = x.reshape(-1, x.shape[-1]).double()
                sums[key] = sums.get(key, 0) + x2.square().sum(0)
                return forward(x)
            return seen

        for key, mod in mods:
            mod.forward = wrap(key, mod.forward)
        try:
            h, residual = model.layers[i].forward(h, residual, positions, model.cos_sin, meta, cache.layers[i])
        finally:
            for _, mod in mods:  # the wrapper refers to its module: a cycle that would keep the weights
                del mod.forward
        with torch.device("meta"):  # the layer's weights go before the next one's come
            model.layers[i] = model.make_layer(cfg, i)
        done(i, fused, {k: v.float() for k, v in sums.items()})
        del fused


def calibrate(cfg, sd: dict[str, torch.Tensor], freq, tokenizer, spec: str):
    """quant/convert.py's calibrate: -> (recipe, GPTQ's input statistics or None, what auto measured or None)."""
    if spec == "auto":
        return choose_recipe(cfg, sd, freq, tokenizer)
    recipe = Recipe.parse(spec)
    hess = hessians(build(cfg, sd, freq), calibration_ids(tokenizer, cfg)) if recipe.calibrated else None
    return recipe, hess, None


def choose_recipe(cfg, sd: dict[str, torch.Tensor], freq, tokenizer, budget: float = FP8_KL_BUDGET,
                  groupings: tuple[str, ...] = ("g128", "g64", "g32", "g16"), max_bf16: int = MAX_BF16):
    """The recipe of fewest bytes whose KL on the held-out part of the calibration text meets budget: groupings
    coarse to fine, each plain, with the activation-weighted search (+act), then GPTQ, then the
    most sensitive weights (KL per byte) kept in bf16 one by one. -> (recipe, the input statistics when it uses GPTQ, what was measured: for the metadata)."""
    fit, ids = split_calibration(calibration_ids(tokenizer, cfg))
    model = build(cfg, sd, freq)
    ref = prompt_logits(model, ids)
    hess = hessians(model, fit)
    shapes = linear_shapes(sd)
    tried = []

    def measure(r: Recipe) -> float:
        v = recipe_kl(cfg, sd, freq, r, ids, ref, hess if r.calibrated else None)
        tried.append({"recipe": r.spec, "kl": v, "bytes": r.weight_bytes(shapes)})
        log.info("FP8 recipe %s: KL %.5f on the calibration text, %d weight bytes", r.spec, v, tried[-1]["bytes"])
        return v

    cands = sorted((Recipe(g, gptq, act=act) for g in groupings if g in GROUPINGS
                    for gptq, act in ((False, False), (False, True), (True, False))),
                   key=lambda r: (r.weight_bytes(shapes), r.gptq, r.act))
    for r in cands:
        if measure(r) <= budget:
            return r, hess if r.calibrated else None, {"budget": budget, "tried": tried}
    best = min(cands, key=lambda r: next(t["kl"] for t in tried if t["recipe"] == r.spec))
    sens = sensitivity(model, sd, ids[:SENSITIVITY_TOKENS], best.grouping)
    extra = {n: 2 * shapes[n][0] * shapes[n][1] - Recipe(best.grouping).weight_bytes({n: shapes[n]}) for n in sens}
    order = sorted(sens, key=lambda n: -sens[n] / extra[n])[:max_bf16]
    r = best
    for n in order:
        r = Recipe(best.grouping, best.gptq, tuple(sorted((*r.keep, n))), best.act)
        if measure(r) <= budget:
            break
    return r, hess if r.calibrated else None, {"budget": budget, "tried": tried,
                                         "sensitivity": {short_name(k): sens[k] for k in order}}
