"""An FP8 recipe: how a model's linear weights are quantized at conversion.

A recipe is a scale grouping (quant/fp8.py GROUPINGS), whether the rounding is
error-compensating (GPTQ on the calibration text, quant/gptq.py), and the linear weights
kept in bf16 (the most sensitive, by measured KL per byte: docs/benchmarks.md). Its spec is
one string, the value of `--fp8-recipe` and what the converted model's metadata records:

    g64                     1 x 64 groups, MSE scales, every linear weight FP8
    g64+gptq+bf16:0.down,29.down
                            and GPTQ rounding, layer 0's and 29's down projections in bf16
    g16+act                 1 x 16 groups, the MSE search's error weighted per input column by
                            the calibration text's mean square of that input (diag X^T X)
    channel+head            and the LM head (a tied model's embedding table, copied) in FP8 too,
                            as llama.cpp's Q8_0 files hold their output weight; the embedding
                            lookup keeps the table as it was

Weight names in a spec are short: `<layer>.<qkv|o|gate_up|down>`."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .fp8 import FP8, GROUPINGS, grouping_block, is_linear_weight, quantize_fp8, quantize_state_dict, scale_dtype

KINDS = ("qkv", "o", "gate_up", "down", "in", "out")  # in, out: a recurrent layer's (Gated DeltaNet, LFM2)
# What `--fp8-recipe device` (the default) makes on each device (docs/benchmarks.md, issue 29).
# CPU: 1 x 16 groups with the activation-weighted search, what auto chose on the embedded model
# and the recipe that meets the accuracy targets; ridge's e4m3 kernel closes a group with one
# multiply-add. CUDA: per channel; a W8A8 fp8 dot takes K tiles of 32 or more, so 1 x 16 groups
# do not compile there (kernels/linear.py gpu_refusal), and the grouped GEMMs are untimed on a GPU.
DEVICE_RECIPES = {"cpu": "g16+act", "cuda": "channel"}


def resolve_spec(spec: str, device: str) -> str:
    """A recipe spec with "device" replaced by the device's default (DEVICE_RECIPES)."""
    return DEVICE_RECIPES.get(device, "channel") if spec == "device" else spec
_SHORT = re.compile(r"^(\d+)\.(qkv|o|gate_up|down|in|out)$")
_LONG = re.compile(r"^layers\.(\d+)\.(qkv|o|gate_up|down|in|out)_proj\.weight$")


def long_name(short: str) -> str:
    m = _SHORT.match(short)
    if not m:
        raise ValueError(f"weight {short!r} in an FP8 recipe: write <layer>.<{'|'.join(KINDS)}>, e.g. 0.down")
    return f"layers.{m[1]}.{m[2]}_proj.weight"


def short_name(name: str) -> str:
    m = _LONG.match(name)
    if not m:
        raise ValueError(f"{name!r} is no decoder layer's linear weight")
    return f"{m[1]}.{m[2]}"


