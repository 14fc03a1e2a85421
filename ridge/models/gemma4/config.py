"""Gemma 4 (text)'s config: the fields Gemma4TextConfig reads in transformers 5.25, with its
defaults, honoured or refused by name, and its checkpoints' tensors into the model's layout.

What the reading decides (transformers' Gemma4TextConfig.__post_init__ and kv_sharing_modes):
- layer types: 5 sliding to 1 full unless layer_types says otherwise, and the last layer always
  full (transformers forces it, with a warning; so does this reading);
- RoPE per layer type (rope_parameters keyed by full_attention and sliding_attention): default
  on the sliding layers, proportional on the full ones (ridge/models/layers/rope.py);
- the full layers' heads: global_head_dim wide, with num_global_key_value_heads KV heads where
  attention_k_eq_v (or per_layer_config's overrides, as transformers saves them); their paged KV
  blocks take that shape (ModelConfig.layer_kv_shape);
- KV-shared layers: the last num_kv_shared_layers layers read the K and V of the last earlier
  layer of their type and compute none (their source: extra["kv_source"]);
- use_double_wide_mlp: the KV-shared layers' MLP is twice intermediate_size;
- attention_k_eq_v: the full layers' values are their keys' projection (no v_proj);
- hidden_size_per_layer_input: the per-layer input embeddings (model.py).
- enable_moe_block (the 26B-A4B shape): every layer runs a mixture of experts beside its dense
  MLP (num_experts, top_k_experts of moe_intermediate_size; the router's own rule, model.py), the
  two branches normed apart and summed."""
from __future__ import annotations

from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import WeightLayout, cat_rows
from ridge.quant.hf_config import LAYER_TYPES, HFConfig, nested_text_config, wrapper_names

from ..gemma2.config import cap

GEMMA4_DEFAULTS = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=None, rope_scaling=None, rope_theta=None,
    attention_bias=False, sliding_window=512, layer_types=None, final_logit_softcapping=None,
    use_bidirectional_attention=None, vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256,
    attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False,
    num_experts=None, top_k_experts=None, moe_intermediate_size=None,
    # __post_init__'s keyword arguments: the full layers' heads, unless per_layer_config is given
    global_head_dim=512, num_global_key_value_heads=None, per_layer_config=None, pad_token_id=0)
# Gemma4TextConfig's defaults where rope_parameters is absent
DEFAULT_ROPES = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}
ROPE_KEYS = {"default": {"rope_type", "rope_theta"},
             "proportional": {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}}
# Each layer's four Gemma norms, as Gemma 2's; the norms multiply by w itself (no 1 + w).
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _int(c: HFConfig, key: str, lo: int = 0) -> int:
    v = c.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        c.refuse(key, v, f"expected an integer >= {lo}")
    return v


def _layer_types(c: HFConfig, n: int) -> list[str]:
    types = c.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    elif not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        c.refuse("layer_types", types, f"expected {n} of {', '.join(LAYER_TYPES)}")
    return list(types[:-1]) + ["full_attention"]  # transformers forces the last layer full


