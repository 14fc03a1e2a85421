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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ridge.kernels.fp8_scales import dequantize
from ridge.quant.convert import CALIBRATION
from ridge.quant.fp8 import GROUPINGS, quantize_fp8
from ridge.quant.recipe import Recipe, linear_shapes, short_name

from .registry import model_class
from .fp8_stream import Lane, LinearInputs, dequantized, walk
from .oneshot import prompt_logits

log = logging.getLogger("ridge.quant")
FP8_KL_BUDGET = 0.006  # on the calibration text: the evaluation target is 0.008 on texts it never saw
MAX_BF16 = 8  # the most sensitive weights auto tries keeping in bf16, one at a time
SENSITIVITY_TOKENS = 128  # the ranking's slice of the calibration text: a ranking needs less than a KL
JUDGE_SHARE = 1 / 3  # the calibration text's last part, which auto's statistics never see
GROUPINGS_TRIED = ("g128", "g64", "g32", "g16")  # auto's, coarse to fine


def kl(logits: torch.Tensor, ref: torch.Tensor) -> float:
    return F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                    reduction="none").sum(-1).mean().item()


def build(cfg, sd: dict[str, torch.Tensor], freq) -> torch.nn.Module:
    """The fp32 model of sd's numbers (FP8 linear weights widened: fp8_stream.dequantized)."""
    with torch.device("meta"):
        m = model_class(cfg)(cfg)
    m.load_weights(dequantized(sd), torch.device("cpu"), torch.float32, freq)
    return m.eval()


def calibration_ids(tokenizer, cfg) -> list[int]:
    """The calibration text's tokens, as many as the model's positions hold."""
    return tokenizer.encode(CALIBRATION.read_text())[:cfg.max_position]


