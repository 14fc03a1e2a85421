"""Gemma 4 (text) from GGUF, as llama.cpp's converter writes it (convert_hf_to_gguf.py Gemma4Model,
architecture gemma4), read back into Gemma4TextConfig's fields and through config.py's reading.

Metadata: attention.sliding_window_pattern one flag a layer (true: sliding); attention.key_length
the full layers' head width, key_length_swa the sliding layers' (each value_length equal, as
llama.cpp requires); attention.head_count_kv one count, or one a layer where the full layers have
their own (num_global_key_value_heads, which Gemma 4 honours only beside attention_k_eq_v: the
full layers without attn_v); attention.shared_kv_layers the KV-shared layers at the end;
embedding_length_per_layer_input the per-layer inputs' width (0: none); feed_forward_length one
width, or one a layer where the KV-shared layers' MLP is twice as wide (use_double_wide_mlp);
rope.freq_base the full layers' base, rope.freq_base_swa the sliding layers'; rope.dimension_count
and rope.dimension_count_swa the whole heads (the sliding layers rotate all of theirs); the
`rope_freqs` tensor the full layers' proportional RoPE: factor 1 on the rotating frequencies, 1e30
on the others (partial_rotary_factor = 2 * ones / key_length; the converter writes no `factor`,
so none is read); expert_count, expert_used_count, expert_feed_forward_length the MoE block.

Tensors: the norms multiply by w as they are (no 1 + w shift); layer_output_scale is layer_scalar;
the MoE block's router projection is ffn_gate_inp, its scale ffn_gate_inp.scale and its
per-expert scale ffn_down_exps.scale; the experts stay stacked (ffn_gate_up_exps [E, 2I, H],
ffn_down_exps [E, H, I])."""
from __future__ import annotations

import torch

from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_config import EXPERT_KEYS, GGUFFamily
from ridge.quant.hf_config import HFConfig

from .config import GEMMA4_DEFAULTS, read_gemma4

KEYS = EXPERT_KEYS | {"attention.sliding_window", "attention.sliding_window_pattern", "attention.key_length_swa",
                      "attention.value_length_swa", "attention.shared_kv_layers", "embedding_length_per_layer_input",
                      "rope.freq_base_swa", "rope.dimension_count_swa", "final_logit_softcapping",
                      "expert_feed_forward_length"}
NAMES = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
         "post_attention_norm.weight": "post_attention_layernorm.weight",
         "post_ffw_norm.weight": "post_feedforward_layernorm.weight", "layer_output_scale.weight": "layer_scalar",
         "attn_output.bias": "self_attn.o_proj.bias", "inp_gate.weight": "per_layer_input_gate.weight",
         "proj.weight": "per_layer_projection.weight", "post_norm.weight": "post_per_layer_input_norm.weight",
         "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
         "ffn_down_exps.scale": "router.per_expert_scale", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
         "ffn_down_exps.weight": "experts.down_proj", "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
         "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
         "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
         # the per-layer inputs' tables (outside blk.N.)
         "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
         "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
         "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
UNROTATED = 1e30  # the converter's frequency factor of a dim that does not turn


def _refuse(path, key: str, value, why: str):
    raise ModelLoadError(path, f"gemma4.{key}={value!r}: {why}")


def _per_type(a, key: str, types: list[str], path, default=None) -> dict:
    """A value given once or once a layer -> {layer type: value}, one value per type."""
    v = a(key, default)
    values = v if isinstance(v, list) else [v] * len(types)
    if len(values) != len(types):
        _refuse(path, key, v, f"expected one value or {len(types)}")
    out = {}
    for t, x in zip(types, values):
        if out.setdefault(t, x) != x:
            _refuse(path, key, v, f"ridge needs one value for all {t} layers")
    return out


