"""The offline half of loading: a model source -> fused FP8 state dict + config +
tokenizer, cached on disk. ridge/models/loader.py is the runtime half."""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.config import ModelConfig
from ridge.options import FP8_RECIPE

from . import store
from .fp8 import FP8, is_linear_weight, quantize_state_dict
from .recipe import Recipe, quantize_head, resolve_spec
from .fuse import fuse_hf_state_dict
from .source import read_source, resolve_model_path

log = logging.getLogger("ridge.quant")
CALIBRATION = Path(__file__).resolve().parent / "calibration.txt"  # the text GPTQ and auto measure on
AUTO_JUDGE = 2  # how auto judges a recipe (in the cache key): 2, on the calibration text's held-out last third


@dataclass
class ConvertedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # fused names; linear weights FP8 unless quantize=False
    tokenizer: object
    freq_factors: torch.Tensor | None
    from_cache: bool
    identity: str = ""  # the store key: the source file's identity, the quantizer's version and options
    recipe: dict | None = None  # the FP8 recipe that made the weights (quant/recipe.py) and what chose it


def convert(path=None, *, quantize: bool = True, rule: str = "mse", recipe: str | None = None,
            calibrate=None, use_cache: bool = True, show_progress: bool = True,
            device: str = "cpu") -> ConvertedModel:
    """recipe: an FP8 recipe's spec (quant/recipe.py), or "auto". Those measured on the calibration
    text (auto, and GPTQ rounding) need calibrate(cfg, fused state dict, rope factors, tokenizer,
    spec) -> (Recipe, GPTQ's input statistics or None, what it measured or None), which runs the
    model (ridge/models/fp8_calibrate.calibrate: quant/ sits below models/). None: RIDGE_FP8_RECIPE,
    else the declared default (ridge/options.py FP8_RECIPE). "device": the default of the device
    the weights are for (quant/recipe.py DEVICE_RECIPES), which is also what the cache key holds."""
    from ridge.tokenizer import Tokenizer

    if recipe is None:
        recipe = FP8_RECIPE.convert(os.environ.get(FP8_RECIPE.env), FP8_RECIPE.env) or FP8_RECIPE.default
    recipe = resolve_spec(recipe, device)
    path = resolve_model_path(path)
    options = {"quantize": quantize, "rule": rule, "recipe": recipe}
    if recipe == "auto" or Recipe.parse(recipe).calibrated:  # measured on the calibration text: a new text, a new entry
        options["calibration"] = hashlib.sha256(CALIBRATION.read_bytes()).hexdigest()[:16]
    if recipe == "auto":
        options["judge"] = AUTO_JUDGE
    key = store.cache_key(path, options)
    if use_cache and quantize and (hit := store.load(key)) is not None:
        meta, tensors = hit
        freq = tensors.pop("__rope_freqs__", None)
        return ConvertedModel(ModelConfig.from_dict(meta["config"]), tensors,
                              Tokenizer.from_dict(meta["tokenizer"]), freq, True, key, meta.get("recipe"))
    cfg, sd, freq, tok = read_source(path, show_progress)
    fused = fuse_hf_state_dict(sd, cfg, path)
    chosen = None
    if quantize:
        fused, chosen = _quantize(fused, cfg, freq, tok, rule, recipe, calibrate)
        if use_cache:
            extra = {"__rope_freqs__": freq} if freq is not None else {}
            try:
                store.save(key, {"config": cfg.to_dict(), "tokenizer": tok.to_dict(), "source": str(path),
                                 "recipe": chosen}, {**fused, **extra})
            except OSError as e:
                log.warning("could not cache the converted model: %s", e)
    return ConvertedModel(cfg, fused, tok, freq, False, key, chosen)


def _quantize(fused, cfg, freq, tok, rule: str, spec: str, calibrate) -> tuple[dict, dict]:
    if not any(is_linear_weight(n) and t.dtype != FP8 for n, t in fused.items()):
        # An FP8 checkpoint: its e4m3 weights and scales are used as they are, so no recipe
        # applies and nothing is measured; but for +head, which quantizes what it left unquantized.
        head = spec != "auto" and Recipe.parse(spec).head
        out = {**quantize_state_dict(fused, rule), **(quantize_head(fused, rule) if head else {})}
        return out, {"spec": "checkpoint" + ("+head" if head else ""), "rule": rule, "asked": spec}
    recipe, hess, measured = Recipe.parse(spec) if spec != "auto" else None, None, None
    if recipe is None or recipe.calibrated:
        if calibrate is None:
            raise ValueError(f"FP8 recipe {spec}: it is measured on the calibration text, and no model runs here")
        recipe, hess, measured = calibrate(cfg, fused, freq, tok, spec)
    out = recipe.quantize(fused, rule, hess)
    log.info("FP8 recipe %s%s", recipe.spec, " (chosen on the calibration text)" if measured else "")
    return out, {"spec": recipe.spec, "rule": rule, "asked": spec, **({"measured": measured} if measured else {})}
