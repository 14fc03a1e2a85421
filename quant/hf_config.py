"""Reading a Hugging Face config.json field by field, as transformers reads it.

A family (its HFFamily, in its folder under ridge/models/) names every field its transformers
model reads.
Each is honoured, or refused with a ModelLoadError naming the field and its
value where ridge cannot run it exactly; the fields that cannot change the math
at inference (dropout, initialisation, token ids, ...) are listed as ignored.
Keys the family's transformers model never reads leave its math unchanged and
are ignored here too. The defaults are transformers' class defaults, for
configs that leave a field out."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError

# What transformers' ACT2FN runs for each name -> ridge's name for the same function. gelu_new and
# GELUTanh are one formula (their rounding differs in the last bit).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_pytorch_tanh",
               "gelu_new": "gelu_pytorch_tanh"}

# Each rope_type's parameters, as transformers' modeling_rope_utils reads them; any other key in
# rope_parameters is refused (it belongs to a variant ridge does not know).
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "original_max_position_embeddings", "truncate"},
    "longrope": {"short_factor", "long_factor", "factor", "attention_factor", "original_max_position_embeddings"},
}
ROPE_REQUIRED = {"linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
                 "yarn": {"factor"}, "longrope": {"short_factor", "long_factor"}}
_ROPE_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# PreTrainedConfig's own fields and the keys save_pretrained adds: none changes a causal LM's math.
BASE_IGNORED = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype", "torch_dtype",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "model_type",
    "_name_or_path", "auto_map", "use_cache", "initializer_range", "pad_token_id", "bos_token_id",
    "eos_token_id", "attention_dropout",
})
# What common_fields and rope_fields read for every family.
COMMON_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                 "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta")
# A router's training-time terms, which do not change inference.
MOE_IGNORED = frozenset({"output_router_logits", "router_aux_loss_coef"})


class HFConfig:
    """config.json's values with the family's defaults; refuse() names the field and its value."""

    def __init__(self, values: dict, path: Path, defaults: dict):
        self.values, self.path, self.defaults = values, path, defaults

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str):
        """The value, or transformers' default where the file leaves the key out (None stays None)."""
        return self.values[key] if key in self.values else self.defaults.get(key)

    def require(self, key: str):
        v = self.get(key)
        if v is None:
            raise ModelLoadError(self.path, f"config.json has no {key}")
        return v

    def refuse(self, key: str, value, why: str):
        raise ModelLoadError(self.path, f"{key}={value!r}: {why}")

    def flag(self, key: str) -> bool:
        v = self.get(key)
        if not isinstance(v, bool):
            self.refuse(key, v, "expected true or false")
        return v

    def number(self, key: str) -> float:
        v = self.require(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.refuse(key, v, "expected a finite number")
        return float(v)

    def positive_int(self, key: str) -> int | None:
        v = self.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            self.refuse(key, v, "expected a positive integer")
        return v


@dataclass(frozen=True)
class HFFamily:
    """How a family reads config.json. defaults: transformers' class defaults of the fields read
    (COMMON_FIELDS and the family's own); ignored: its class fields that do not change the math at
    inference; read: the family's own fields -> ModelConfig keyword arguments, given the common ones."""
    defaults: dict
    read: Callable[[HFConfig, dict], dict]
    ignored: frozenset = frozenset()
    act_field: str = "hidden_act"  # the activation's key in the config class
    # quantization_config methods the family's checkpoints ship besides FP8, dequantized as they
    # are read (the fusion's experts hook reads them)
    quant_methods: tuple[str, ...] = ()
    # Each batch of tensors read, rewritten in place before fusion (a norm stored otherwise than
    # the model takes it); None: as they are.
    tensors: Callable[[dict], None] | None = None
    # A checkpoint's tensor name -> the one the converter reads, for checkpoints that name their
    # tensors otherwise than the family's transformers model holds them (its conversion mapping's
    # renames); None: as they are.
    rename: Callable[[str], str] | None = None

    @property
    def fields(self) -> set[str]:
        return set(self.defaults) | set(COMMON_FIELDS)

    def model_config_kwargs(self, c: HFConfig, arch: str) -> dict:
        kw = common_fields(c, arch, self.act_field)
        return {**kw, **self.read(c, kw)}


@dataclass(frozen=True)
class HFWrapper:
    """Another model_type whose checkpoints hold a family's model (a multimodal model served as
    text): its config's defaults, the view of its text model's config (text_config), and its
    tensors' names as the family's (tensor_name -> None: another modality's, never read)."""
    model_type: str
    defaults: dict
    text_config: Callable[[HFConfig], HFConfig]
    tensor_name: Callable[[str, Path], str | None]
    skipped: str  # what the unread tensors are, for the log
    # An image model's encoder, read beside its text model (path, device, dtype -> an object with
    # encode(inputs) and weight_bytes(), or None where the directory holds none); None: text only.
    vision: Callable | None = None


class TextConfigView(HFConfig):
    """A wrapper's text_config (HFWrapper): a refusal names the field as text_config.<key>."""

    def refuse(self, key: str, value, why: str):
        super().refuse(f"text_config.{key}", value, why)


def nested_text_config(c: HFConfig, model_type: str, defaults: dict, family: str, *, required: bool = False,
                       tie: bool = True) -> TextConfigView:
    """A wrapper's text_config as its text model's config: a JSON object of model_type (absent: the
    text config class's defaults, as transformers builds one, unless required); with tie, the
    wrapper's own tie_word_embeddings (the flag its ForConditionalGeneration ties the head by)."""
    text = c.get("text_config")
    if text is None and not required:
        text = {}
    if not isinstance(text, dict):
        c.refuse("text_config", text, f"expected the text model's config (a {model_type})")
    if text.get("model_type", None if required else model_type) != model_type:
        c.refuse("text_config.model_type", text.get("model_type"), f"{family}'s text model is {model_type}")
    return TextConfigView({**text, "tie_word_embeddings": c.flag("tie_word_embeddings")} if tie else text,
                          c.path, defaults)


def wrapper_names(text_prefixes: tuple[tuple[str, str], ...], skipped_prefixes: tuple[str, ...], skipped: str,
                  cls: str) -> Callable[[str, Path], str | None]:
    """An HFWrapper's tensor_name: a tensor under one of text_prefixes renamed as the text model
    names it (the first that matches), one under skipped_prefixes (another modality's) None, any
    other refused, naming the class whose layout was expected."""
    def tensor_name(name: str, path: Path) -> str | None:
        for src, dst in text_prefixes:
            if name.startswith(src):
                return dst + name[len(src):]
        if name.startswith(skipped_prefixes):
            return None
        raise ModelLoadError(path, f"tensor {name}: neither the language model's nor the {skipped}'s ({cls}'s names)")
    return tensor_name


def attention_biases(c: HFConfig, mlp: bool) -> dict:
    """attention_bias: q, k, v and o projections; mlp_bias (where the family reads it): gate, up, down."""
    b = c.flag("attention_bias")
    return dict(attention_bias=b, o_bias=b, mlp_bias=c.flag("mlp_bias") if mlp else False)


def common_fields(c: HFConfig, arch: str, act_field: str = "hidden_act") -> dict:
    """The fields every decoder family reads, as ModelConfig keyword arguments. act_field: the
    activation's key in the family's config class."""
    heads = c.positive_int("num_attention_heads")
    hidden = c.positive_int("hidden_size")
    act = c.get(act_field)
    if act not in ACTIVATIONS:
        c.refuse(act_field, act, f"ridge runs {', '.join(ACTIVATIONS)}")
    return dict(
        arch=arch, vocab_size=c.positive_int("vocab_size"), hidden_size=hidden,
        intermediate_size=c.positive_int("intermediate_size"), num_layers=c.positive_int("num_hidden_layers"),
        num_heads=heads, num_kv_heads=c.positive_int("num_key_value_heads") or heads,
        head_dim=c.positive_int("head_dim") or hidden // heads, rms_norm_eps=c.number("rms_norm_eps"),
        max_position=c.positive_int("max_position_embeddings"), tie_word_embeddings=c.flag("tie_word_embeddings"),
        hidden_act=ACTIVATIONS[act], name=c.path.name,
    )


def rope_fields(c: HFConfig, head_dim: int, *, types: tuple[str, ...] = ("default", "linear", "llama3", "yarn"),
                aliases: dict | None = None, partial_rotary: bool = False, original_max_field: bool = False) -> dict:
    """rope_theta, rope_scaling (rope_type and every parameter its formula reads, filled as
    transformers' standardize_rope_params fills them) and rotary_dim.
    aliases: old rope_type names. partial_rotary: the family rotates the first
    partial_rotary_factor of each head. original_max_field: the family's config class declares
    original_max_position_embeddings, which then overrides rope_parameters' own."""
    params = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})  # transformers: rope_scaling first
    where = "rope_parameters"
    theta = params.get("rope_theta", c.get("rope_theta") if c.get("rope_theta") is not None else 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    kind = (aliases or {}).get(kind, kind)
    if kind not in types:
        c.refuse(f"{where}.rope_type", kind, f"ridge runs {', '.join(types)} for this family")
    unknown = sorted(set(params) - _ROPE_COMMON - ROPE_KEYS[kind])
    if unknown:
        c.refuse(f"{where}.{unknown[0]}", params[unknown[0]], f"not a parameter of rope_type {kind!r} that ridge knows")
    missing = sorted(ROPE_REQUIRED.get(kind, set()) - set(params))
    if missing:
        c.refuse(f"{where}.{missing[0]}", None, f"rope_type {kind!r} needs it")
    prf = params.get("partial_rotary_factor", c.get("partial_rotary_factor") or 1.0)
    rotary_dim = int(head_dim * prf)
    if prf != 1.0 and (not partial_rotary or rotary_dim % 2 or not 0 < rotary_dim <= head_dim):
        c.refuse("partial_rotary_factor", prf, "this family rotates every dim of a head" if not partial_rotary
                 else f"gives {rotary_dim} rotary dims of {head_dim}; ridge needs an even number")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        c.refuse("rope_theta", theta, "expected a positive number")
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in params.items() if k in ROPE_KEYS[kind]}
        scaling["rope_type"] = kind
        if "original_max_position_embeddings" in ROPE_KEYS[kind]:
            if original_max_field:
                scaling["original_max_position_embeddings"] = c.positive_int("original_max_position_embeddings")
            else:
                scaling.setdefault("original_max_position_embeddings", c.get("max_position_embeddings"))
        if kind in ("yarn", "longrope") and scaling.get("factor") is None:  # transformers' rule for both
            scaling["factor"] = c.get("max_position_embeddings") / scaling["original_max_position_embeddings"]
        if kind == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(scaling[key]) != rotary_dim // 2:
                    c.refuse(f"{where}.{key}", f"{len(scaling[key])} values", f"needs {rotary_dim // 2}, one per frequency")
    return dict(rope_theta=float(theta), rope_scaling=scaling, rotary_dim=None if rotary_dim == head_dim else rotary_dim)


