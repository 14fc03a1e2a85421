"""GGUF files -> ModelConfig (quant/gguf_config.py) + Hugging Face-named fp32 tensors, a layer at a time.

Dequantization is the `gguf` package's. A family's GGUFFamily (in its folder under
ridge/models/) names its tensors beyond LAYER_NAMES; where llama.cpp's converter permuted the
Q and K rows for its interleaved (NORM) RoPE, we undo it to get back the rotate-half layout
the model uses."""
from __future__ import annotations

import mmap

import numpy as np
import torch

from .errors import ModelLoadError
from .fuse import ExpertNames
from .gguf_config import field_value as _field, read_config  # noqa: F401  (engine/pooling.py reads _field)
from .progress import progress

# llama.cpp's names of a layer's tensors (blk.N.<name>) -> Hugging Face's (model.layers.N.<name>)
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# The output and MLP projections' biases, for the families whose files have them (GGUFFamily.names).
BIAS_NAMES = {"attn_output.bias": "self_attn.o_proj.bias", "ffn_gate.bias": "mlp.gate_proj.bias",
              "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, names: dict) -> str | None:
    """names: the family's layer names beyond LAYER_NAMES (GGUFFamily.names), and any global
    name of its own (a name outside blk.N.)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if not gguf_name.startswith("blk.") and gguf_name in names:  # a family's own global (LFM2's token_embd_norm)
        return names[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        name = names.get(rest) or LAYER_NAMES.get(rest)
        if name is not None:
            return f"model.layers.{idx}.{name}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert permute: rows (head, i, pair) -> (head, pair, i)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_STACKED = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def split_experts(names: ExpertNames):
    """GGUFFamily.tensor for a mixture of experts as llama.cpp stacks it: the router
    blk.N.ffn_gate_inp [E, H] and the experts ffn_gate_exps, ffn_up_exps [E, I, H] and
    ffn_down_exps [E, H, I] -> the Hugging Face names `names` gives them, one tensor per expert,
    as the checkpoints ship them (quant/fuse.py stacks them again)."""
    block, gate, *projections = names

    def tensor(idx: str, rest: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        layer = f"model.layers.{idx}.{block}"
        if rest == "ffn_gate_inp.weight":
            return {f"{layer}{gate}.weight": w}
        if rest not in _STACKED:
            return None
        proj = projections[_STACKED.index(rest)]
        return {f"{layer}experts.{e}.{proj}.weight": t for e, t in enumerate(w.unbind(0))}
    return tensor


def _dequantize(t) -> torch.Tensor:
    from gguf.quants import dequantize
    arr = dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))


def open_gguf(path):
    """A GGUF file's reader; for the first part of a split GGUF, a SplitReader over all its parts."""
    from .gguf_header import HeaderError, read_header, split_parts
    try:
        # Bounded first: the reader allocates what the header declares, and blocks on a FIFO.
        header = read_header(path)
        parts = split_parts(path, header)
    except FileNotFoundError:
        raise ModelLoadError(path, "no such file") from None
    except (OSError, HeaderError) as e:
        raise ModelLoadError(path, f"not a readable GGUF file ({e})") from None
    if len(parts) == 1:
        return _reader(path)
    readers = [_reader(path)]
    for i, part in enumerate(parts[1:], 1):
        try:
            values = read_header(part).values
        except FileNotFoundError:
            raise ModelLoadError(part, f"no such file: part {i + 1} of {len(parts)} of {path}") from None
        except (OSError, HeaderError) as e:
            raise ModelLoadError(part, f"not a readable GGUF file ({e})") from None
        if (values.get("split.no"), values.get("split.count")) != (i, len(parts)):
            raise ModelLoadError(part, f"says it is part {values.get('split.no', 0) + 1} of "
                                 f"{values.get('split.count', 1)}, not part {i + 1} of {len(parts)} of {path}")
        readers.append(_reader(part))
    return SplitReader(readers, parts, header.values.get("split.tensors.count"))


def _reader(path):
    import gguf
    try:
        return gguf.GGUFReader(str(path), "r")
    except FileNotFoundError:
        raise ModelLoadError(path, "no such file") from None
    except Exception as e:  # the reader raises many kinds on a bad file
        raise ModelLoadError(path, "not a readable GGUF file, corrupt or truncated "
                             f"({type(e).__name__}: {e})") from None


class SplitReader:
    """The parts of a split GGUF read as one file, as llama.cpp loads them: the first part's
    metadata, every part's tensors, each exactly once, as many as split.tensors.count says."""

    def __init__(self, readers: list, parts: list, tensor_count):
        self.readers, self.parts = readers, parts
        self.fields, self.data = readers[0].fields, readers[0].data
        self.tensors = [t for r in readers for t in r.tensors]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ModelLoadError(parts[0], f"tensor {twice[0]} is in more than one part of the split GGUF")
        if tensor_count != len(names):
            raise ModelLoadError(parts[0], f"split.tensors.count says {tensor_count} tensors; its {len(parts)} "
                                 f"parts hold {len(names)}")

    def get_field(self, key):
        return self.fields.get(key)


class GGUFTensors:
    """A GGUF file's tensors under Hugging Face names, by layer (layer(i): block i's; globals():
    the rest), each dequantized from the reader's memory map when its layer is asked for, so
    that conversion holds one layer in fp32 at a time (issue 39). Every name is checked on
    opening: a tensor the model would not use refuses the file before anything is read.
    registry: the families (quant/spec.py)."""

    def __init__(self, path, registry, reader=None):
        self.path = path
        self.reader = reader if reader is not None else open_gguf(path)
        self.cfg = cfg = read_config(self.reader, path, registry)
        self.family = family = registry[cfg.arch].gguf
        self.freq_factors = None
        self._layers: dict[int, list] = {}
        self._globals: list = []
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                self.freq_factors = self._dequantize(t)
                continue
            if t.name in family.config_tensors:
                continue
            if self._expand(t.name, torch.empty(0)) is None and hf_name(t.name, family.names) is None:
                # a tensor the model would not use: the file is a variant ridge does not know
                raise ModelLoadError(path, f"tensor {t.name}: not part of the {cfg.arch} model ridge runs")
            parts = t.name.split(".", 2)
            if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit():
                self._layers.setdefault(int(parts[1]), []).append(t)
            else:
                self._globals.append(t)

    def _dequantize(self, t) -> torch.Tensor:
        try:
            return _dequantize(t)
        except Exception as e:
            raise ModelLoadError(self.path, f"tensor {t.name} ({t.tensor_type.name}) cannot be read: {e}") from None

    def _expand(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The family's tensor hook (stacked experts): -> HF-named tensors, or None where it does
        not apply."""
        if self.family.tensor is None or not name.startswith("blk."):
            return None
        _, idx, rest = name.split(".", 2)
        return self.family.tensor(idx, rest, w)

    def _read(self, tensors) -> dict[str, torch.Tensor]:
        cfg, family, sd = self.cfg, self.family, {}
        for t in tensors:
            w = self._dequantize(t)
            expanded = self._expand(t.name, w)
            if expanded is not None:
                sd.update(expanded)
                continue
            if family.permuted_qk and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                w = unpermute_qk(w, cfg.num_heads)
            elif family.permuted_qk and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                w = unpermute_qk(w, cfg.num_kv_heads)
            sd[hf_name(t.name, family.names)] = w
        # The values are copies now: the file's pages just read leave the process (they stay in
        # the page cache), else every layer's would count in its resident memory to the end.
        for reader in getattr(self.reader, "readers", [self.reader]):
            mm = getattr(reader.data, "_mmap", None)
            if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
                try:
                    mm.madvise(mmap.MADV_DONTNEED)
                except (OSError, ValueError):
                    pass
        return sd

    def globals(self) -> dict[str, torch.Tensor]:
        return self._read(self._globals)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return self._read(self._layers.get(i, ()))


def load_gguf(path, registry, show_progress: bool = True):
    """-> (config, HF-named fp32 state dict, rope freq factors or None, reader): the whole model
    at once, for the callers that want it (unquantized weights, a recipe measured on the whole model)."""
    src = GGUFTensors(path, registry)
    sd = src.globals()
    for i in progress(sorted(src._layers), "dequantizing", enabled=show_progress):
        sd.update(src.layer(i))
    return src.cfg, sd, src.freq_factors, src.reader
