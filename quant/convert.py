"""The offline half of loading: a model source -> fused FP8 state dict + config +
tokenizer, cached on disk. ridge/models/loader.py is the runtime half."""
from __future__ import annotations

import hashlib
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ridge.config import ModelConfig
from ridge.options import FP8_RECIPE

from . import store
from .fp8 import FP8, is_linear_weight, quantize_state_dict
from .recipe import Recipe, quantize_head, resolve_spec
from .fuse import fuse_globals, fuse_hf_state_dict, fuse_layer
from .progress import progress
from .source import SourceStream, open_source, read_source, resolve_model_path

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
    # Unquantized weights streamed: state_dict holds the globals, layer(i) reads, fuses and returns
    # layer i's tensors when the loader places it (None: state_dict holds every layer's).
    layer: Callable[[int], dict[str, torch.Tensor]] | None = None


def convert(path=None, *, registry, quantize: bool = True, rule: str = "mse", recipe: str | None = None,
            calibrate=None, use_cache: bool = True, show_progress: bool = True,
            device: str = "cpu", calibrate_layers=None, on_layer=None, layered: bool = False) -> ConvertedModel:
    """registry: the model families (quant/spec.py; ridge/models/registry.py REGISTRY, which binds it:
    quant/ sits below models/). recipe: an FP8 recipe's spec (quant/recipe.py), or "auto". Those measured on the calibration
    text (auto, and GPTQ rounding) need calibrate(cfg, fused state dict, rope factors, tokenizer,
    spec) -> (Recipe, GPTQ's input statistics or None, what it measured or None), which runs the
    model (ridge/models/fp8_calibrate.calibrate: quant/ sits below models/). None: RIDGE_FP8_RECIPE,
    else the declared default (ridge/options.py FP8_RECIPE). "device": the default of the device
    the weights are for (quant/recipe.py DEVICE_RECIPES), which is also what the cache key holds.

    Every recipe streams (issue 39): the source is read, fused, quantized and cached one layer at
    a time, and what is returned is the cache's memory map (or, uncached, the FP8 result), never
    the whole model unquantized. The recipes measured on the calibration text (+act, +gptq,
    auto) run it a layer at a time through calibrate_layers (ridge/models/fp8_calibrate.py
    STREAMED: statistics(...) and choose(...)), without which they read the model whole and
    measure it through calibrate.
    on_layer(i, layers): called as layer i is done, with the layers whose source tensors are still
    alive then (weak references: a test's witness that one layer at a time is held).
    layered: unquantized weights (quantize=False) come a layer at a time, as a loader places
    them (ConvertedModel.layer), not as one state dict."""
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
    if quantize and (stream := _streams(path, recipe, calibrate_layers, registry)) is not None:
        return _convert_streamed(stream, path, key, rule, recipe, calibrate_layers, use_cache, show_progress, on_layer)
    if layered and not quantize and not (stream := open_source(path, registry)).fp8_checkpoint():
        # The source's own values: nothing to cache, read a layer at a time as the loader places them.
        return ConvertedModel(stream.config, fuse_globals(stream.globals(), stream.config, path, stream.spec.weights), stream.tokenizer,
                              stream.freq_factors, False, key,
                              layer=lambda i: fuse_layer(stream.layer(i), stream.config, i, {}, path, stream.spec.weights))
    cfg, sd, freq, tok = read_source(path, registry, show_progress)
    fused = fuse_hf_state_dict(sd, cfg, path, registry[cfg.arch].weights)
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


def _streams(path, spec: str, calibrate_layers, registry) -> SourceStream | None:
    """The source opened for a streamed conversion, or None where the whole model is read: a
    recipe measured on the calibration text when no calibrate_layers runs it a layer at a time,
    or an FP8 checkpoint, which is loaded as it is (1 byte a weight already)."""
    if calibrate_layers is None and (spec == "auto" or Recipe.parse(spec).calibrated):
        return None
    stream = open_source(path, registry)
    return None if stream.fp8_checkpoint() else stream


