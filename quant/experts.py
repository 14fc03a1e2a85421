"""Runtime FP8 experts of a mixture-of-experts layer: what quant/fp8.py produced for the
stacked expert weights, held as FP8Linear holds a dense layer's.

Where the device keeps FP8 (ops.keeps_fp8: a GPU) the stacked e4m3 weights stay FP8 with their
per-expert channel scales and the grouped kernel reads them. On a CPU they stay e4m3 too, once:
where ridge's MoE kernel runs (ops.moe_packs_fp8) as its packed copy alone (CpuExperts.packed);
else, where ridge's e4m3 products run (ops.resident_e4m3), as each expert's two
CpuLinears over its packed bytes, whose products the start-up measurement chooses per shape and
row count (kernels/cpu_linear_plan.py; an expert sees the rows routed to it). The stacked
buffers are then shape-only stand-ins (one byte, expanded): the products read the packed bytes.
Only where neither runs (no C compiler) are they upcast once at load (fp8 * scale is exact)."""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels import ops
from ridge.kernels.cpu_linear import CpuLinear
from ridge.kernels.moe import CpuExperts

FP8 = torch.float8_e4m3fn


class FP8Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, act: str = "silu", bias: bool = False,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0):
        super().__init__()
        self.shapes = {"gate_up_proj": (num_experts, 2 * inter, hidden), "down_proj": (num_experts, hidden, inter)}
        self.act, self.has_bias = act, bias
        self.swiglu = (swiglu_alpha, swiglu_limit)  # act "swigluoai" only
        for name in ("w_gate_up", "w_gate_up_scale", "b_gate_up", "w_down", "w_down_scale", "b_down"):
            self.register_buffer(name, None)
        self.cpu: CpuExperts | None = None

    def load(self, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
        """tensors: "gate_up_proj.weight" [E, 2I, H], "down_proj.weight" [E, H, I], their
        "_scale"s [E, rows] where FP8, and ".bias"es [E, rows] where the layer has them."""
        keep = ops.keeps_fp8(device)
        # Where ops says so (CPU, ridge's MoE kernel): the e4m3 bytes packed for it, nothing else.
        E, I2, H = self.shapes["gate_up_proj"]
        fp8 = all(tensors.get(f"{n}.weight") is not None and tensors[f"{n}.weight"].dtype == FP8 for n in self.shapes)
        native = not keep and fp8 and ops.moe_packs_fp8(device, E, H, I2 // 2)
        resident = not keep and fp8 and all(ops.resident_e4m3(device, self.shapes[n][1:]) for n in self.shapes)
        cpu: dict[str, list[CpuLinear]] = {}
        stacked = {}
        for name, short in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
            w, s, b = (tensors.get(f"{name}.{k}") for k in ("weight", "weight_scale", "bias"))
            if w is None or tuple(w.shape) != self.shapes[name]:
                raise ValueError(f"experts' {name}: {None if w is None else tuple(w.shape)}, the layer is "
                                 f"{self.shapes[name]}")
            if (b is not None) != self.has_bias:
                raise ValueError(f"experts' {name}: " + ("a bias for a layer without one" if b is not None
                                                         else "no bias for a layer with one"))
            scale = None
            if w.dtype == FP8 and keep:  # the grouped kernel reads e4m3
                weight, scale = w.to(device), s.float().to(device)
            elif w.dtype == FP8 and (native or resident):
                stacked[short] = (w, s)
                weight, scale = shape_only(w), s.float()
                if not native:
                    cpu[short] = [CpuLinear.from_fp8(w[e], s[e].float()) for e in range(w.shape[0])]
            elif w.dtype == FP8:
                weight = (w.float() * s.float()[..., None]).to(dtype).to(device)
                cpu[short] = [CpuLinear(weight[e]) for e in range(w.shape[0])]
            else:
                weight = w.to(device=device, dtype=dtype)
            setattr(self, f"w_{short}", weight)
            setattr(self, f"w_{short}_scale", scale)
            setattr(self, f"b_{short}", None if b is None else b.to(device=device, dtype=dtype))
        self.cpu = CpuExperts(cpu["gate_up"], cpu["down"]) if cpu else None
        if native:
            (gu, s_gu), (dn, s_dn) = stacked["gate_up"], stacked["down"]
            self.cpu = CpuExperts.packed_from(gu, s_gu, dn, s_dn)

    def cpu_weights(self) -> list[CpuLinear]:
        """Every expert's CPU products, as kernels' CPU formats see them (made here for weights
        never quantized)."""
        if self.cpu is None:
            self.cpu = CpuExperts([CpuLinear(w) for w in self.w_gate_up], [CpuLinear(w) for w in self.w_down])
        return self.cpu.layers()

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in fp32 as the layer computes with them (e4m3 times
        their scales, exact): for oracles that copy them into another model."""
        out = []
        for which, (w, s) in enumerate(((self.w_gate_up, self.w_gate_up_scale), (self.w_down, self.w_down_scale))):
            got = [self.cpu.expert_weight(which, e) for e in range(w.shape[0])] if self.cpu is not None else [None]
            if all(g is not None for g in got):
                out.append(torch.stack(got))
            else:
                out.append(w.float() if s is None else w.float() * s.float()[..., None])
        return out[0], out[1]

    def cpu_copies(self) -> list[torch.Tensor]:
        """What the experts' CPU products read beyond the buffers: the packed e4m3 bytes and their
        scales, and the bf16 copies of weights never quantized."""
        return self.cpu.copies() if self.cpu else []

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        return ops.fused_moe(x, b["w_gate_up"], b["w_gate_up_scale"], b["w_down"], b["w_down_scale"], topk_ids,
                             topk_weights, b_gate_up=b["b_gate_up"], b_down=b["b_down"], act=self.act,
                             swiglu_alpha=self.swiglu[0], swiglu_limit=self.swiglu[1], cpu=self.cpu)


def shape_only(w: torch.Tensor) -> torch.Tensor:
    """A stand-in of w's shape and dtype holding one byte (expanded): the stacked weights' place
    where their products read the packed bytes (weight_bytes counts storage, not numel)."""
    return torch.zeros(1, dtype=torch.uint8).view(w.dtype).expand(w.shape)
