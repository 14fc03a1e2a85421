"""Nemotron-H (NemotronHConfig; model.py for the math): a stack of single sublayers by
layers_block_type (or its alias layer_types, or the older hybrid_override_pattern: M Mamba2,
* attention, - MLP, E experts), Mamba2's per-request state in the slot pool beside the paged KV
(cache/state_cache.py), the MLP and experts blocks holding no cache at all.

Read from config.json: the layer pattern; layer_norm_epsilon (every RMSNorm, the Mamba2 gated
norm's too); intermediate_size and mlp_bias (the MLP's up and down); the Mamba2 shape
(mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size, conv_kernel), use_conv_bias,
use_bias (the mixer's in_proj and out_proj) and time_step_limit, each under its older mamba_*
name too (mamba_n_groups, mamba_d_conv, mamba_conv_bias, mamba_dt_limit), which wins as in
transformers; for experts blocks, n_routed_experts (or num_local_experts), num_experts_per_tok,
moe_intermediate_size, moe_latent_size (the experts' width, between a projection in and one out),
moe_shared_expert_intermediate_size (0: intermediate_size, as NemotronHMLP falls back) and the
router's n_group, topk_group, norm_topk_prob and routed_scaling_factor. Not read, as
transformers' model does not read them: attention_bias and sliding_window (its attention has
neither), expand (the width is heads x head_dim), mamba_proj_bias, residual_in_fp32, chunk_size
(the scan's order only), the initialisation's time_step_min / max / floor, mamba_ssm_cache_dtype
(ridge keeps states in fp32), n_shared_experts and moe_shared_expert_overlap, the
multi-token-prediction layers' fields (transformers builds none). tie_word_embeddings is read as
transformers runs it: the head is never tied (NemotronHForCausalLM ties nothing). Refused by
name: an MLP activation but relu2, a Mamba2 activation but silu, a model without an attention
layer, expert groups the router cannot choose among.

Tensors: backbone.* (or model.*) as model.*: embeddings the embedding, norm_f the final norm,
each layer's norm its input norm, mixer.* its mixer's (layers/mamba2.py fuse_mamba2 for the
Mamba2 blocks); an experts block's gate (and e_score_correction_bias), its experts one tensor per
expert and projection (or stacked, as transformers 5 holds them), shared_experts, and
fc1_latent_proj / fc2_latent_proj. FP8 covers every projection, the up_proj of the MLPs and
experts too; the router stays fp32."""
from __future__ import annotations

import math

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import FP8, WeightLayout, cat_rows
from ridge.quant.hf_config import MOE_IGNORED, HFConfig, HFFamily, experts_count
from ridge.quant.spec import ModelSpec

from ..glm4_moe import _router as sigmoid_group_router  # DeepSeek-V3's rule, under the same keys
from ..layers.mamba2 import dt_limit, fuse_mamba2, mamba2_shape
from . import gguf
from .model import NemotronHCausalLM

__all__ = ["SPEC", "NemotronHCausalLM"]

DEFAULTS = dict(vocab_size=131072, hidden_size=4096, layers_block_type=None, tie_word_embeddings=False,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                intermediate_size=21504, mlp_hidden_act="relu2", mlp_bias=False, ssm_state_size=128,
                mamba_num_heads=128, mamba_head_dim=64, mamba_hidden_act="silu", n_groups=8, conv_kernel=4,
                time_step_limit=(0.0, math.inf), use_conv_bias=True, use_bias=False, layer_norm_epsilon=1e-5,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=7688,
                moe_shared_expert_intermediate_size=7688, moe_latent_size=None, routed_scaling_factor=1.0, n_group=1,
                topk_group=1, norm_topk_prob=True,
                # not NemotronHConfig's: common_fields' keys, set from Nemotron-H's own below
                hidden_act="silu", rms_norm_eps=1e-5)
IGNORED = frozenset(MOE_IGNORED | {"n_shared_experts", "moe_shared_expert_overlap",
    "attention_bias", "sliding_window", "expand", "mamba_proj_bias", "residual_in_fp32", "chunk_size",
    "time_step_min", "time_step_max", "time_step_floor", "mamba_ssm_cache_dtype", "num_nextn_predict_layers",
    "mtp_layers_block_type", "use_mamba_kernels", "num_logits_to_keep", "hidden_dropout",
    "rescale_prenorm_residual"})
