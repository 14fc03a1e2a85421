"""Qwen3.5 dense (Qwen3_5TextConfig; model.py for the math): a hybrid of Gated DeltaNet layers,
whose per-request state lives in the slot pool beside the paged KV (cache/state_cache.py), and
gated full-attention layers, in the pattern layer_types gives (by default every
full_attention_interval-th layer attends, 4).

Read from config.json: the linear layers' shape (linear_num_key_heads, linear_num_value_heads,
linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim); partial rotary
(partial_rotary_factor, 0.25 by default); mrope_section and mrope_interleaved in rope_parameters
are read and left: a text token has one position in all three of mrope's sections, where mrope
is the plain rotation. hidden_act is also the convolution's activation, which ridge's kernels run
as SiLU only. Refused by name: a layer type but linear_attention and full_attention, a model
without an attention layer, value heads that are no multiple of the key heads.

Tensors: the norms multiply by 1 + w (Qwen3_5RMSNorm), stored shifted here, but the gated norm of
the linear layers (its weight plain); the linear layers' in_proj_qkv, in_proj_z, in_proj_b and
in_proj_a fuse into in_proj (FP8 like every projection: quant/fp8.py LINEAR_SUFFIXES); q_proj's
per-head [q | gate] rows split into qkv_proj's [q | k | v | gate]."""
from __future__ import annotations

import torch

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import FP8, WeightLayout, cat_rows
from ridge.quant.hf_config import HFConfig, HFFamily, HFWrapper, attention_biases, rope_fields
from ridge.quant.spec import ModelSpec

from . import gguf
from ..qwen2_5_vl.config import mrope_section
from .model import Qwen35CausalLM
from .vision import load_vision, read_vision

__all__ = ["SPEC", "Qwen35CausalLM"]

DEFAULTS = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                num_attention_heads=16, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=None, attention_bias=False,
                head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=32, layer_types=None, full_attention_interval=4,
                partial_rotary_factor=0.25, rope_theta=10000.0)
LAYER_TYPES = ("linear_attention", "full_attention")
MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # one position per text token: no effect
MROPE_SECTION = [11, 11, 10]  # Qwen3_5TextRotaryEmbedding's default


def _layer_types(c: HFConfig, n: int) -> list[str]:
    types = c.get("layer_types")
    if types is None:
        every = c.positive_int("full_attention_interval")
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        c.refuse("layer_types", types, f"expected {n} of {', '.join(LAYER_TYPES)}")
    if "full_attention" not in types:
        c.refuse("layer_types", types, "ridge needs at least one full_attention layer (its KV sizes the pool)")
    return types


def _linear_shape(c: HFConfig) -> dict:
    la = {k: c.positive_int(f"linear_{src}") for k, src in (
        ("num_key_heads", "num_key_heads"), ("num_value_heads", "num_value_heads"), ("key_head_dim", "key_head_dim"),
        ("value_head_dim", "value_head_dim"), ("conv_kernel", "conv_kernel_dim"))}
    for k, v in la.items():
        if v is None:
            c.refuse(f"linear_{k}", None, "the linear-attention layers need it")
    if la["num_value_heads"] % la["num_key_heads"]:
        c.refuse("linear_num_value_heads", la["num_value_heads"],
                 f"must be a multiple of linear_num_key_heads={la['num_key_heads']}")
    if la["conv_kernel"] < 2:
        c.refuse("linear_conv_kernel_dim", la["conv_kernel"], "ridge's convolution needs at least 2 taps")
    return la


def _without_mrope(c: HFConfig) -> HFConfig:
    params = c.get("rope_parameters")
    if not isinstance(params, dict) or not any(k in params for k in MROPE_KEYS):
        return c
    return HFConfig({**c.values, "rope_parameters": {k: v for k, v in params.items() if k not in MROPE_KEYS}},
                    c.path, c.defaults)


def read_qwen3_5(c: HFConfig, kw: dict) -> dict:
    if kw["hidden_act"] != "silu":  # the convolution's activation too: ridge's kernels run SiLU
        c.refuse("hidden_act", c.get("hidden_act"), "Qwen3.5's convolution runs it; ridge runs silu there")
    n = kw["num_layers"]
    types = _layer_types(c, n)
    return dict(qk_norm=True, **attention_biases(c, mlp=False),
                **rope_fields(_without_mrope(c), kw["head_dim"], partial_rotary=True),
                linear_layers=[i for i, t in enumerate(types) if t == "linear_attention"] or None,
                linear_attention=_linear_shape(c),
                # an image's tokens (Qwen3.5 with vision): Qwen3_5TextRotaryEmbedding always interleaves
                extra={"mrope_section": mrope_section(c, kw["head_dim"], MROPE_SECTION, interleaved=True),
                       "mrope_interleaved": True, "attention_output_gate": True})


def shift_norms(sd: dict[str, torch.Tensor]) -> None:
    """Qwen3_5RMSNorm multiplies by 1 + w (in fp32): the model takes the multiplier. The linear
    layers' gated norm multiplies by its weight as it is."""
    for name, t in sd.items():
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            sd[name] = t.float() + 1.0


def _take(sd, name: str, path) -> torch.Tensor:
    if name not in sd:
        raise ModelLoadError(path, f"missing tensor {name}")
    return sd[name]


