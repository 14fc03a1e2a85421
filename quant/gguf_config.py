"""A GGUF's metadata -> ModelConfig, as llama.cpp reads it (llama-model.cpp's hparams).

Every family shares the {arch}.* keys of COMMON_KEYS; a family (its GGUFFamily, in its folder
under ridge/models/) reads its own keys and declares them. Any other key under the architecture
may change the math (an expert count, a yarn multiplier, a window) and is refused by name."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ridge.config import ModelConfig

from .errors import ModelLoadError

COMMON_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length",
    "pooling_type",  # an embedding model's pooling: read by engine/pooling.py
})
# What a stacked mixture of experts declares (expert_feed_forward_length: the experts' width
# where it is not feed_forward_length).
EXPERT_KEYS = frozenset({"expert_count", "expert_used_count"})


@dataclass(frozen=True)
class GGUFFamily:
    """How a family's GGUF is read. arch: general.architecture; claims(meta): whether a file of
    that architecture is this family's (None: every one; llama.cpp writes some families under
    another's name); read(meta, kw, names, reader, path): ModelConfig keyword arguments beyond
    the common ones (kw), meta(key, default) reading {arch}.*, names the file's tensors;
    keys: the {arch}.* keys read beyond COMMON_KEYS.
    Tensors: names maps a layer's tensors (blk.N.<name>) to Hugging Face names beyond the common
    ones (quant/gguf_loader.py LAYER_NAMES); tensor(idx, name, w) turns one into several (stacked
    experts) or returns None; permuted_qk: llama.cpp's converter interleaved the Q and K rows for
    its NORM rope (undone on reading); config_tensors: tensors read into the config, not the model;
    partial_rotary: rope.dimension_count may be below head_dim."""
    arch: str
    claims: Callable | None = None
    read: Callable | None = None
    keys: frozenset = frozenset()
    names: dict = field(default_factory=dict)
    tensor: Callable | None = None
    permuted_qk: bool = False
    config_tensors: tuple[str, ...] = ()
    partial_rotary: bool = False
    # attention.head_count_kv may differ from layer to layer (full and sliding layers of their own
    # shapes): the first layer's count stands in until read() sets the family's own fields from the list
    kv_heads_per_layer: bool = False


def field_value(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader, path, registry) -> ModelConfig:
    """registry: the families (quant/spec.py Registry), one of which reads the file's architecture."""
    arch = field_value(reader, "general.architecture")

    def a(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    spec = registry.gguf(arch, a)
    if spec is None:
        raise ModelLoadError(path, f"unsupported architecture {arch!r}; ridge runs "
                                   f"{', '.join(registry.gguf_archs())} from GGUF")
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
        arch=spec.arch, vocab_size=int(vocab), hidden_size=int(hidden),
        intermediate_size=ffn_width(a("feed_forward_length")), num_layers=int(a("block_count")),
        num_heads=int(heads), num_kv_heads=kv_heads(a("attention.head_count_kv", heads), arch, path,
                                                    spec.gguf.kv_heads_per_layer),
        head_dim=int(a("attention.key_length", hidden // heads)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position=int(a("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        name=str(field_value(reader, "general.name", "") or ""),
    )
    if spec.gguf.read is not None:
        kw.update(spec.gguf.read(a, kw, names, reader, path))
    check_keys(spec.gguf, reader.fields, kw["head_dim"], a("rope.dimension_count"), path)
    return ModelConfig(**kw)


def ffn_width(value) -> int:
    """feed_forward_length: absent where no layer is dense, or one a layer (a hybrid's blocks, a
    wider MLP on some layers): the first layer's stands in, and such a family's read sets its own."""
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value or 0)


def kv_heads(value, arch: str, path, per_layer: bool = False) -> int:
    """attention.head_count_kv: one count, or one a layer, 0 where a layer has no attention (what
    llama.cpp's converter writes for a hybrid: its GGUFFamily.read finds those layers).
    per_layer: the counts may differ (GGUFFamily.kv_heads_per_layer); the first layer's stands in."""
    if isinstance(value, list) and per_layer and value:
        return int(value[0])
    if isinstance(value, list):
        counts = {int(v) for v in value if v}
        if len(counts) != 1:
            raise ModelLoadError(path, f"{arch}.attention.head_count_kv={value!r}: ridge needs one KV head count "
                                       "for every attention layer")
        return counts.pop()
    return int(value)


def check_keys(family: GGUFFamily, keys, head_dim: int, rotary: int | None, path) -> None:
    """keys: the file's metadata keys. rotary: rope.dimension_count, which only a family with
    partial rotary may set below head_dim."""
    arch, known = family.arch, COMMON_KEYS | family.keys
    for key in keys:
        if key.startswith(arch + ".") and key[len(arch) + 1:] not in known:
            raise ModelLoadError(path, f"{key}: a key ridge's {arch} reader does not honour")
    if not family.partial_rotary and rotary is not None and int(rotary) != head_dim:
        raise ModelLoadError(path, f"{arch}.rope.dimension_count={rotary}: partial rotary, which {arch} does not have")


def output_biases(names: set[str]) -> dict:
    """o_bias and mlp_bias, from the first layer's tensors."""
    return dict(o_bias="blk.0.attn_output.bias" in names, mlp_bias="blk.0.ffn_down.bias" in names)


def refuse_yarn_attn_factor(arch: str, a, kw: dict, path) -> None:
    """rope.scaling.attn_factor beside yarn: llama.cpp combines the two in a way ridge does not know."""
    if kw["rope_scaling"] and kw["rope_scaling"]["rope_type"] == "yarn" and a("rope.scaling.attn_factor") is not None:
        raise ModelLoadError(path, f"{arch}.rope.scaling.attn_factor={a('rope.scaling.attn_factor')!r} with yarn: "
                                   "ridge does not know how llama.cpp combines it with yarn's own scale")


def expert_fields(a, kw: dict, names: set[str], path, width: int | None = None) -> dict:
    """A stacked mixture of experts' ModelConfig fields: expert_count (E),
    expert_used_count (k), the experts width (None: expert_feed_forward_length), and its
    sparse layers: those with a router (blk.N.ffn_gate_inp). Routing as llama.cpp's graphs run
    it (norm_w): a softmax over the experts, the top k, their weights renormalised."""
    experts, k = a("expert_count"), a("expert_used_count")
    if not isinstance(experts, int) or experts < 1 or not isinstance(k, int) or not 1 <= k <= experts:
        raise ModelLoadError(path, f"expert_count={experts!r}, expert_used_count={k!r}: need 1 <= used <= count")
    n = kw["num_layers"]
    layers = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if not layers:
        raise ModelLoadError(path, f"expert_count={experts} but no layer has a router (blk.N.ffn_gate_inp)")
    inter = a("expert_feed_forward_length") if width is None else width
    if not isinstance(inter, int) or inter < 1:
        raise ModelLoadError(path, f"expert_feed_forward_length={inter!r}: expected a positive integer")
    return dict(num_experts=int(experts), num_experts_per_tok=int(k), moe_intermediate_size=int(inter),
                moe_router="softmax_topk", norm_topk_prob=True, moe_layers=None if len(layers) == n else layers)
