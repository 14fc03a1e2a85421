"""GLM-4.5 / GLM-4.6 / GLM-4.7 MoE (Glm4MoeConfig): llama's attention with q, k and v biases
(attention_bias; o has none), QK-norm per head where use_qk_norm, RoPE over the first
partial_rotary_factor of each head (0.5 by default); the first first_k_dense_replace layers run
a dense MLP, the others a mixture of experts (ridge/models/layers/moe.py) routed DeepSeek-V3's
way (sigmoid_group_topk: the sigmoids plus e_score_correction_bias choose the top k within the
topk_group best of n_group groups, the sigmoids weigh them, renormalised where norm_topk_prob,
times routed_scaling_factor) beside n_shared_experts shared experts, one gated MLP of
n_shared_experts * moe_intermediate_size that every token runs.

The checkpoints' multi-token-prediction layers (num_nextn_predict_layers, stored as
model.layers.{num_hidden_layers}.*) are not loaded, as transformers does not load them.

GGUF glm4moe (llama.cpp's converter: Glm4MoeModel): block_count counts the nextn_predict_layers
MTP blocks after the decoder's (their tensors are not read); experts stacked (ffn_*_exps), the
router ffn_gate_inp and its correction bias exp_probs_b, the shared experts ffn_*_shexp, the
dense leading_dense_block_count layers, the MLP's input norm named post_attention_norm,
expert_gating_func sigmoid, expert_weights_scale and expert_weights_norm; rows unpermuted (NEOX),
rope.dimension_count the rotary width. The format has no expert groups (llama.cpp routes over
all experts: GLM-4.5's n_group is 1), so a file is read with one group."""
from __future__ import annotations

import torch

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import FP8, WeightLayout, stacked_experts
from ridge.quant.gguf_config import EXPERT_KEYS, GGUFFamily, expert_fields, refuse_yarn_attn_factor
from ridge.quant.gguf_loader import split_experts
from ridge.quant.hf_config import MOE_IGNORED, HFConfig, HFFamily, experts_count, moe_fields, rope_fields
from ridge.quant.spec import ModelSpec

from ..layers.moe import MoeCausalLM

DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                num_attention_heads=96, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=None,
                partial_rotary_factor=0.5, attention_bias=False, moe_intermediate_size=1408, num_experts_per_tok=8,
                n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False)
EXPERTS = ("mlp.", "gate", "gate_proj", "up_proj", "down_proj")  # under model.layers.{i}.