def _convert_streamed(stream: SourceStream, path, key: str, rule: str, spec: str, calibrate_layers,
                      use_cache: bool, show_progress: bool, on_layer) -> ConvertedModel:
    cfg, freq, tok = stream.config, stream.freq_factors, stream.tokenizer
    entry = store.Entry(key) if use_cache else None
    kept: dict[str, torch.Tensor] = {}  # uncached: the converted model, FP8 (1 byte a linear weight)
    bar = progress(range(cfg.num_layers), "converting", enabled=show_progress)
    read = weakref.WeakValueDictionary()  # (layer, name) -> each source tensor read, while it lives

    def emit(tensors: dict[str, torch.Tensor]) -> None:
        if entry is None:
            kept.update(tensors)
            return
        try:
            entry.add(tensors)
        except OSError as e:
            raise _Uncached(e) from None

    def layer(i: int) -> dict[str, torch.Tensor]:
        src = stream.layer(i)
        read.update({(i, n): t for n, t in src.items()})
        return fuse_layer(src, cfg, i, {}, path, stream.spec.weights)

    def done(i: int, fused: dict[str, torch.Tensor], stats) -> None:
        emit(recipe.quantize_layer(fused, rule, stats if recipe.calibrated else None))
        if on_layer is not None:
            on_layer(i, sorted({j for j, _ in read.keys()}))
        bar.update(1)

    try:
        glob = fuse_globals(stream.globals(), cfg, path, stream.spec.weights)
        measured = None
        if spec == "auto":  # its walks over the layers first, then the conversion's
            recipe, measured = calibrate_layers.choose(cfg, glob, layer, freq, tok)
        else:
            recipe = Recipe.parse(spec)
        head = quantize_head(glob, rule, recipe.grouping) if recipe.head else {}
        emit({**glob, **head, **({"__rope_freqs__": freq} if freq is not None else {})})
        del head
        glob = {n: t for n, t in glob.items() if not n.startswith("lm_head.")}  # written; the statistics need no head
        if recipe.calibrated:  # auto's statistics come from the part of the text it fitted on
            calibrate_layers.statistics(cfg, glob, layer, freq, tok, recipe, done, fitted_part=spec == "auto")
        else:
            for i in range(cfg.num_layers):
                done(i, layer(i), None)
        bar.close()
        del glob
        chosen = {"spec": recipe.spec, "rule": rule, "asked": spec, **({"measured": measured} if measured else {})}
        log.info("FP8 recipe %s (%sconverted a layer at a time)", recipe.spec,
                 "chosen on the calibration text, " if measured else "")
        if entry is None:
            kept.pop("__rope_freqs__", None)
            return ConvertedModel(cfg, kept, tok, freq, False, key, chosen)
        try:
            entry.commit({"config": cfg.to_dict(), "tokenizer": tok.to_dict(), "source": str(path),
                          "recipe": chosen})
        except OSError as e:
            raise _Uncached(e) from None
    except _Uncached as e:
        entry.abort()
        log.warning("could not cache the converted model: %s", e.args[0])
        hit = None
    except BaseException:
        if entry is not None:
            entry.abort()
        raise
    else:
        hit = store.load(key)
    if hit is None:  # not cached, or not readable back: the FP8 result held in memory instead
        return convert(path, registry=stream.registry, rule=rule, recipe=spec, use_cache=False, show_progress=show_progress,
                       calibrate_layers=calibrate_layers, on_layer=on_layer)
    tensors = hit[1]
    tensors.pop("__rope_freqs__", None)  # the memory map of what was just written: the FP8 model
    return ConvertedModel(cfg, tensors, tok, freq, False, key, chosen)


class _Uncached(Exception):
    """The cache could not take a shard (a full disk, say): the conversion goes on uncached."""