def _rope(c: HFConfig, layer_type: str) -> tuple[float, dict | None]:
    """-> (base, ridge's rope_scaling) of one layer type."""
    ropes = c.get("rope_parameters")
    ropes = DEFAULT_ROPES if ropes is None else ropes
    where = f"rope_parameters.{layer_type}"
    if not isinstance(ropes, dict) or set(ropes) - set(LAYER_TYPES):
        c.refuse("rope_parameters", ropes, "Gemma 4 keys it by layer type (full_attention, sliding_attention)")
    p = ropes.get(layer_type)
    if not isinstance(p, dict):
        c.refuse(where, p, "expected a JSON object")
    kind = p.get("rope_type", "default")
    if kind not in ROPE_KEYS:
        c.refuse(f"{where}.rope_type", kind, f"ridge runs {', '.join(ROPE_KEYS)} for Gemma 4")
    unknown = sorted(set(p) - ROPE_KEYS[kind])
    if unknown:
        c.refuse(f"{where}.{unknown[0]}", p[unknown[0]], f"not a parameter of rope_type {kind!r}")
    theta = p.get("rope_theta", 10_000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        c.refuse(f"{where}.rope_theta", theta, "expected a positive number")
    if kind == "default":
        return float(theta), None
    factor, part = p.get("factor", 1.0), p.get("partial_rotary_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        c.refuse(f"{where}.factor", factor, "expected a positive number")
    if isinstance(part, bool) or not isinstance(part, (int, float)) or not 0 <= part <= 1:
        c.refuse(f"{where}.partial_rotary_factor", part, "expected a number in [0, 1]")
    return float(theta), {"rope_type": "proportional", "partial_rotary_factor": float(part), "factor": float(factor)}


def _full_heads(c: HFConfig, kw: dict, types: list[str]) -> dict:
    """The full layers' head size and KV heads (ModelConfig.global_head_dim, global_kv_heads), as
    Gemma4TextConfig sets them: per_layer_config's overrides (what transformers saves), else
    global_head_dim, with num_global_key_value_heads where attention_k_eq_v."""
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    overrides = c.get("per_layer_config")
    if overrides is not None:
        if not isinstance(overrides, dict):
            c.refuse("per_layer_config", overrides, "expected a JSON object")
        if not overrides:  # no overrides: every layer as head_dim and num_key_value_heads say
            return {}
        values = [overrides.get(str(i), overrides.get(i)) for i in full]
        if len(overrides) != len(full) or any(v != values[0] for v in values) or not isinstance(values[0], dict) \
                or set(values[0]) - {"head_dim", "num_key_value_heads"}:
            c.refuse("per_layer_config", overrides, "ridge reads one head_dim and num_key_value_heads override "
                                                    f"for every full layer ({full}) and none for the others")
        dim, heads = values[0].get("head_dim"), values[0].get("num_key_value_heads")
    else:
        dim = _int(c, "global_head_dim", 1)
        heads = c.get("num_global_key_value_heads") if c.get("attention_k_eq_v") else None
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2):
        c.refuse("global_head_dim", dim, "expected a positive even integer")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0
                              or kw["num_heads"] % heads):
        c.refuse("num_global_key_value_heads", heads, f"expected a divisor of num_attention_heads={kw['num_heads']}")
    return dict(global_head_dim=dim if dim != kw["head_dim"] else None,
                global_kv_heads=heads if heads != kw["num_kv_heads"] else None)


def _moe(c: HFConfig) -> dict:
    """The MoE block's ModelConfig fields (enable_moe_block), or none."""
    on = c.get("enable_moe_block")
    if not isinstance(on, bool):
        c.refuse("enable_moe_block", on, "expected true or false")
    if not on:
        return {}
    experts, k, inter = _int(c, "num_experts", 1), _int(c, "top_k_experts", 1), _int(c, "moe_intermediate_size", 1)
    if k > experts:
        c.refuse("top_k_experts", k, f"expected at most num_experts={experts}")
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=inter,
                moe_router="softmax_topk_scaled", norm_topk_prob=True)


def _kv_sources(c: HFConfig, types: list[str]) -> list[int | None]:
    """Each layer's source of K and V: None where it computes its own, else the last layer before
    the shared ones of its type (transformers' kv_sharing_modes)."""
    n, shared = len(types), _int(c, "num_kv_shared_layers")
    if shared >= n:
        c.refuse("num_kv_shared_layers", shared,
                 f"expected fewer than the {n} layers (some layer must compute K and V)")
    first = n - shared
    last = {t: i for i, t in enumerate(types[:first])}
    if shared and set(types[first:]) - set(last):
        c.refuse("num_kv_shared_layers", shared, "a shared layer's type has no earlier layer that computes its K and V")
    return [None if i < first else last[types[i]] for i in range(n)]


