"""Runtime FP8 experts of a mixture-of-experts layer: what quant/fp8.py produced for the
stacked expert weights, held as FP8Linear holds a dense layer's.

Where the device keeps FP8 (ops.keeps_fp8: a GPU) the stacked e4m3 weights stay FP8 with their
per-expert channel scales and the grouped kernel reads them. On CPU where ridge's MoE kernel
runs (ops.moe_packs_fp8) they stay FP8 too, with the kernel's packed copy (CpuExperts.packed).
Elsewhere on CPU they are upcast once at load (fp8 * scale is exact in fp32), and each
expert's two products get a CpuLinear over its slice of the stacked weight, so the start-up
measurement chooses their formats per shape and row count as for any linear layer
(kernels/cpu_linear_plan.py); an expert sees the rows routed to it."""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels import ops
from ridge.kernels.cpu_linear import CpuLinear, pack_fp8
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
        # Where ops says so (CPU, ridge's MoE kernel): the e4m3 bytes and their packed copy, no upcast.
        E, I2, H = self.shapes["gate_up_proj"]
        native = not keep and all(tensors.get(f"{n}.weight") is not None and tensors[f"{n}.weight"].dtype == FP8
                                  for n in self.shapes) and ops.moe_packs_fp8(device, E, H, I2 // 2)
        cpu: dict[str, list[CpuLinear]] = {}
        for name, short in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
            w, s, b = (tensors.get(f"{name}.{k}") for k in ("weight", "weight_scale", "bias"))
            if w is None or tuple(w.shape) != self.shapes[name]:
                raise ValueError(f"experts' {name}: {None if w is None else tuple(w.shape)}, the layer is "
                                 f"{self.shapes[name]}")
            if (b is not None) != self.has_bias:
                raise ValueError(f"experts' {name}: " + ("a bias for a layer without one" if b is not None
                                                         else "no bias for a layer with one"))
            scale = None
            if w.dtype == FP8 and (keep or native):  # the grouped kernel reads e4m3, so does the CPU one
                weight, scale = w.to(device), s.float().to(device)
            elif w.dtype == FP8:
                weight = (w.float() * s.float()[..., None]).to(dtype).to(device)
                # The e4m3 kernel's layout from the bytes at hand, kept until the formats are chosen.
                cpu[short] = [CpuLinear(weight[e], s[e].float().to(device), pack_fp8(w[e], s[e]))
                              for e in range(w.shape[0])]
            else:
                weight = w.to(device=device, dtype=dtype)
            setattr(self, f"w_{short}", weight)
            setattr(self, f"w_{short}_scale", scale)
            setattr(self, f"b_{short}", None if b is None else b.to(device=device, dtype=dtype))
        self.cpu = CpuExperts(cpu["gate_up"], cpu["down"]) if cpu else None
        if native:
            self.cpu = CpuExperts.packed_from(self.w_gate_up, self.w_gate_up_scale, self.w_down, self.w_down_scale)

    def cpu_weights(self) -> list[CpuLinear]:
        """Every expert's CPU products, as kernels' CPU formats see them (made here for weights
        never quantized)."""
        if self.cpu is None:
            self.cpu = CpuExperts([CpuLinear(w) for w in self.w_gate_up], [CpuLinear(w) for w in self.w_down])
        return self.cpu.layers()

    def cpu_copies(self) -> list[torch.Tensor]:
        """The copies the experts' chosen CPU formats read (bf16, packed e4m3), beyond the buffers."""
        return self.cpu.copies() if self.cpu else []

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        return ops.fused_moe(x, b["w_gate_up"], b["w_gate_up_scale"], b["w_down"], b["w_down_scale"], topk_ids,
                             topk_weights, b_gate_up=b["b_gate_up"], b_down=b["b_down"], act=self.act,
                             swiglu_alpha=self.swiglu[0], swiglu_limit=self.swiglu[1], cpu=self.cpu)