def _partial_rotary(reader, head_dim: int, path) -> float:
    """The full layers' partial_rotary_factor, from the rope_freqs tensor the converter writes."""
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        raise ModelLoadError(path, "missing tensor rope_freqs.weight: the full layers' proportional RoPE")
    from ridge.quant.gguf_loader import _dequantize
    f = _dequantize(t).reshape(-1)
    turning = int((f == 1.0).sum())
    want = torch.tensor([1.0] * turning + [UNROTATED] * (head_dim // 2 - turning), dtype=f.dtype)
    if f.shape != want.shape or not torch.equal(f, want):
        raise ModelLoadError(path, "tensor rope_freqs.weight: expected 1 on the leading frequencies and 1e30 on "
                                   f"the rest, {head_dim // 2} in all (the converter's proportional RoPE)")
    return 2 * turning / head_dim


def read_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    n = kw["num_layers"]
    swa = a("attention.sliding_window_pattern")
    if not isinstance(swa, list) or len(swa) != n or any(not isinstance(s, bool) for s in swa):
        _refuse(path, "attention.sliding_window_pattern", swa, f"expected {n} flags")
    types = ["sliding_attention" if s else "full_attention" for s in swa]
    full_dim, swa_dim = kw["head_dim"], a("attention.key_length_swa", kw["head_dim"])
    for key, want in (("attention.value_length", full_dim), ("attention.value_length_swa", swa_dim)):
        if a(key, want) != want:
            _refuse(path, key, a(key), "Gemma 4's values are as wide as its keys")
    for key, want in (("rope.dimension_count", full_dim), ("rope.dimension_count_swa", swa_dim)):
        if a(key, want) != want:
            _refuse(path, key, a(key), f"expected the whole head ({want}); the full layers' rope_freqs turns fewer")
    kv = _per_type(a, "attention.head_count_kv", types, path)
    full = types.index("full_attention")
    k_eq_v = f"blk.{full}.attn_v.weight" not in names
    kv_swa = kv.get("sliding_attention", kv["full_attention"])
    if kv["full_attention"] != kv_swa and not k_eq_v:
        _refuse(path, "attention.head_count_kv", a("attention.head_count_kv"),
                "the full layers' own KV heads, which Gemma 4 has only where they take their keys as values")
    shared = a("attention.shared_kv_layers", 0)
    ff = a("feed_forward_length")
    if isinstance(ff, list):  # use_double_wide_mlp: the KV-shared layers twice as wide
        if not isinstance(shared, int) or ff != [ff[0]] * (n - shared) + [2 * ff[0]] * shared:
            _refuse(path, "feed_forward_length", ff, "expected one width, doubled on the KV-shared layers")
        ff = ff[0]
    experts = a("expert_count")
    ple = a("embedding_length_per_layer_input", 0)
    values = dict(layer_types=types, sliding_window=a("attention.sliding_window"), num_kv_shared_layers=shared,
                  use_double_wide_mlp=isinstance(a("feed_forward_length"), list), attention_k_eq_v=k_eq_v,
                  global_head_dim=full_dim, num_global_key_value_heads=kv["full_attention"] if k_eq_v else None,
                  hidden_size_per_layer_input=ple, vocab_size_per_layer_input=kw["vocab_size"],
                  attention_bias="blk.0.attn_q.bias" in names,
                  final_logit_softcapping=a("final_logit_softcapping"),
                  rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": kw["rope_theta"],
                                                      "partial_rotary_factor": _partial_rotary(reader, full_dim, path)},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": a("rope.freq_base_swa", 10_000.0)}},
                  enable_moe_block=experts is not None, num_experts=experts, top_k_experts=a("expert_used_count"),
                  moe_intermediate_size=a("expert_feed_forward_length"))
    if ple and not isinstance(ple, int):
        _refuse(path, "embedding_length_per_layer_input", ple, "expected an integer")
    c = HFConfig(values, path, GEMMA4_DEFAULTS)
    base = dict(kw, head_dim=swa_dim, num_kv_heads=kv_swa, hidden_act="gelu_pytorch_tanh", intermediate_size=int(ff))
    return dict(read_gemma4(c, base), head_dim=swa_dim, num_kv_heads=kv_swa, hidden_act="gelu_pytorch_tanh",
                intermediate_size=int(ff))


FAMILY = GGUFFamily("gemma4", read=read_gguf, keys=KEYS, names=NAMES, partial_rotary=True, kv_heads_per_layer=True)