def read_gemma4(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    if kw["hidden_act"] != "gelu_pytorch_tanh":
        c.refuse("hidden_activation", c.get("hidden_activation"), "ridge runs Gemma with gelu_pytorch_tanh")
    if c.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": text tokens stay causal
        c.refuse("use_bidirectional_attention", c.get("use_bidirectional_attention"), "ridge runs causal decoders only")
    moe = _moe(c)
    for key in ("rope_theta", "rope_scaling"):
        if c.get(key) is not None:
            c.refuse(key, c.get(key), "Gemma 4 reads its RoPE from rope_parameters, per layer type")
    types = _layer_types(c, n)
    window = c.positive_int("sliding_window")
    if window is None and "sliding_attention" in types:
        c.refuse("sliding_window", None, "sliding layers need a window")
    full_theta, full_scaling = _rope(c, "full_attention")
    local_theta, local_scaling = _rope(c, "sliding_attention") if "sliding_attention" in types else (None, None)
    per_layer = c.get("hidden_size_per_layer_input") or 0
    if isinstance(per_layer, bool) or not isinstance(per_layer, int) or per_layer < 0:
        c.refuse("hidden_size_per_layer_input", per_layer, "expected a non-negative integer")
    if per_layer and _int(c, "vocab_size_per_layer_input", 1) < kw["vocab_size"]:
        # transformers looks every token up in this table: a smaller one fails on the others
        c.refuse("vocab_size_per_layer_input", c.get("vocab_size_per_layer_input"),
                 f"smaller than vocab_size={kw['vocab_size']}")
    bias = c.flag("attention_bias")
    sliding = "sliding_attention" in types
    placeholders = c.get(PLACEHOLDERS) or []  # the multimodal wrapper's (text_config below)
    pad = c.get("pad_token_id") if placeholders else None
    if placeholders and (isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < kw["vocab_size"]):
        c.refuse("pad_token_id", pad, "the image, video and audio placeholders are embedded as it: expected a token id")
    return dict(**_full_heads(c, kw, types), **moe, attention_bias=bias, o_bias=bias, qk_norm=True, softmax_scale=1.0,
                sliding_window=window if sliding else None, layer_types=types if sliding else None,
                rope_theta=full_theta, rope_scaling=full_scaling, rope_local_theta=local_theta,
                rope_local_scaling=local_scaling, final_logit_softcapping=cap(c, "final_logit_softcapping"),
                extra=dict(per_layer_input=per_layer, kv_source=_kv_sources(c, types), moe_beside_mlp=bool(moe),
                           double_wide_mlp=c.flag("use_double_wide_mlp"), k_eq_v=c.flag("attention_k_eq_v"),
                           placeholders=list(placeholders), pad_token_id=pad),
                # "vision": an image's tokens see each other both ways on the sliding layers (transformers'
                # create_masks_for_vision_model), the full layers causal
                image_attention_bidirectional="sliding" if c.get("use_bidirectional_attention") == "vision" else False)


# -- tensors: Hugging Face names -> the model's
def _take(sd, src: str, out: dict, dst: str, path) -> None:
    if src not in sd:
        raise ModelLoadError(path, f"missing tensor {src}")
    out[dst] = sd[src]


def fuse_attention(sd, cfg, i: int, out: dict, path) -> None:
    """A layer's q, k, v (rows [q | k | v] as every family's) and o; a KV-shared layer has q
    alone, and a full layer with attention_k_eq_v takes its keys' rows as its values'."""
    a, q = f"model.layers.{i}.self_attn.", f"layers.{i}."
    if cfg.extra["kv_source"][i] is not None:
        rows = [a + "q_proj"]
    else:
        same = cfg.extra["k_eq_v"] and cfg.layer_window(i) is None
        rows = [a + "q_proj", a + "k_proj", a + ("k_proj" if same else "v_proj")]
        _take(sd, a + "k_norm.weight", out, q + "k_norm.weight", path)
    cat_rows(sd, rows, out, q + "qkv_proj", path, cfg.attention_bias)
    cat_rows(sd, [a + "o_proj"], out, q + "o_proj", path, cfg.o_bias)
    _take(sd, a + "q_norm.weight", out, q + "q_norm.weight", path)


def fuse_layer_tensors(sd, cfg, i: int, out: dict, path) -> None:
    p, q = f"model.layers.{i}.", f"layers.{i}."
    _take(sd, p + "layer_scalar", out, q + "layer_scalar", path)
    if cfg.extra["per_layer_input"]:
        for name in ("per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight"):
            _take(sd, p + name, out, q + name, path)


MOE_NORMS = ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")


def fuse_mlp(sd, cfg, i: int, out: dict, path) -> None:
    """The dense MLP, and where enable_moe_block the experts beside it: the router's projection,
    input scale and per-expert scale, the stacked experts (transformers 5's [E, 2I, H] and
    [E, H, I], rows [gate | up]) and the MoE branch's three norms."""
    p, q = f"model.layers.{i}.", f"layers.{i}."
    cat_rows(sd, [p + "mlp.gate_proj", p + "mlp.up_proj"], out, q + "gate_up_proj", path)
    cat_rows(sd, [p + "mlp.down_proj"], out, q + "down_proj", path)
    if not cfg.num_experts:
        return
    E, inter, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for src, dst, shape in (("router.proj.weight", "router.weight", (E, H)), ("router.scale", "router.scale", (H,)),
                            ("router.per_expert_scale", "router.per_expert_scale", (E,)),
                            ("experts.gate_up_proj", "experts.gate_up_proj.weight", (E, 2 * inter, H)),
                            ("experts.down_proj", "experts.down_proj.weight", (E, H, inter))):
        _take(sd, p + src, out, q + dst, path)
        if tuple(out[q + dst].shape) != shape:
            raise ModelLoadError(path, f"tensor {p + src} is {tuple(out[q + dst].shape)}; the config makes it {shape}")
    for norm in MOE_NORMS:
        _take(sd, p + norm + ".weight", out, q + norm + ".weight", path)


def fuse_global_tensors(sd, out: dict, path) -> None:
    for name in ("embed_tokens_per_layer.weight", "per_layer_model_projection.weight",
                 "per_layer_projection_norm.weight"):
        if "model." + name in sd:  # the model asks for them where its config has per-layer inputs
            out[name] = sd["model." + name]


WEIGHTS = WeightLayout(norms=NORMS, attention=fuse_attention, layer_tensors=fuse_layer_tensors,
                       global_tensors=fuse_global_tensors, mlp=fuse_mlp)


# -- Gemma 4 as the Hub ships it: model_type gemma4, Gemma4ForConditionalGeneration (transformers
# 5.25's Gemma4Config), served as text. Its text model is text_config's gemma4_text, read above; of
# the wrapper's own fields these reach text logits: tie_word_embeddings (the wrapper's head ties by
# it) and the image, video and audio placeholders' ids, which its text path embeds (table and
# per-layer inputs) as text_config's pad_token_id, with or without an image.
WRAPPER_READ = frozenset({"text_config", "tie_word_embeddings", "image_token_id", "video_token_id", "audio_token_id"})
WRAPPER_DEFAULTS = dict(tie_word_embeddings=True, image_token_id=258_880, video_token_id=258_884,
                        audio_token_id=258_881)
# Images and audio only: the towers' configs and the markers around their tokens.
WRAPPER_IGNORED = frozenset({"vision_config", "audio_config", "boi_token_id", "eoi_token_id", "boa_token_id",
                             "eoa_token_index", "initializer_range"})
PLACEHOLDERS = "<the wrapper's placeholder ids>"  # a key no config.json has: the view's, for read_gemma4


def text_config(c: HFConfig) -> HFConfig:
    view = nested_text_config(c, "gemma4_text", GEMMA4_DEFAULTS, "Gemma 4")
    ids = []
    for key in ("image_token_id", "video_token_id", "audio_token_id"):
        v = c.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < view.positive_int("vocab_size"):
            c.refuse(key, v, "expected a token id of the text model's vocabulary")
        ids.append(v)
    view.values = {**view.values, PLACEHOLDERS: ids}
    return view


# Its weights: transformers 5 saves model.language_model.* (Gemma4TextModel's names) and lm_head.*;
# the towers and their embedders into the text model's space are skipped; any other name is refused.
OTHER_MODALITIES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
text_name = wrapper_names((("model.language_model.", "model."), ("lm_head.", "lm_head.")), OTHER_MODALITIES,
                          "vision or audio tower's", "Gemma4ForConditionalGeneration")
