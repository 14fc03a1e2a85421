"""GGUF files (llama, qwen2, qwen3; gemma2 and gemma3 in quant/gguf_gemma.py; phi3, olmo2 and
granite in quant/gguf_families.py; qwen3moe, Mixtral and gpt-oss in quant/gguf_moe.py) -> ModelConfig
+ a Hugging Face-named fp32 state dict.

Dequantization is the `gguf` package's. llama.cpp's converter permutes the Q and
K rows of llama models for its interleaved RoPE; we undo it to get back the
rotate-half layout the model uses. Qwen models are stored unpermuted."""
from __future__ import annotations

import mmap

import numpy as np
import torch

from ridge.config import ModelConfig

from .errors import ModelLoadError
from .gguf_families import (CONFIG_TENSORS, FAMILY_GGUF, LAYER_NAMES as FAMILY_LAYER_NAMES, PERMUTED_QK, check_keys,
                            family_fields)
from .gguf_gemma import GEMMA_GGUF, LAYER_NAMES as GEMMA_LAYER_NAMES, gemma_fields
from .gguf_moe import GPT_OSS_LAYER_NAMES, expert_tensors, moe_arch, moe_fields
from .progress import progress

_LAYER_NAMES = {
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
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


_ARCH_LAYER_NAMES = {"gemma2": {**_LAYER_NAMES, **GEMMA_LAYER_NAMES}, "gpt_oss": {**_LAYER_NAMES, **GPT_OSS_LAYER_NAMES},
                     "gemma3_text": {**_LAYER_NAMES, **GEMMA_LAYER_NAMES},
                     **{arch: {**_LAYER_NAMES, **names} for arch, names in FAMILY_LAYER_NAMES.items()}}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """arch: ModelConfig.arch, for the families whose layers name their tensors otherwise."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        layer_names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
        if rest in layer_names:
            return f"model.layers.{idx}.{layer_names[rest]}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert permute: rows (head, i, pair) -> (head, pair, i)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


# general.architecture values this reader knows (llama.cpp writes Mistral as llama).
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss", *GEMMA_GGUF, *FAMILY_GGUF)


def read_config(reader, path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(path, f"unsupported architecture {arch!r}; ridge runs {', '.join(GGUF_ARCHS)} from GGUF")

    def a(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    hidden, heads = a("embedding_length"), a("attention.head_count")
    if hidden is None or heads is None or a("block_count") is None:
        raise ModelLoadError(path, f"missing {arch}.embedding_length/block_count/attention.head_count metadata")
    vocab = a("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    if a("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": a("rope.scaling.type"), "factor": a("rope.scaling.factor", 1.0),
                   "original_max_position_embeddings": a("rope.scaling.original_context_length", 4096)}
    kw = dict(
        arch=moe_arch(arch, a), vocab_size=int(vocab), hidden_size=int(hidden),
        intermediate_size=int(a("feed_forward_length")), num_layers=int(a("block_count")),
        num_heads=int(heads), num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", hidden // heads)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position=int(a("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        name=str(_field(reader, "general.name", "") or ""),
    )
    if arch in GEMMA_GGUF:
        kw.update(gemma_fields(arch, a, kw, names, path))
    if arch in FAMILY_GGUF:
        kw.update(family_fields(arch, a, kw, names, reader, path))
    if kw["arch"] in ("qwen3_moe", "mixtral", "gpt_oss"):
        kw.update(moe_fields(kw["arch"], a, kw, names, path))
    check_keys(arch, reader.fields, kw["head_dim"], a("rope.dimension_count"), path)
    return ModelConfig(**kw)


def _dequantize(t) -> torch.Tensor:
    from gguf.quants import dequantize
    arr = dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))


def open_gguf(path):
    import gguf

    from .gguf_header import HeaderError, read_header
    try:
        # Bounded first: the reader allocates what the header declares, and blocks on a FIFO.
        read_header(path)
    except FileNotFoundError:
        raise ModelLoadError(path, "no such file") from None
    except (OSError, HeaderError) as e:
        raise ModelLoadError(path, f"not a readable GGUF file ({e})") from None
    try:
        return gguf.GGUFReader(str(path), "r")
    except FileNotFoundError:
        raise ModelLoadError(path, "no such file") from None
    except Exception as e:  # the reader raises many kinds on a bad file
        raise ModelLoadError(path, f"not a readable GGUF file, corrupt or truncated ({type(e).__name__}: {e})") from None


class GGUFTensors:
    """A GGUF file's tensors under Hugging Face names, by layer (layer(i): block i's; globals():
    the rest), each dequantized from the reader's memory map when its layer is asked for, so
    that conversion holds one layer in fp32 at a time (issue 39). Every name is checked on
    opening: a tensor the model would not use refuses the file before anything is read."""

    def __init__(self, path, reader=None):
        self.path = path
        self.reader = reader if reader is not None else open_gguf(path)
        self.cfg = cfg = read_config(self.reader, path)
        self.freq_factors = None
        self._layers: dict[int, list] = {}
        self._globals: list = []
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                self.freq_factors = self._dequantize(t)
                continue
            if t.name in CONFIG_TENSORS:
                continue
            if expert_tensors(t.name, torch.empty(0), cfg.arch) is None and hf_name(t.name, cfg.arch) is None:
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

    def _read(self, tensors) -> dict[str, torch.Tensor]:
        cfg, sd = self.cfg, {}
        for t in tensors:
            w = self._dequantize(t)
            experts = expert_tensors(t.name, w, cfg.arch)
            if experts is not None:
                sd.update(experts)
                continue
            if cfg.arch in PERMUTED_QK and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                w = unpermute_qk(w, cfg.num_heads)
            elif cfg.arch in PERMUTED_QK and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                w = unpermute_qk(w, cfg.num_kv_heads)
            sd[hf_name(t.name, cfg.arch)] = w
        # The values are copies now: the file's pages just read leave the process (they stay in
        # the page cache), else every layer's would count in its resident memory to the end.
        mm = getattr(self.reader.data, "_mmap", None)
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


def load_gguf(path, show_progress: bool = True):
    """-> (config, HF-named fp32 state dict, rope freq factors or None, reader): the whole model
    at once, for the callers that want it (unquantized weights, a recipe measured on the whole model)."""
    src = GGUFTensors(path)
    sd = src.globals()
    for i in progress(sorted(src._layers), "dequantizing", enabled=show_progress):
        sd.update(src.layer(i))
    return src.cfg, sd, src.freq_factors, src.reader