OLD_NAMES = (("mamba_n_groups", "n_groups"), ("mamba_d_conv", "conv_kernel"), ("mamba_conv_bias", "use_conv_bias"),
             ("mamba_dt_limit", "time_step_limit"))
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
RUN = ("linear_attention", "full_attention", "mlp", "moe")


def _layer_types(c: HFConfig) -> list[str]:
    key = next((k for k in ("layers_block_type", "layer_types") if c.get(k) is not None), None)
    if key is not None:
        types = c.get(key)
        if not isinstance(types, list) or not types:
            c.refuse(key, types, "expected a list of layer types")
        types = [LEGACY_TYPES.get(t, t) for t in types]
    elif c.get("hybrid_override_pattern") is not None:
        key, pattern = "hybrid_override_pattern", c.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern or any(ch not in PATTERN for ch in pattern):
            c.refuse(key, pattern, f"expected a string of {''.join(PATTERN)}")
        types = [PATTERN[ch] for ch in pattern]
    else:
        key, types = "layers_block_type", ["linear_attention", "moe", "full_attention", "mlp"]  # NemotronHConfig's
    if any(t not in RUN for t in types):
        c.refuse(key, c.get(key), f"expected layers of {', '.join(RUN)}")
    if "full_attention" not in types:
        c.refuse(key, c.get(key), "ridge needs at least one full_attention layer (its KV sizes the pool)")
    return types


class NemotronHFamily(HFFamily):
    """common_fields reads rms_norm_eps, hidden_act, num_hidden_layers and tie_word_embeddings;
    Nemotron-H names or derives them otherwise: its own values are read first and handed over."""

    def model_config_kwargs(self, c: HFConfig, arch: str) -> dict:
        values = dict(c.values)
        for old, new in OLD_NAMES:  # NemotronHConfig: the older name wins
            if old in values:
                values[new] = values[old]
        c = HFConfig(values, c.path, c.defaults)
        types = _layer_types(c)
        common = HFConfig({**values, "rms_norm_eps": c.number("layer_norm_epsilon"), "hidden_act": "silu",
                           "num_hidden_layers": len(types), "tie_word_embeddings": False,
                           "layers_block_type": types}, c.path, c.defaults)
        return super().model_config_kwargs(common, arch)


def read_nemotron_h(c: HFConfig, kw: dict) -> dict:
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if c.get(key) != want:
            c.refuse(key, c.get(key), f"ridge runs Nemotron-H's {want} there")
    types = c.get("layers_block_type")
    la = mamba2_shape(c, "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", None)
    la.update(conv_bias=c.flag("use_conv_bias"), proj_bias=c.flag("use_bias"), dt_limit=dt_limit(c, "time_step_limit"))
    n = kw["num_layers"]
    moe = [i for i, t in enumerate(types) if t == "moe"]
    return dict(qk_norm=False, attention_bias=False, o_bias=False, mlp_bias=c.flag("mlp_bias"),
                nope_layers=list(range(n)),
                linear_layers=[i for i, t in enumerate(types) if t == "linear_attention"] or None,
                linear_attention=la, mixerless_layers=[i for i, t in enumerate(types) if t in ("mlp", "moe")],
                **(_experts(c, kw, moe) if moe else {"extra": {"gated_mlp": False}}))


def _experts(c: HFConfig, kw: dict, layers: list[int]) -> dict:
    """The experts blocks' fields: E relu squared experts, k a token, routed by sigmoids within
    the topk_group best of n_group groups, beside the shared MLP."""
    experts, k = experts_count(c, "n_routed_experts", alias="num_local_experts")
    if not experts:
        c.refuse("n_routed_experts", experts, "the experts blocks (moe) need experts")
    width = c.positive_int("moe_intermediate_size")
    if width is None:
        c.refuse("moe_intermediate_size", None, "the experts need it")
    shared = c.get("moe_shared_expert_intermediate_size")
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        c.refuse("moe_shared_expert_intermediate_size", shared, "expected a non-negative integer")
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=width,
                norm_topk_prob=c.flag("norm_topk_prob"), **sigmoid_group_router(c, experts, k),
                shared_expert_intermediate_size=shared or kw["intermediate_size"], moe_layers=layers,
                extra={"moe_latent_size": c.positive_int("moe_latent_size"), "gated_mlp": False})


