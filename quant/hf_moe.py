"""Mixtures of experts from Hugging Face configs: Qwen3-MoE, Mixtral and gpt-oss, the fields
their transformers models read (Qwen3MoeConfig, MixtralConfig, GptOssConfig in transformers
5.24, with those classes' defaults), honoured or refused by name (quant/families.py registers
them). ridge/models/moe.py runs them.

Qwen3-MoE and Mixtral route with a softmax over every expert, then the top k: Mixtral always renormalises the
k weights, Qwen3-MoE where norm_topk_prob. A Qwen3-MoE layer is sparse unless it is in
mlp_only_layers or (index + 1) is not a multiple of decoder_sparse_step; the others run the
dense MLP of intermediate_size. Mixtral's experts are intermediate_size wide, every layer."""
from __future__ import annotations

from .hf_config import HFConfig, rope_fields, window_all, window_from_layer_types

# The router's training-time terms, which do not change inference.
MOE_IGNORED = frozenset({"output_router_logits", "router_aux_loss_coef"})

QWEN3_MOE_DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=None, hidden_act="silu",
                          max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                          rope_parameters=None, attention_bias=False, use_sliding_window=False, sliding_window=4096,
                          decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
                          norm_topk_prob=False, mlp_only_layers=None)
MIXTRAL_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                        max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        sliding_window=None, num_experts_per_tok=2, num_local_experts=8, rope_parameters=None,
                        rope_theta=1_000_000.0)
# Mixtral's jitter scales the router's input only in training.
MIXTRAL_IGNORED = MOE_IGNORED | {"router_jitter_noise"}


def _experts(c: HFConfig, key: str, alias: str | None = None) -> tuple[int, int]:
    """-> (E, k). alias: the config class's other name for the count (Qwen3MoeConfig maps
    num_experts to num_local_experts, so a saved file may carry either)."""
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


def _qwen3_moe_layers(c: HFConfig, n: int, experts: int) -> list[int]:
    step = c.positive_int("decoder_sparse_step")
    only = c.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        c.refuse("mlp_only_layers", only, "expected a list of layer indices")
    return [i for i in range(n) if experts > 0 and i not in only and (i + 1) % step == 0]


def _moe(experts: int, k: int, width: int, layers: list[int], n: int, norm: bool) -> dict:
    if not layers:  # no sparse layer: the dense model transformers builds
        return {}
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=width, norm_topk_prob=norm,
                moe_router="softmax_topk", moe_layers=None if len(layers) == n else layers)


def read_qwen3_moe(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    experts, k = _experts(c, "num_experts", alias="num_local_experts")
    layers = _qwen3_moe_layers(c, n, experts)
    # Qwen3MoeConfig: the window counts only with use_sliding_window, and then on every layer.
    window = c.positive_int("sliding_window") if c.flag("use_sliding_window") else None
    b = c.flag("attention_bias")
    return dict(qk_norm=True, attention_bias=b, o_bias=b, **rope_fields(c, kw["head_dim"]),
                sliding_window=window, layer_types=None if window is None else ["sliding_attention"] * n,
                **_moe(experts, k, c.positive_int("moe_intermediate_size"), layers, n, c.flag("norm_topk_prob")))


def read_mixtral(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    experts, k = _experts(c, "num_local_experts")
    if not experts:
        c.refuse("num_local_experts", experts, "Mixtral's every layer is a mixture of experts")
    return dict(**rope_fields(c, kw["head_dim"]), **window_all(c, n),
                **_moe(experts, k, kw["intermediate_size"], list(range(n)), n, True))


GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}  # GptOssConfig's when the file has none
GPT_OSS_DEFAULTS = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
                        intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                        sliding_window=128, tie_word_embeddings=False, hidden_act="silu",
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=None,
                        rope_theta=150000.0, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0,
                        layer_types=None, attention_bias=True)


def read_gpt_oss(c: HFConfig, kw: dict) -> dict:
    """gpt-oss: attention sinks, biases on every attention projection, sliding (window 128) and
    full layers alternating from a sliding first one unless layer_types says otherwise, YaRN;
    a router with a bias that takes the top k logits and softmaxes them, experts
    intermediate_size wide with biases and the clamped SwiGLU."""
    n = kw["num_layers"]
    experts, k = _experts(c, "num_local_experts")
    if not experts:
        c.refuse("num_local_experts", experts, "gpt-oss's every layer is a mixture of experts")
    alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    b = c.flag("attention_bias")
    rope = c if c.get("rope_parameters") or c.get("rope_scaling") else \
        HFConfig({**c.values, "rope_parameters": GPT_OSS_ROPE}, c.path, c.defaults)  # GptOssConfig.__post_init__
    out = dict(attention_bias=b, o_bias=b, attention_sinks=True, **rope_fields(rope, kw["head_dim"]),
               **window_from_layer_types(c, n, c.positive_int("sliding_window"), alternating),
               **_moe(experts, k, kw["intermediate_size"], list(range(n)), n, False))
    limit = c.number("swiglu_limit")
    if limit <= 0:
        c.refuse("swiglu_limit", limit, "the clamp must be positive")
    return dict(out, moe_router="topk_softmax", moe_bias=True, moe_act="swigluoai",
                swiglu_alpha=c.number("swiglu_alpha"), swiglu_limit=limit)
