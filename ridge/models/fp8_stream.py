"""The calibration text through a model a layer at a time (issue 39).

A model of any size calibrates in the memory of one layer: each layer's fused fp32 weights are
read when the walk reaches it (layer(i)) and dropped once every sequence has run it. Several
sequences ("lanes") go through each layer side by side: the fp32 reference, the text the
statistics are fitted on, and one lane per recipe being judged, each running the layer with its
own weights (made from the fp32 ones when the layer arrives, with the statistics the fp32 lanes
just gathered at that layer). What stays is the embedding table and head, each lane's hidden
state (its tokens x hidden) and one layer's KV.

Each lane runs exactly the operations CausalLM.forward runs (embed, each layer's forward, the
final norm, the head), so its logits are those of prompt_logits on a model built with its
weights: fp8_calibrate's whole-model functions are the oracle (tests/test_streamed_convert.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ridge.cache.kv_cache import KVCache
from ridge.kernels.fp8_scales import dequantize
from ridge.kernels.metadata import AttentionMetadata
from ridge.quant.fp8 import FP8, is_linear_weight

from .registry import model_class

CPU = torch.device("cpu")
BLOCK = 16


@dataclass(eq=False)
class Lane:
    """One sequence through the walk.
    weights(i, fused, stats) -> the tensors this lane runs layer i with (fused: the layer's fp32
    tensors; stats: what the statistics lanes gathered at layer i), or None for the fp32 ones;
    a lane without it runs fp32 throughout. stats: "full" gathers each linear input's X^T X
    (GPTQ), "diag" only its diagonal (+act). A lane that follows another runs as it does until
    layer `start`, where it takes a copy of its state: a lane that differs from the reference
    only from layer j on pays for the layers from j."""
    ids: list[int]
    weights: Callable | None = None
    stats: str | None = None
    follows: "Lane | None" = None
    start: int = 0
    h: torch.Tensor | None = None
    residual: torch.Tensor | None = None

    def __post_init__(self):
        if self.stats is not None and self.weights is not None:
            raise ValueError("a statistics lane runs the fp32 weights")


def dequantized(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A quantized state dict with each FP8 linear weight as fp32 (e4m3 * scale, exact): calibration
    computes with the quantized numbers through fp32 products, whichever products the runtime
    would choose for them. Stacked experts (3-D) stay as they are: their FP8 kernel is what the
    model runs them with on any device."""
    wide = {n for n, t in sd.items() if t.dtype == FP8 and t.dim() == 2 and n + "_scale" in sd}
    out = {n: t for n, t in sd.items() if n.removesuffix("_scale") not in wide or n in wide}
    for n in wide:
        out[n] = dequantize(sd[n], sd[n + "_scale"], torch.float32)
    return out


class LinearInputs:
    """The statistics of one layer's linear inputs while a lane runs it: each linear module's
    forward wrapped for the run (the layers call .forward directly, so no module hook would see
    it). sums: weight name -> X^T X or its diagonal, summed in fp64."""

    def __init__(self, layer_module, prefix: str, kind: str, sums: dict):
        self.mods = [(name + ".weight", mod) for name, mod in layer_module.named_modules(prefix=prefix)
                     if is_linear_weight(name + ".weight")]
        self.kind, self.sums = kind, sums

    def __enter__(self):
        for key, mod in self.mods:
            mod.forward = self._wrap(key, mod.forward)
        return self

    def _wrap(self, key, forward):
        sums, full = self.sums, self.kind == "full"

        def seen(x):
            x2 = x.reshape(-1, x.shape[-1]).double()
            sums[key] = sums.get(key, 0) + (x2.t() @ x2 if full else x2.square().sum(0))
            return forward(x)
        return seen

    def __exit__(self, *exc):
        for _, mod in self.mods:  # the wrapper refers to its module: a cycle that would keep the weights
            del mod.forward


