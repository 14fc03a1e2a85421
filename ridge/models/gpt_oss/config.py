"""gpt-oss read from GptOssConfig (transformers 5.24, with its defaults) and from llama.cpp's
gpt-oss GGUFs (the converter's GptOssModel, llama_model_openai_moe in llama.cpp).

The GGUF: expert_count, expert_used_count, expert_feed_forward_length; each stacked expert
tensor with a .bias, the weights usually MXFP4 (ggml's own block layout, which the gguf package
reads); the router ffn_gate_inp with a bias; blk.N.attn_sinks [heads]; post_attention_norm;
attention.sliding_window on the even layers (llama.cpp's pattern of 2); llama.cpp takes the top
k logits and softmaxes them, and fixes the clamped SwiGLU's alpha at 1.702 and its limit at
7.0, as gpt-oss's config does. Its Q and K rows are not permuted (NEOX)."""
from __future__ import annotations

from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_config import expert_fields
from ridge.quant.hf_config import HFConfig, experts_count, moe_fields, rope_fields, window_from_layer_types

ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}  # GptOssConfig's when the file has none
DEFAULTS = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
                intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                sliding_window=128, tie_word_embeddings=False, hidden_act="silu",
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=None,
                rope_theta=150000.0, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0,
                layer_types=None, attention_bias=True)
LLAMA_CPP_SWIGLU = dict(swiglu_alpha=1.702, swiglu_limit=7.0)  # LLM_FFN_SWIGLU_OAI_MOE's constants


def read_gpt_oss(c: HFConfig, kw: dict) -> dict:
    """Attention sinks, biases on every attention projection, sliding (window 128) and full
    layers alternating from a sliding first one unless layer_types says otherwise, YaRN; a
    router with a bias that takes the top k logits and softmaxes them, experts
    intermediate_size wide with biases and the clamped SwiGLU."""
    n = kw["num_layers"]
    experts, k = experts_count(c, "num_local_experts")
    if not experts:
        c.refuse("num_local_experts", experts, "gpt-oss's every layer is a mixture of experts")
    alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    b = c.flag("attention_bias")
    rope = c if c.get("rope_parameters") or c.get("rope_scaling") else \
        HFConfig({**c.values, "rope_parameters": ROPE}, c.path, c.defaults)  # GptOssConfig.__post_init__
    out = dict(attention_bias=b, o_bias=b, attention_sinks=True, **rope_fields(rope, kw["head_dim"]),
               **window_from_layer_types(c, n, c.positive_int("sliding_window"), alternating),
               **moe_fields(experts, k, kw["intermediate_size"], list(range(n)), n, False))
    limit = c.number("swiglu_limit")
    if limit <= 0:
        c.refuse("swiglu_limit", limit, "the clamp must be positive")
    return dict(out, moe_router="topk_softmax", moe_bias=True, moe_act="swigluoai",
                swiglu_alpha=c.number("swiglu_alpha"), swiglu_limit=limit)


def read_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    out = expert_fields(a, kw, names, path)
    n = kw["num_layers"]
    if out["moe_layers"] is not None:
        raise ModelLoadError(path, "gpt-oss: a layer without a router (blk.N.ffn_gate_inp); every layer is a mixture")
    for t in ("attn_sinks.weight", "attn_output.bias", "ffn_gate_inp.bias", "ffn_gate_exps.bias"):
        if f"blk.0.{t}" not in names:
            raise ModelLoadError(path, f"gpt-oss: missing tensor blk.0.{t}")
    window = a("attention.sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(path, f"gpt-oss.attention.sliding_window={window!r}: expected a positive integer")
    return dict(out, o_bias=True, attention_sinks=True, sliding_window=int(window),
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
                norm_topk_prob=False, moe_router="topk_softmax", moe_bias=True, moe_act="swigluoai",
                **LLAMA_CPP_SWIGLU)
