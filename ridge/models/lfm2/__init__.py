"""LFM2 (Lfm2Config; model.py for the math): gated short-convolution layers, whose per-request
window lives in the slot pool beside the paged KV (cache/state_cache.py), and GQA attention layers
with QK-norm, in the pattern layer_types gives ("conv" or "full_attention"; without it,
full_attn_idxs lists the attention layers, and without that every layer attends).

Read from config.json as Lfm2Config reads it: norm_eps (every RMSNorm's epsilon); conv_L_cache
(the convolution's taps) and conv_bias (biases on in_proj, out_proj and the convolution);
the MLP's width from intermediate_size (or its old name block_ff_dim) through
block_auto_adjust_ff_dim, block_ffn_dim_multiplier and block_multiple_of, as Lfm2MLP sizes it;
tie_word_embeddings (or its old name tie_embedding). The MLP runs SiLU whatever hidden_act says
(Lfm2MLP never reads it). Refused by name: a layer type but conv and full_attention, a model
without an attention layer, fewer than 2 taps.

Tensors: operator_norm and ffn_norm are the layers' input and post-attention norms,
embedding_norm the final one (applied after the last layer, despite its name); q_layernorm and
k_layernorm the QK-norms; the attention's out_proj is o_proj; feed_forward's w1, w3, w2 are
gate, up and down. FP8 covers in_proj and out_proj like every projection (quant/fp8.py
LINEAR_SUFFIXES); the convolution's taps stay fp32."""
from __future__ import annotations

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import FP8, WeightLayout, cat_rows
from ridge.quant.gguf_config import GGUFFamily
from ridge.quant.hf_config import HFConfig, HFFamily, rope_fields
from ridge.quant.spec import ModelSpec

from .model import Lfm2CausalLM

__all__ = ["SPEC", "Lfm2CausalLM"]

DEFAULTS = dict(vocab_size=65536, hidden_size=2560, intermediate_size=12288, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=128000, norm_eps=1e-5,
                tie_word_embeddings=True, rope_parameters=None, rope_theta=1000000.0, conv_bias=False,
                conv_L_cache=3, block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
                full_attn_idxs=None, layer_types=None, head_dim=None,
                # not Lfm2Config's: read through common_fields, set from LFM2's own below
                hidden_act="silu", rms_norm_eps=1e-5)
IGNORED = frozenset({"use_cache", "block_ff_dim", "tie_embedding"})  # the two old names: read below
LAYER_TYPES = ("conv", "full_attention")