def window_all(c: HFConfig, num_layers: int) -> dict:
    """sliding_window on every layer; None: full attention."""
    w = c.positive_int("sliding_window")
    return dict(sliding_window=w, layer_types=None if w is None else ["sliding_attention"] * num_layers)


LAYER_TYPES = ("full_attention", "sliding_attention")


def window_from_layer_types(c: HFConfig, num_layers: int, window: int | None, default_types: list[str]) -> dict:
    """layer_types as given (each of LAYER_TYPES), else default_types; sliding layers get `window`
    (None: they attend to everything, as in transformers)."""
    types = c.get("layer_types")
    if types is None:
        types = default_types
    elif not isinstance(types, list) or len(types) != num_layers:
        c.refuse("layer_types", types, f"expected a list of {num_layers} layer types")
    for t in types:
        if t not in LAYER_TYPES:
            c.refuse("layer_types", t, f"ridge runs {', '.join(LAYER_TYPES)}")
    if window is None or "sliding_attention" not in types:
        return dict(sliding_window=None, layer_types=None)
    return dict(sliding_window=window, layer_types=list(types))


# -- mixtures of experts: the fields transformers' MoE configs share.
def experts_count(c: HFConfig, key: str, alias: str | None = None) -> tuple[int, int]:
    """-> (E, k). alias: the config class's other name for the count (its attribute_map), which
    a saved file may carry instead; both given must agree."""
    e = c.get(key)
    if alias and alias in c:
        other = c.values[alias]
        if key in c and other != e:
            c.refuse(alias, other, f"disagrees with {key}={e!r}")
        e = other
    if isinstance(e, bool) or not isinstance(e, int) or e < 0:
        c.refuse(alias if alias and alias in c else key, e, "expected a non-negative integer")
    k = c.positive_int("num_experts_per_tok")
    if e and k > e:
        c.refuse("num_experts_per_tok", k, f"more than the {e} experts")
    return e, k


def moe_fields(experts: int, k: int, width: int, layers: list[int], n: int, norm: bool) -> dict:
    """ModelConfig's expert fields: E experts of `width`, k a token, in `layers` of the n, routed
    softmax then top k (renormalised where norm); no sparse layer: the dense model transformers builds."""
    if not layers:
        return {}
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=width, norm_topk_prob=norm,
                moe_router="softmax_topk", moe_layers=None if len(layers) == n else layers)