@dataclass(frozen=True)
class Recipe:
    grouping: str = "channel"
    gptq: bool = False
    keep: tuple[str, ...] = ()  # fused names of the linear weights kept in bf16, sorted
    act: bool = False  # the scale search weighted by the calibration inputs' mean square per column
    head: bool = False  # the LM head quantized as well (tests/docs: the head stays unquantized by default)

    def __post_init__(self):
        if self.grouping not in GROUPINGS:
            raise ValueError(f"FP8 grouping {self.grouping!r}: choose {', '.join(GROUPINGS)}")
        if self.act and self.gptq:
            raise ValueError("FP8 recipe: +act and +gptq together were never measured (GPTQ weighs the inputs itself)")

    @property
    def calibrated(self) -> bool:
        """Whether quantize needs the calibration text's input statistics."""
        return self.gptq or self.act

    @classmethod
    def parse(cls, spec: str) -> "Recipe":
        parts = spec.strip().split("+")
        grouping, gptq, keep, act, head = parts[0], False, (), False, False
        for p in parts[1:]:
            if p == "gptq":
                gptq = True
            elif p == "act":
                act = True
            elif p == "head":
                head = True
            elif p.startswith("bf16:"):
                keep = tuple(sorted(long_name(s) for s in p[5:].split(",") if s))
            else:
                raise ValueError(f"FP8 recipe {spec!r}: {p!r} is none of gptq, act, head, bf16:<weights>")
        return cls(grouping, gptq, keep, act, head)

    @property
    def spec(self) -> str:
        out = self.grouping + ("+gptq" if self.gptq else "") + ("+act" if self.act else "") + ("+head" if self.head else "")
        if self.keep:
            out += "+bf16:" + ",".join(short_name(n) for n in sorted(self.keep, key=_order))
        return out

    def weight_bytes(self, shapes: dict[str, tuple[int, int]]) -> int:
        """The bytes of the linear weights and their scales (fp8.scale_dtype) under this recipe."""
        total, sb = 0, scale_dtype(self.grouping).itemsize
        for name, (n, k) in shapes.items():
            if name in self.keep:
                total += 2 * n * k
            else:
                bn, bk = grouping_block(self.grouping, (n, k))
                total += n * k + sb * -(-n // bn) * -(-k // bk)
        return total

    def quantize(self, sd: dict[str, torch.Tensor], rule: str = "mse",
                 hessians: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        out = self.quantize_layer(sd, rule, hessians)
        return {**out, **quantize_head(sd, rule, self.grouping)} if self.head else out

    def quantize_layer(self, sd: dict[str, torch.Tensor], rule: str = "mse",
                       stats: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Part of a state dict (one layer's tensors, as a streamed conversion holds them; or all of
        them) with this recipe's FP8 (and bf16) linear weights; never the head. A calibrated recipe
        takes stats: weight name -> its input's X^T X on the calibration text (GPTQ rounds with
        it), or for +act that matrix's diagonal alone (the mean square per input column)."""
        if not self.calibrated:
            return quantize_state_dict(sd, rule, self.grouping, frozenset(self.keep))
        if stats is None:
            raise ValueError(f"FP8 recipe {self.spec}: it needs the calibration text's input statistics")
        if self.act:
            importance = {n: h.diagonal() if h.dim() == 2 else h for n, h in stats.items()}
            return quantize_state_dict(sd, rule, self.grouping, frozenset(self.keep), importance)
        if any(h.dim() != 2 for h in stats.values()):
            raise ValueError(f"FP8 recipe {self.spec}: GPTQ rounds with the whole X^T X, not its diagonal")
        from .gptq import gptq_fp8

        plain = {n: t for n, t in sd.items() if n not in stats or n in self.keep}
        out = quantize_state_dict(plain, rule, self.grouping, frozenset(self.keep))
        for name, t in sd.items():
            if name in stats and name not in self.keep and t.dtype != FP8:
                out[name], out[name + "_scale"] = gptq_fp8(t, stats[name], self.grouping, rule)
        return out


def quantize_head(sd: dict[str, torch.Tensor], rule: str = "mse", grouping: str = "channel") -> dict[str, torch.Tensor]:
    """The LM head as FP8 (lm_head.weight and its _scale), from its own weight or, tied, from a
    copy of the embedding table (which the lookup keeps); nothing where it is FP8 already."""
    w = sd.get("lm_head.weight", sd["embed_tokens.weight"])
    if w.dtype == FP8:
        return {}
    q, s = quantize_fp8(w, rule, grouping)
    return {"lm_head.weight": q, "lm_head.weight_scale": s}


def _order(name: str) -> tuple[int, int]:
    m = _LONG.match(name)
    return (int(m[1]), KINDS.index(m[2])) if m else (1 << 30, 0)


def linear_shapes(sd: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    return {n: tuple(t.shape) for n, t in sd.items() if is_linear_weight(n) and t.dim() == 2}