def checkpoint_name(name: str) -> str:
    """backbone.* (as checkpoints ship it) or model.* (transformers' own) -> the names fused below."""
    for prefix in ("backbone.", "model."):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            break
    else:
        return name
    if rest.startswith("embeddings."):
        return "model.embed_tokens." + rest[len("embeddings."):]
    if rest.startswith("norm_f."):
        return "model.norm." + rest[len("norm_f."):]
    head, _, tail = rest.partition(".")
    i, _, tail = tail.partition(".")
    if head == "layers" and tail.startswith("norm."):
        return f"model.layers.{i}.input_layernorm.{tail[len('norm.'):]}"
    return "model." + rest


def fuse_mixer(sd, cfg: ModelConfig, i: int, out: dict, path) -> None:
    """Layer i's mixer: Mamba2's tensors, or the attention's projections (an MLP block has neither)."""
    p, q = f"model.layers.{i}.mixer.", f"layers.{i}."
    if cfg.is_linear_layer(i):
        fuse_mamba2(sd, cfg, p, q + "mixer.", out, path)
    elif cfg.holds_kv(i):
        cat_rows(sd, [p + "q_proj", p + "k_proj", p + "v_proj"], out, q + "qkv_proj", path)
        cat_rows(sd, [p + "o_proj"], out, q + "o_proj", path)


def fuse_mlp(sd, cfg: ModelConfig, i: int, out: dict, path) -> None:
    """An MLP block's up and down projections, an experts block's (a mixer's layer has no MLP)."""
    p, q = f"model.layers.{i}.mixer.", f"layers.{i}."
    if cfg.is_moe_layer(i):
        fuse_experts(sd, cfg, p, q, out, path)
    elif i in cfg.mixerless_layers:
        cat_rows(sd, [p + "up_proj"], out, q + "up_proj", path, cfg.mlp_bias)
        cat_rows(sd, [p + "down_proj"], out, q + "down_proj", path, cfg.mlp_bias)


def _take(sd, name: str, path):
    if name not in sd:
        raise ModelLoadError(path, f"missing tensor {name}")
    return sd[name]


def fuse_experts(sd, cfg: ModelConfig, p: str, q: str, out: dict, path) -> None:
    """The router (fp32 in the model), each expert's up and down (one tensor each, or stacked
    [E, I, in] and [E, in, I]), the shared MLP, the latent projections where moe_latent_size is set."""
    out[q + "router.weight"] = _take(sd, p + "gate.weight", path)
    out[q + "router.correction"] = _take(sd, p + "gate.e_score_correction_bias", path)
    if p + "gate.bias" in sd:
        raise ModelLoadError(path, f"tensor {p}gate.bias: Nemotron-H's router has no bias")
    E = cfg.num_experts
    if p + "experts.up_proj" in sd:  # transformers 5's stacked layout
        for name in ("up_proj", "down_proj"):
            t = _take(sd, p + "experts." + name, path)
            if t.dtype == FP8 or t.shape[0] != E:
                raise ModelLoadError(path, f"tensor {p}experts.{name}: {tuple(t.shape)} {t.dtype}; ridge reads "
                                           f"{E} stacked experts, not FP8")
            for e in range(E):
                out[q + f"experts.{e}.{name}.weight"] = t[e]
    else:
        if f"{p}experts.{E}.up_proj.weight" in sd:
            raise ModelLoadError(path, f"tensor {p}experts.{E}.up_proj.weight: more experts than n_routed_experts={E}")
        for e in range(E):
            for name in ("up_proj", "down_proj"):
                cat_rows(sd, [f"{p}experts.{e}.{name}"], out, f"{q}experts.{e}.{name}", path)
    for name in ("up_proj", "down_proj"):
        cat_rows(sd, [f"{p}shared_experts.{name}"], out, f"{q}shared_experts.{name}", path, cfg.mlp_bias)
    latent = cfg.extra["moe_latent_size"]
    for src, dst in (("fc1_latent_proj", "latent_in_proj"), ("fc2_latent_proj", "latent_out_proj")):
        if latent:
            cat_rows(sd, [p + src], out, q + dst, path, cfg.mlp_bias)
        elif p + src + ".weight" in sd:
            raise ModelLoadError(path, f"tensor {p}{src}.weight, which moe_latent_size=None does not declare")


SPEC = ModelSpec("nemotron_h", NemotronHCausalLM,
                 NemotronHFamily(DEFAULTS, read_nemotron_h, ignored=IGNORED, rename=checkpoint_name),
                 gguf=gguf.FAMILY,  # GGUF as llama.cpp writes it: gguf.py
                 weights=WeightLayout(norms=("input_layernorm",), attention=fuse_mixer, mlp=fuse_mlp))