def _split_gate(sd, a: str, cfg: ModelConfig, path) -> dict[str, torch.Tensor]:
    """q_proj's rows, [q | gate] per head -> q's rows and the gate's, each with its scales and bias."""
    H, D = cfg.num_heads, cfg.head_dim
    out = {}
    for suffix in (".weight", ".weight_scale", ".bias"):
        t = sd.get(a + "q_proj" + suffix)
        if t is None or (suffix == ".weight_scale" and t.numel() == 1):
            if t is not None:  # one scale for the tensor: both halves take it
                out[a + "q_only" + suffix] = out[a + "gate" + suffix] = t
            continue
        if t.shape[0] != 2 * H * D:
            raise ModelLoadError(path, f"tensor {a}q_proj{suffix}: {tuple(t.shape)}, the config makes it "
                                       f"{2 * H * D} rows (a query and a gate per head)")
        halves = t.reshape(H, 2, D, *t.shape[1:])
        out[a + "q_only" + suffix] = halves[:, 0].reshape(H * D, *t.shape[1:])
        out[a + "gate" + suffix] = halves[:, 1].reshape(H * D, *t.shape[1:])
    if a + "q_only.weight" not in out:
        raise ModelLoadError(path, f"missing tensor {a}q_proj.weight")
    return out


def fuse_mixer(sd, cfg: ModelConfig, i: int, out: dict, path) -> None:
    """Layer i's token mixer: a Gated DeltaNet's projections, taps and decay, or the gated attention's."""
    p, q = f"model.layers.{i}.", f"layers.{i}."
    if cfg.is_linear_layer(i):
        la = p + "linear_attn."
        cat_rows(sd, [la + "in_proj_qkv", la + "in_proj_z", la + "in_proj_b", la + "in_proj_a"], out, q + "in_proj", path)
        cat_rows(sd, [la + "out_proj"], out, q + "out_proj", path)
        conv = _take(sd, la + "conv1d.weight", path)
        if conv.dtype == FP8:
            raise ModelLoadError(path, f"tensor {la}conv1d.weight: FP8 convolution taps, which ridge does not read")
        out[q + "conv1d_weight"] = conv.reshape(conv.shape[0], conv.shape[-1])
        for src, dst in (("A_log", "A_log"), ("dt_bias", "dt_bias"), ("norm.weight", "gated_norm.weight")):
            out[q + dst] = _take(sd, la + src, path)
        return
    a = p + "self_attn."
    view = {**sd, **_split_gate(sd, a, cfg, path)}
    cat_rows(view, [a + "q_only", a + "k_proj", a + "v_proj", a + "gate"], out, q + "qkv_proj", path, cfg.attention_bias)
    cat_rows(sd, [a + "o_proj"], out, q + "o_proj", path, cfg.o_bias)
    out[q + "q_norm.weight"] = _take(sd, a + "q_norm.weight", path)
    out[q + "k_norm.weight"] = _take(sd, a + "k_norm.weight", path)


# -- Qwen3_5ForConditionalGeneration (model_type qwen3_5: the Hub's Qwen3.5 checkpoints) served as
# text: its text_config (a qwen3_5_text) read as above; the vision tower (model.visual.) and the
# multi-token-prediction layers (mtp.: a draft head, loaded apart by mtp.py) are not read here.
WRAPPER_DEFAULTS = dict(tie_word_embeddings=False, image_token_id=248056, video_token_id=248057,
                        vision_start_token_id=248053, vision_end_token_id=248054)
WRAPPER_IGNORED = frozenset({"vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                             "vision_end_token_id"})


class _TextConfig(HFConfig):
    """text_config's values: a refusal names the field as text_config.<key>."""

    def refuse(self, key: str, value, why: str):
        super().refuse(f"text_config.{key}", value, why)


def text_config(c: HFConfig) -> HFConfig:
    text = c.get("text_config")
    if text is None:
        text = {}  # Qwen3_5Config builds a default Qwen3_5TextConfig
    if not isinstance(text, dict):
        c.refuse("text_config", text, "expected a JSON object")
    if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        c.refuse("text_config.model_type", text["model_type"], "Qwen3.5's text model is qwen3_5_text")
    tied = c.flag("tie_word_embeddings")
    if "tie_word_embeddings" in text and text["tie_word_embeddings"] != tied:
        c.refuse("text_config.tie_word_embeddings", text["tie_word_embeddings"],
                 f"disagrees with tie_word_embeddings={tied!r}, which ties the head of the checkpoint")
    view = _TextConfig({**text, "tie_word_embeddings": tied}, c.path, DEFAULTS)
    # the checkpoint is one model: a tower ridge cannot run is refused however it is served (a file
    # without one has no tower's tensors either: load_vision finds none)
    vision = read_vision(c) if "vision_config" in c else None
    if vision is not None and vision.out_hidden_size != view.positive_int("hidden_size"):
        c.refuse("vision_config.out_hidden_size", vision.out_hidden_size,
                 f"the merger's rows replace embeddings of hidden_size={view.get('hidden_size')}")
    return view


_TEXT_PREFIXES = (("model.language_model.", "model."), ("lm_head.", "lm_head."))
_UNREAD_PREFIXES = ("model.visual.", "mtp.")


def text_name(name: str, path) -> str | None:
    for src, dst in _TEXT_PREFIXES:
        if name.startswith(src):
            return dst + name[len(src):]
    if name.startswith(_UNREAD_PREFIXES):
        return None
    raise ModelLoadError(path, f"tensor {name}: neither the language model's nor the vision tower's or the MTP "
                               "layers' (Qwen3_5ForConditionalGeneration's names)")


SPEC = ModelSpec("qwen3_5_text", Qwen35CausalLM,
                 HFFamily(DEFAULTS, read_qwen3_5, tensors=shift_norms),
                 gguf=gguf.family("qwen35", moe=False),  # GGUF as llama.cpp writes it: gguf.py
                 weights=WeightLayout(attention=gguf.mixer(fuse_mixer)),
                 hf_wrappers=(HFWrapper("qwen3_5", WRAPPER_DEFAULTS, text_config, text_name,
                                        "vision tower and multi-token-prediction", vision=load_vision),))
