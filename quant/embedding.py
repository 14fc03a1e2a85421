"""The token embedding and LM head of an FP8 model on a CPU: one byte a weight, as the layers.

On a CPU every FP8 linear weight stays e4m3 (quant/linear.py); the embedding table and head
are the largest matrices left (SmolLM2: a fifth of the parameters, Llama-3.2-1B: a fifth, and
a tied model's head is the table). Where ridge's CPU products run (ops.resident_e4m3), both
are held in 8 bits in the products' packed layout (kernels/cpu_linear.py), the table's lookup
widening only the gathered rows (CpuLinear.rows):
- under +head, e4m3: the converter's MSE search wrote lm_head.weight in e4m3; a tied model's
  table is the head's bytes, an untied one's is quantized at load in the layers' groups;
- otherwise (the default recipes), int8 codes in 1 x 32 groups with bf16 scales (llama.cpp's
  Q8_0 grid), quantized at load from the stored wide table in one pass (native.q8_pack): e4m3's
  3 mantissa bits cost the head more than the accuracy budget (SmolLM2 g16+act: KL 0.0042 ->
  0.0080 on the prose text), where these 8 bits hold it (0.0042; docs/benchmarks.md, issue 39).
  A tied head is the table's bytes; an untied head gets its own.
Elsewhere (a GPU, an unquantized model, a CPU without ridge's C kernels) the table stays as it
was: nn.Embedding in the compute dtype, a tied head the same tensor."""
from __future__ import annotations

import logging

import torch
from torch import nn

from ridge.kernels import ops
from ridge.kernels.cpu_linear import CpuLinear
from ridge.kernels.fp8_scales import scale_block

from .fp8 import FP8, quantize_fp8
from .linear import packed_image

log = logging.getLogger("ridge.quant")


class PackedEmbedding(nn.Module):
    """Rows of an 8-bit table (e4m3, or int8 codes: cpu.code) times their scales, in `dtype`.
    weight / weight_scale are the bytes and scales as the CPU products hold them (CpuLinear:
    packed, scales in the kernel's layout); a tied head's FP8Linear holds the same two tensors."""

    def __init__(self, cpu: CpuLinear, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = cpu.shape
        self.dtype = dtype  # what a lookup returns (the model's compute dtype)
        self.register_buffer("weight", cpu.packed.view(torch.int8 if cpu.code == "i8" else FP8))
        self.register_buffer("weight_scale", cpu.scale)
        self.cpu = cpu

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.cpu.rows(input_ids).to(self.dtype)

    def dequantized(self) -> torch.Tensor:
        """The whole table in fp32, codes times their scales: for oracles that copy it into another model."""
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


def table_format(sd, device: torch.device) -> str:
    """How the table and head are held: "e4m3" (+head, where ridge's CPU products run), "i8"
    (an FP8 model's table there otherwise), "wide" (as stored, in the compute dtype)."""
    table = sd["embed_tokens.weight"]
    if not ops.resident_e4m3(device, tuple(table.shape)):
        return "wide"
    head = sd.get("lm_head.weight")
    if head is not None and head.dtype == FP8:
        return "e4m3"
    return "i8" if any(t.dtype == FP8 for t in sd.values()) else "wide"


def load_table_and_head(model, sd, device: torch.device, dtype: torch.dtype) -> None:
    """model.embed_tokens and model.lm_head from sd, in the format table_format picks; a tied
    head (no lm_head.weight in sd) is the table's storage in every format."""
    table, head = sd["embed_tokens.weight"], sd.get("lm_head.weight")
    tied = model.cfg.tie_word_embeddings  # +head writes a tied model's head too: the table's e4m3 copy
    if ops.resident_e4m3(device, tuple(table.shape)) and (image := packed_image(sd, "lm_head", tuple(table.shape))):
        # A CPU image (ridge/models/cpu_image.py): the head's bytes mapped, the table's its own or the head's
        own = packed_image(sd, "embed_tokens", tuple(table.shape))
        if own is not None or tied:
            model.lm_head.hold(image, sd.get("lm_head.bias"), dtype)
            model.embed_tokens = PackedEmbedding(own or image, dtype)
            return
    fmt = table_format(sd, device)
    if fmt == "i8":
        cpu = CpuLinear.from_q8(table)
        model.embed_tokens = PackedEmbedding(cpu, dtype)
        model.lm_head.hold(cpu if tied or head is None else CpuLinear.from_q8(head))
        return
    if head is not None:
        model.lm_head.load(head, sd.get("lm_head.weight_scale"), sd.get("lm_head.bias"), device, dtype)
    if fmt == "e4m3":
        cpu = model.lm_head.cpu if tied else CpuLinear.from_fp8(*_e4m3(table, None, table_grouping(sd)))
        model.embed_tokens = PackedEmbedding(cpu, dtype)
        return
    model.embed_tokens.weight = nn.Parameter(table.to(device=device, dtype=dtype), requires_grad=False)
    if head is None:  # one table serves both ends
        model.lm_head.weight = model.embed_tokens.weight.data


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