@torch.inference_mode()
def walk(cfg, globals_sd: dict[str, torch.Tensor], layer: Callable, freq, lanes: list[Lane],
         done: Callable | None = None, finish: Callable | None = None) -> None:
    """Run every lane through the model a layer at a time. layer(i) -> layer i's fused fp32 tensors;
    done(i, those tensors, stats) once every lane has run layer i (stats: weight name -> the
    statistics lanes' sums, fp32); finish(lane, logits [T, vocab] fp32) for each lane at the end,
    in the lanes' order (none when finish is None: the statistics need no head)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    tokens = {lane: lane.ids for lane in lanes}
    if finish is None:
        # Statistics alone end at the last layer: no head, and of the embedding table only the
        # rows the lanes read (an 8B model's table and head are 4 GB in fp32).
        used = sorted({t for lane in lanes for t in lane.ids})
        row = {t: i for i, t in enumerate(used)}
        globals_sd = {n: t for n, t in globals_sd.items() if not n.startswith("lm_head.")}
        globals_sd["embed_tokens.weight"] = globals_sd["embed_tokens.weight"][torch.tensor(used)]
        tokens = {lane: [row[t] for t in lane.ids] for lane in lanes}
    model.load_globals(globals_sd, CPU, torch.float32, freq)
    longest = max(len(lane.ids) for lane in lanes)
    cache = KVCache(cfg, -(-longest // BLOCK), BLOCK, "fp32", CPU)
    metas = {}
    for n in {len(lane.ids) for lane in lanes}:
        nb = -(-n // BLOCK)
        metas[n] = (AttentionMetadata.build([n], [n], [list(range(nb))], list(range(n)), CPU), torch.arange(n))
    for lane in lanes:
        if lane.follows is None:
            lane.h, lane.residual = model.embed(torch.tensor(tokens[lane])), None

    def run(i: int, lane: Lane, sums: dict | None = None) -> None:
        meta, positions = metas[len(lane.ids)]
        block = model.layers[i]
        if sums is not None:
            with LinearInputs(block, f"layers.{i}", lane.stats, sums):
                lane.h, lane.residual = block.forward(lane.h, lane.residual, positions, model.rope_for(block), meta,
                                                      cache.layers[i])
        else:
            lane.h, lane.residual = block.forward(lane.h, lane.residual, positions, model.rope_for(block), meta,
                                                  cache.layers[i])

    for i in range(cfg.num_layers):
        for lane in lanes:  # a follower starts from its leader's state as the leader enters layer i
            if lane.follows is not None and lane.start == i:
                lead = lane.follows
                lane.h, lane.residual = lead.h.clone(), None if lead.residual is None else lead.residual.clone()
        active = [lane for lane in lanes if lane.follows is None or lane.start <= i]
        fused = layer(i)
        model.load_layer(i, fused, CPU, torch.float32)
        sums: dict = {}
        for lane in active:
            if lane.weights is None:
                run(i, lane, sums if lane.stats else None)
        stats = {k: v.float() for k, v in sums.items()}
        later = []  # lanes that run this layer's fp32 weights after all: loaded again once the others ran
        for lane in active:
            if lane.weights is not None:
                w = lane.weights(i, fused, stats)  # one lane's weights at a time: a layer's copy each
                if w is None:
                    later.append(lane)
                    continue
                model.load_layer(i, dequantized(w), CPU, torch.float32)
                del w
                run(i, lane)
        if later:
            model.load_layer(i, fused, CPU, torch.float32)
            for lane in later:
                run(i, lane)
        with torch.device("meta"):  # the layer's weights go before the next one's come
            model.layers[i] = model.make_layer(cfg, i)
        if done is not None:
            done(i, fused, stats)
        del fused, stats, sums
    if finish is not None:
        for lane in lanes:
            if lane.stats is not None:  # its statistics were all it was for
                continue
            hidden = model.norm.forward(lane.h, lane.residual)[0]
            lane.h = lane.residual = None
            finish(lane, model.compute_logits(hidden))
