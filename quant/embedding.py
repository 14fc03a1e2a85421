"""The token embedding of an FP8 model on a CPU where the recipe put the head in e4m3 (+head).

On a CPU every FP8 linear weight stays e4m3 (quant/linear.py); the embedding table is the
largest matrix left (SmolLM2: a fifth of the parameters, Llama-3.2-1B: a fifth). Where the
head is e4m3 (+head), the table is held in e4m3 too: a tied model's is the head's bytes (the
head's FP8Linear packs them for ridge's e4m3 products and the lookup reads that layout,
kernels/cpu_linear.py CpuLinear.rows, so the table exists once); an untied model's is quantized
at load in the layers' groups along the hidden size. A lookup widens only the gathered rows
(table[ids] * scale[ids]).

Elsewhere (the default recipes, a GPU, an unquantized model, a CPU without ridge's C kernels)
the table stays as it was: nn.Embedding in the compute dtype, a tied head the same tensor."""
from __future__ import annotations

import logging

import torch
from torch import nn

from ridge.kernels import ops
from ridge.kernels.cpu_linear import CpuLinear
from ridge.kernels.fp8_scales import scale_block

from .fp8 import FP8, quantize_fp8

log = logging.getLogger("ridge.quant")


class FP8Embedding(nn.Module):
    """Rows of an e4m3 table times their scales, in `dtype`. weight / weight_scale are the
    bytes and scales as the CPU products hold them (CpuLinear: packed, scales in the kernel's
    layout); a tied head's FP8Linear holds the same two tensors."""

    def __init__(self, cpu: CpuLinear, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = cpu.shape
        self.dtype = dtype  # what a lookup returns (the model's compute dtype)
        self.register_buffer("weight", cpu.packed.view(FP8))
        self.register_buffer("weight_scale", cpu.scale)
        self.cpu = cpu

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.cpu.rows(input_ids).to(self.dtype)

    def dequantized(self) -> torch.Tensor:
        """The whole table in fp32, e4m3 times its scales: for oracles that copy it into another model."""
        return self.cpu.rows(torch.arange(self.num_embeddings))


def table_grouping(sd) -> str:
    """The scale grouping of the model's FP8 layers, as the table is quantized: groups of G along
    the hidden size where the layers have 1 x G groups (or B x B blocks: rows of B), else per row."""
    for name, scale in sd.items():
        if name.endswith(".weight_scale") and name.startswith("layers."):
            w = sd[name[: -len("_scale")]]
            if w.dim() == 3:  # stacked experts: [E, rows] per-channel scales, not the layers' grouping
                continue
            _, bk = scale_block(scale, tuple(w.shape))
            return "channel" if scale.dim() == 1 or bk >= w.shape[-1] else f"g{bk}"
    return "channel"


def load_embedding(model, sd, device: torch.device, dtype: torch.dtype) -> None:
    """model.embed_tokens (and a tied head) from sd. Where the recipe quantized the head (+head:
    the converter's MSE search wrote lm_head.weight in e4m3) and ridge's e4m3 products run here
    (ops.resident_e4m3), the lookup is e4m3 too: a tied model's table is the head's bytes (the
    table exists once), an untied one's quantized at load in the layers' grouping. Otherwise the
    table stays as it is, in dtype, and a tied head is that table: the default recipes keep the
    head wide because e4m3 there costs more than the accuracy budget (SmolLM2, g16+act: KL 0.0042
    -> 0.0080 on the prose text, docs/benchmarks.md), so holding ~1.1 bytes a parameter with the
    table in e4m3 is the +head recipe's choice, not the default's."""
    table = sd["embed_tokens.weight"]
    head = sd.get("lm_head.weight")
    tied = model.cfg.tie_word_embeddings
    if not (head is not None and head.dtype == FP8 and ops.resident_e4m3(device, tuple(table.shape))):
        model.embed_tokens.weight = nn.Parameter(table.to(device=device, dtype=dtype), requires_grad=False)
        if head is None:  # one table serves both ends
            model.lm_head.weight = model.embed_tokens.weight.data
        return
    if tied:  # the head (loaded by _load_modules) holds the e4m3 table: the lookup reads its rows
        cpu = model.lm_head.cpu
    else:
        cpu = CpuLinear.from_fp8(*_e4m3(table, None, table_grouping(sd)))
    model.embed_tokens = FP8Embedding(cpu, dtype)


def _e4m3(w: torch.Tensor, scale: torch.Tensor | None, grouping: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A table (or head) as e4m3 and its scales: as stored where it is FP8 already, else quantized
    with absmax scales, not the layers' MSE search: this runs at every start (the store keeps the
    table wide), and the search costs about ten casts of the table."""
    if w.dtype == FP8:
        return w, scale
    # By rows (each row's scales are its own): the search's fp32 temporaries of a 128k-row table
    # would otherwise peak at several GiB beside the model.
    parts = [quantize_fp8(w[i:i + ROWS].float(), "absmax", grouping) for i in range(0, w.shape[0], ROWS)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


ROWS = 8192  # table rows quantized at a time