def _layer_types(c: HFConfig, n: int) -> list[str]:
    types = c.get("layer_types")
    if types is None:
        idxs = c.get("full_attn_idxs")
        if idxs is None:
            idxs = list(range(n))
        if not isinstance(idxs, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in idxs):
            c.refuse("full_attn_idxs", idxs, "expected a list of layer indices")
        types = ["full_attention" if i in idxs else "conv" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        c.refuse("layer_types", types, f"expected {n} of {', '.join(LAYER_TYPES)}")
    if "full_attention" not in types:
        c.refuse("layer_types", types, "ridge needs at least one full_attention layer (its KV sizes the pool)")
    return types


def _mlp_width(c: HFConfig) -> int:
    """Lfm2MLP's width: intermediate_size, or two thirds of it times block_ffn_dim_multiplier
    rounded up to block_multiple_of where block_auto_adjust_ff_dim."""
    key = "block_ff_dim" if "block_ff_dim" in c else "intermediate_size"  # Lfm2Config: the old name wins
    width = c.positive_int(key)
    if width is None:
        c.refuse(key, None, "the MLP needs it")
    if not c.flag("block_auto_adjust_ff_dim"):
        return width
    width = int(2 * width / 3)
    mult = c.get("block_ffn_dim_multiplier")
    if mult is not None:
        width = int(c.number("block_ffn_dim_multiplier") * width)
        of = c.positive_int("block_multiple_of")
        if of is None:
            c.refuse("block_multiple_of", None, "block_ffn_dim_multiplier rounds the MLP to it")
        width = of * ((width + of - 1) // of)
    if width < 1:
        c.refuse("block_ffn_dim_multiplier", mult, f"makes the MLP {width} wide")
    return width


class Lfm2Family(HFFamily):
    """common_fields reads rms_norm_eps, hidden_act, intermediate_size and tie_word_embeddings;
    LFM2 names or derives them otherwise: its own values are read first and handed over."""

    def model_config_kwargs(self, c: HFConfig, arch: str) -> dict:
        tied = c.flag("tie_embedding") if "tie_embedding" in c else c.flag("tie_word_embeddings")
        common = HFConfig({**c.values, "rms_norm_eps": c.number("norm_eps"), "hidden_act": "silu",
                           "intermediate_size": _mlp_width(c), "tie_word_embeddings": tied}, c.path, c.defaults)
        return super().model_config_kwargs(common, arch)


def read_lfm2(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    types = _layer_types(c, n)
    taps = c.positive_int("conv_L_cache")
    if taps is None or taps < 2:
        c.refuse("conv_L_cache", taps, "ridge's convolution needs at least 2 taps")
    bias = c.flag("conv_bias")
    return dict(qk_norm=True, attention_bias=False, o_bias=False, mlp_bias=False,
                **rope_fields(c, kw["head_dim"]),
                linear_layers=[i for i, t in enumerate(types) if t == "conv"] or None,
                linear_attention={"kind": "short_conv", "channels": kw["hidden_size"], "conv_kernel": taps,
                                  "bias": bias})


# Lfm2's names under model.layers.{i}. -> the ones the fusion reads (quant/fuse.py)
RENAMES = (("operator_norm.", "input_layernorm."), ("ffn_norm.", "post_attention_layernorm."),
           ("feed_forward.w1.", "mlp.gate_proj."), ("feed_forward.w3.", "mlp.up_proj."),
           ("feed_forward.w2.", "mlp.down_proj."), ("self_attn.out_proj.", "self_attn.o_proj."),
           ("self_attn.q_layernorm.", "self_attn.q_norm."), ("self_attn.k_layernorm.", "self_attn.k_norm."))


def rename_tensors(sd: dict) -> None:
    for name in list(sd):
        new = "model.norm." + name[len("model.embedding_norm."):] if name.startswith("model.embedding_norm.") else name
        if name.startswith("model.layers."):
            head, _, rest = name.partition(".layers.")
            i, _, tail = rest.partition(".")
            for src, dst in RENAMES:
                if tail.startswith(src):
                    new = f"{head}.layers.{i}.{dst}{tail[len(src):]}"
                    break
        if new != name:
            sd[new] = sd.pop(name)


def _take(sd, name: str, path):
    if name not in sd:
        raise ModelLoadError(path, f"missing tensor {name}")
    return sd[name]


def fuse_mixer(sd, cfg: ModelConfig, i: int, out: dict, path) -> None:
    """Layer i's token mixer: the short convolution's projections and taps, or the attention's."""
    p, q = f"model.layers.{i}.", f"layers.{i}."
    if cfg.is_linear_layer(i):
        cv = p + "conv."
        bias = cfg.linear_attention["bias"]
        cat_rows(sd, [cv + "in_proj"], out, q + "in_proj", path, bias)
        cat_rows(sd, [cv + "out_proj"], out, q + "out_proj", path, bias)
        taps = _take(sd, cv + "conv.weight", path)
        if taps.dtype == FP8:
            raise ModelLoadError(path, f"tensor {cv}conv.weight: FP8 convolution taps, which ridge does not read")
        h, k = cfg.hidden_size, cfg.linear_attention["conv_kernel"]
        if taps.numel() != h * k:
            raise ModelLoadError(path, f"tensor {cv}conv.weight: {tuple(taps.shape)}, the config makes it ({h}, 1, {k})")
        out[q + "conv1d_weight"] = taps.reshape(h, k)
        if (cv + "conv.bias" in sd) != bias:
            raise ModelLoadError(path, f"tensor {cv}conv.bias: " + ("missing, which conv_bias declares" if bias else
                                                                    "present, which conv_bias=false does not declare"))
        if bias:
            out[q + "conv1d_bias"] = sd[cv + "conv.bias"]
        return
    a = p + "self_attn."
    cat_rows(sd, [a + "q_proj", a + "k_proj", a + "v_proj"], out, q + "qkv_proj", path)
    cat_rows(sd, [a + "o_proj"], out, q + "o_proj", path)
    out[q + "q_norm.weight"] = _take(sd, a + "q_norm.weight", path)
    out[q + "k_norm.weight"] = _take(sd, a + "k_norm.weight", path)


# -- GGUF, as llama.cpp's converter writes LFM2 (LFM2Model): attention.head_count_kv one a layer,
# 0 on the convolution layers; shortconv.l_cache the taps; feed_forward_length the MLP's width
# already sized; the taps squeezed to [hidden, L]; the final norm as token_embd_norm. llama.cpp
# runs its rotary as NEOX (rotate-half): the rows are not permuted. It has no convolution bias
# (a file with one is refused as a tensor ridge's lfm2 does not know).
GGUF_NAMES = {"shortconv.in_proj.weight": "conv.in_proj.weight", "shortconv.out_proj.weight": "conv.out_proj.weight",
              "shortconv.conv.weight": "conv.conv.weight", "token_embd_norm.weight": "model.norm.weight"}


def read_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    n = kw["num_layers"]
    per_layer = a("attention.head_count_kv")
    if not isinstance(per_layer, list) or len(per_layer) != n:
        raise ModelLoadError(path, f"lfm2.attention.head_count_kv={per_layer!r}: expected {n} counts, 0 on the "
                                   "convolution layers")
    conv = [i for i, h in enumerate(per_layer) if not h]
    if len(conv) == n:
        raise ModelLoadError(path, "lfm2.attention.head_count_kv: no attention layer, which ridge needs")
    taps = a("shortconv.l_cache")
    if not isinstance(taps, int) or taps < 2:
        raise ModelLoadError(path, f"lfm2.shortconv.l_cache={taps!r}: ridge's convolution needs at least 2 taps")
    return dict(qk_norm=True, attention_bias=False, o_bias=False, mlp_bias=False, linear_layers=conv or None,
                linear_attention={"kind": "short_conv", "channels": kw["hidden_size"], "conv_kernel": taps,
                                  "bias": False})


SPEC = ModelSpec("lfm2", Lfm2CausalLM,
                 Lfm2Family(DEFAULTS, read_lfm2, ignored=IGNORED, tensors=rename_tensors),
                 gguf=GGUFFamily("lfm2", read=read_gguf, keys=frozenset({"shortconv.l_cache"}), names=GGUF_NAMES),
                 weights=WeightLayout(attention=fuse_mixer))