def _router(c: HFConfig, experts: int, k: int) -> dict:
    groups, chosen = c.positive_int("n_group"), c.positive_int("topk_group")
    if groups is None or experts % groups or experts // groups < 2:
        c.refuse("n_group", groups, f"must split the {experts} experts into groups of at least 2 (each group "
                                    "scores by its two best)")
    if chosen is None or chosen > groups:
        c.refuse("topk_group", chosen, f"expected 1 to n_group={groups} groups")
    if k > chosen * (experts // groups):
        c.refuse("num_experts_per_tok", k, f"more than the {chosen * (experts // groups)} experts of the chosen groups")
    return dict(moe_router="sigmoid_group_topk", moe_n_group=groups, moe_topk_group=chosen,
                routed_scaling_factor=c.number("routed_scaling_factor"))


def read_glm4_moe(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    experts, k = experts_count(c, "n_routed_experts", alias="num_local_experts")
    first = c.get("first_k_dense_replace")
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        c.refuse("first_k_dense_replace", first, "expected a non-negative integer")
    width = c.positive_int("moe_intermediate_size")
    layers = [i for i in range(n) if experts > 0 and i >= first]
    moe = moe_fields(experts, k, width, layers, n, c.flag("norm_topk_prob"))
    if moe:
        shared = c.get("n_shared_experts")
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            c.refuse("n_shared_experts", shared, "expected a non-negative integer")
        moe.update(_router(c, experts, k), shared_expert_intermediate_size=shared * width)
    return dict(qk_norm=c.flag("use_qk_norm"), attention_bias=c.flag("attention_bias"), o_bias=False,
                **rope_fields(c, kw["head_dim"], partial_rotary=True), **moe)


def _rows(sd, names: list[str], path) -> dict[str, torch.Tensor]:
    """Weights concatenated along their rows, with their FP8 scales (one a row) where they have them."""
    try:
        ws = [sd[n + ".weight"] for n in names]
    except KeyError as e:
        raise ModelLoadError(path, f"missing tensor {e.args[0]}") from None
    out = {"weight": torch.cat(ws)}
    if ws[0].dtype == FP8:
        out["weight_scale"] = torch.cat([sd[n + ".weight_scale"].float().reshape(-1).expand(w.shape[0])
                                         if sd[n + ".weight_scale"].numel() == 1 else sd[n + ".weight_scale"].reshape(-1)
                                         for n, w in zip(names, ws)])
    return out


_routed = stacked_experts(EXPERTS)


def experts(sd, cfg: ModelConfig, layer: str, path) -> dict[str, torch.Tensor]:
    """A sparse layer's routed experts and router (as Qwen3-MoE's), the router's correction bias
    and the shared experts' fused gate_up and down."""
    out = _routed(sd, cfg, layer, path)
    bias = sd.get(layer + "mlp.gate.e_score_correction_bias")
    if bias is None:
        raise ModelLoadError(path, f"missing tensor {layer}mlp.gate.e_score_correction_bias")
    out["router.correction"] = bias
    if cfg.shared_expert_intermediate_size:
        s = layer + "mlp.shared_experts."
        for name, parts in (("gate_up_proj", ["gate_proj", "up_proj"]), ("down_proj", ["down_proj"])):
            for kind, t in _rows(sd, [s + p for p in parts], path).items():
                out[f"shared_experts.{name}.{kind}"] = t
    return out


SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def read_glm4_moe_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    refuse_yarn_attn_factor("glm4moe", a, kw, path)
    mtp = a("nextn_predict_layers", 0)
    if not isinstance(mtp, int) or not 0 <= mtp < kw["num_layers"]:
        raise ModelLoadError(path, f"glm4moe.nextn_predict_layers={mtp!r}: expected fewer than block_count")
    kw = dict(kw, num_layers=kw["num_layers"] - mtp)
    moe = expert_fields(a, kw, names, path)
    dense = a("leading_dense_block_count", 0)
    if moe["moe_layers"] is not None and moe["moe_layers"] != list(range(dense, kw["num_layers"])):
        raise ModelLoadError(path, f"glm4moe.leading_dense_block_count={dense!r}: the routers are on layers "
                                   f"{moe['moe_layers']}")
    if a("expert_gating_func") != SIGMOID_GATING:
        raise ModelLoadError(path, f"glm4moe.expert_gating_func={a('expert_gating_func')!r}: GLM's router is a sigmoid "
                                   f"({SIGMOID_GATING})")
    scale = a("expert_weights_scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ModelLoadError(path, f"glm4moe.expert_weights_scale={scale!r}: expected a number")
    shared = a("expert_shared_count", 0)
    rotary = a("rope.dimension_count")
    return dict(moe, num_layers=kw["num_layers"], moe_router="sigmoid_group_topk", norm_topk_prob=bool(
        a("expert_weights_norm", False)), routed_scaling_factor=float(scale), o_bias=False,
        shared_expert_intermediate_size=int(shared) * moe["moe_intermediate_size"],
        rotary_dim=None if rotary is None or rotary == kw["head_dim"] else int(rotary))


_split = split_experts(EXPERTS)


def gguf_tensor(idx: str, rest: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Stacked experts and the router (as Qwen3-MoE's), the correction bias; an MTP block's own
    tensors (nextn.*) are dropped."""
    if rest.startswith("nextn."):
        return {}
    if rest == "exp_probs_b.bias":
        return {f"model.layers.{idx}.mlp.gate.e_score_correction_bias": w}
    return _split(idx, rest, w)


SPEC = ModelSpec(
    "glm4_moe", MoeCausalLM,
    HFFamily(DEFAULTS, read_glm4_moe, MOE_IGNORED | {"num_mtp_layers", "num_nextn_predict_layers"}),
    GGUFFamily("glm4moe", read=read_glm4_moe_gguf, tensor=gguf_tensor, partial_rotary=True,
               keys=EXPERT_KEYS | {"expert_feed_forward_length", "expert_shared_count", "leading_dense_block_count",
                                   "expert_gating_func", "expert_weights_scale", "expert_weights_norm",
                                   "nextn_predict_layers", "rope.scaling.attn_factor"},
               names={"post_attention_norm.weight": "post_attention_layernorm.weight",
                      "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
                      "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
                      "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}),
    WeightLayout(experts=experts),
)
