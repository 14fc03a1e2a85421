"""A CPU start from the converted cache maps the weights in the layout ridge's products read.

The converted cache (quant/store.py) holds each FP8 weight as the converter made it, [N, K]
e4m3 with its scales, and the table and head wide: what every device starts from. On a CPU the
products read another layout (kernels/cpu_linear.py: bytes packed [N/16, K/2, 16, 2], scales by
block of 16 rows, the table and head as 8-bit codes), so each start from that cache would copy
every weight once more into it. The CPU image is that layout written once, the first time a CPU
loads the entry, beside it in the same cache (its own folder, pruned like any entry): a later
start maps it, and the products read the mapped pages; nothing is copied (issue 39: a cached
start within 2x of the time to read its bytes).

What it holds, per packed FP8Linear (the table's own entry only where it is not the head's):
name.cpu_<code> (code e4m3 or i8, uint8 [N/16, K/2, 16, 2]) and name.cpu_scale (the kernels'
scale layout). What it does not hold (an expert's weights, a recipe's bf16 exceptions, norms,
biases) loads from the converted cache as before; decoder.py and quant/embedding.py take a
packed weight from these names where they find one (quant/linear.py packed_image)."""
from __future__ import annotations

import logging

import torch

from ridge.quant import store
from ridge.quant.linear import IMAGE_CODES, FP8Linear

log = logging.getLogger("ridge.models")

LAYOUT = 1  # the packed layout's version (kernels/cpu_linear.py pack_fp8, kernel_scales, q8_pack)


def image_key(identity: str) -> str:
    return f"{identity}-cpu{LAYOUT}"


def load_image(identity: str) -> dict[str, torch.Tensor] | None:
    """The image of a converted entry (its tensors mapped), or None where there is none yet."""
    if not identity:
        return None
    hit = store.load(image_key(identity))
    if hit is None or hit[0].get("layout") != LAYOUT:
        return None
    tensors = hit[1]
    if not all(n.endswith(".cpu_scale") or n.rsplit(".cpu_", 1)[-1] in IMAGE_CODES for n in tensors):
        return None
    for t in tensors.values():
        _touch(t)
    return tensors


PAGE = 4096


def _touch(t: torch.Tensor) -> None:
    """Read one byte of each page of a mapped tensor: the start reads the image now (from the page
    cache, or the disk), not its first request, and the load's time says what the mapping cost."""
    flat = t.reshape(-1).view(torch.uint8)
    if flat.numel() > PAGE:
        flat[::PAGE].sum()


def _packed(name: str, m) -> dict[str, torch.Tensor]:
    cpu = getattr(m, "cpu", None)
    if cpu is None or not cpu.is_packed:
        return {}
    return {f"{name}.cpu_{cpu.code}": cpu.packed, f"{name}.cpu_scale": cpu.scale}


def save_image(identity: str, model, source: str) -> None:
    """Write model's packed weights as identity's image: the globals, then one shard a layer (a
    shard's bytes are copied as it is written, so a layer at a time). A failure to write is a
    warning: the next start packs again."""
    head = model.lm_head.cpu
    if head is None or not head.is_packed:
        return
    try:
        entry = store.Entry(image_key(identity))
    except OSError as e:
        log.warning("could not write the CPU image of the converted model: %s", e)
        return
    try:
        glob = _packed("lm_head", model.lm_head)
        table = getattr(model.embed_tokens, "cpu", None)
        if table is not None and table is not head:
            glob.update(_packed("embed_tokens", model.embed_tokens))
        entry.add(glob)
        for i, layer in enumerate(model.layers):
            entry.add({k: v for n, m in layer.named_modules(prefix=f"layers.{i}") if isinstance(m, FP8Linear)
                       for k, v in _packed(n, m).items()})
        entry.commit({"source": source, "layout": LAYOUT})
    except Exception as e:  # a full disk is safetensors' own error, not an OSError: never the start's
        entry.abort()
        log.warning("could not write the CPU image of the converted model: %s", e)
    except BaseException:
        entry.abort()
        raise