@torch.inference_mode()
def hessians(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """Weight name -> X^T X (fp64 summed, returned fp32) of its layer's inputs over ids."""
    out: dict[str, torch.Tensor] = {}
    with LinearInputs(model, "", "full", out):
        prompt_logits(model, ids)
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


def calibrate(cfg, sd: dict[str, torch.Tensor], freq, tokenizer, spec: str):
    """quant/convert.py's calibrate: -> (recipe, GPTQ's input statistics or None, what auto measured or None)."""
    if spec == "auto":
        return choose_recipe(cfg, sd, freq, tokenizer)
    recipe = Recipe.parse(spec)
    hess = hessians(build(cfg, sd, freq), calibration_ids(tokenizer, cfg)) if recipe.calibrated else None
    return recipe, hess, None


def _layers_of(sd: dict[str, torch.Tensor]):
    """A whole state dict as the walk reads a stream: (its globals, layer(i) -> layer i's tensors)."""
    glob = {n: t for n, t in sd.items() if not n.startswith("layers.")}
    return glob, lambda i: {n: t for n, t in sd.items() if n.startswith(f"layers.{i}.")}


def choose_recipe(cfg, sd: dict[str, torch.Tensor], freq, tokenizer, budget: float = FP8_KL_BUDGET,
                  groupings: tuple[str, ...] = GROUPINGS_TRIED, max_bf16: int = MAX_BF16):
    """stream_choose_recipe on a model held whole. -> (recipe, the input statistics on the fitted
    part of the text when it needs them, what was measured: for the metadata)."""
    glob, layer = _layers_of(sd)
    recipe, measured = stream_choose_recipe(cfg, glob, layer, freq, tokenizer, budget, groupings, max_bf16)
    hess = None
    if recipe.calibrated:
        fit, _ = split_calibration(calibration_ids(tokenizer, cfg))
        hess = hessians(build(cfg, sd, freq), fit)
    return recipe, hess, measured


def stream_statistics(cfg, globals_sd: dict[str, torch.Tensor], layer, freq, tokenizer, recipe: Recipe, done,
                      fitted_part: bool = False) -> None:
    """A calibrated recipe's statistics a layer at a time, for a streamed conversion (quant/convert.py):
    done(i, layer i's fused fp32 tensors, stats) once layer i has run the calibration text
    (fitted_part: only the part auto fits on), stats mapping each linear weight's name to its
    inputs' X^T X (GPTQ) or that matrix's diagonal (+act), the sums hessians() makes whole."""
    ids = calibration_ids(tokenizer, cfg)
    if fitted_part:
        ids, _ = split_calibration(ids)
    walk(cfg, globals_sd, layer, freq, [Lane(ids, stats="full" if recipe.gptq else "diag")], done)


def stream_choose_recipe(cfg, globals_sd: dict[str, torch.Tensor], layer, freq, tokenizer,
                         budget: float = FP8_KL_BUDGET, groupings: tuple[str, ...] = GROUPINGS_TRIED,
                         max_bf16: int = MAX_BF16) -> tuple[Recipe, dict]:
    """The recipe of fewest bytes whose KL on the held-out part of the calibration text meets budget:
    groupings coarse to fine, each plain, with the activation-weighted search (+act), then GPTQ,
    then the most sensitive weights (KL per byte) kept in bf16 one by one. -> (recipe, what was
    measured: for the metadata). Read a layer at a time (layer(i), as stream_statistics), in at
    most three walks: every candidate side by side, then, if none meets the budget, each weight's
    sensitivity, then the candidates keeping the most sensitive in bf16. A walk measures all of
    its candidates, but `tried` lists them as a one-by-one search would have, up to the first
    that meets the budget."""
    fit, ids = split_calibration(calibration_ids(tokenizer, cfg))
    shapes: dict[str, tuple[int, int]] = {}
    cands = [Recipe(g, gptq, act=act) for g in groupings if g in GROUPINGS
             for gptq, act in ((False, False), (False, True), (True, False))]

    def quantized(r: Recipe):
        return lambda i, fused, stats: r.quantize_layer(fused, "mse", stats if r.calibrated else None)

    def record(i, fused, stats):
        shapes.update(linear_shapes(fused))

    kls = _judge(cfg, globals_sd, layer, freq, ids, {r: quantized(r) for r in cands}, fit, record)
    tried = []

    def measured(r: Recipe, v: float) -> bool:
        tried.append({"recipe": r.spec, "kl": v, "bytes": r.weight_bytes(shapes)})
        log.info("FP8 recipe %s: KL %.5f on the calibration text, %d weight bytes", r.spec, v, tried[-1]["bytes"])
        return v <= budget

    cands.sort(key=lambda r: (r.weight_bytes(shapes), r.gptq, r.act))
    for r in cands:
        if measured(r, kls[r]):
            return r, {"budget": budget, "tried": tried}
    best = min(cands, key=lambda r: kls[r])
    sens = _sensitivity(cfg, globals_sd, layer, freq, ids[:SENSITIVITY_TOKENS], best.grouping, shapes)
    extra = {n: 2 * shapes[n][0] * shapes[n][1] - Recipe(best.grouping).weight_bytes({n: shapes[n]}) for n in sens}
    order = sorted(sens, key=lambda n: -sens[n] / extra[n])[:max_bf16]
    keeps = [Recipe(best.grouping, best.gptq, tuple(sorted(order[:k])), best.act) for k in range(1, len(order) + 1)]
    kls = _judge(cfg, globals_sd, layer, freq, ids, {r: quantized(r) for r in keeps}, fit) if keeps else {}
    r = best
    for r in keeps:
        if measured(r, kls[r]):
            break
    return r, {"budget": budget, "tried": tried, "sensitivity": {short_name(k): sens[k] for k in order}}


def _kls(cfg, globals_sd, layer, freq, ref: Lane, lanes: dict, first: tuple = (), done=None) -> dict:
    """key -> the KL of lanes[key]'s logits from the reference lane's, in one walk (first: lanes
    that run before them, the statistics)."""
    out, logits = {}, {}
    key_of = {id(lane): key for key, lane in lanes.items()}

    def finish(lane: Lane, got: torch.Tensor) -> None:
        if lane is ref:
            logits["ref"] = got
        else:
            out[key_of[id(lane)]] = kl(got, logits["ref"])

    walk(cfg, globals_sd, layer, freq, [*first, ref, *lanes.values()], done, finish)
    return out


def _judge(cfg, globals_sd, layer, freq, ids: list[int], weights: dict, fit: list[int], done=None) -> dict:
    """Each candidate's KL from the fp32 model on ids, in one walk: candidate -> weights(i, fused,
    stats) as Lane.weights takes it, with the statistics of the fitted text."""
    lanes = {key: Lane(ids, w) for key, w in weights.items()}
    return _kls(cfg, globals_sd, layer, freq, Lane(ids), lanes, (Lane(fit, stats="full"),), done)


def _sensitivity(cfg, globals_sd, layer, freq, ids: list[int], grouping: str, shapes) -> dict[str, float]:
    """Weight name -> the KL from fp32 with only that weight quantized (MSE scales, grouping), in
    one walk: each weight's lane follows the reference up to its own layer."""
    ref = Lane(ids)
    lanes = {}
    for name in shapes:
        j = int(name.split(".")[1])

        def one(i, fused, stats, name=name, j=j):
            if i != j:
                return None
            q, s = quantize_fp8(fused[name], "mse", grouping)
            return {**fused, name: dequantize(q, s)}
        lanes[name] = Lane(ids, one, follows=ref, start=j)
    return _kls(cfg, globals_sd, layer, freq, ref, lanes)


@dataclass(frozen=True)
class LayerCalibration:
    """What a streamed conversion (quant/convert.py, which cannot run a model) calls to measure on
    the calibration text a layer at a time: statistics as stream_statistics, choose as
    stream_choose_recipe."""
    statistics: Callable
    choose: Callable


STREAMED = LayerCalibration(stream_statistics, stream_choose_recipe)
