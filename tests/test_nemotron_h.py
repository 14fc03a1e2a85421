"""Nemotron-H (nemotron_h): a stack of single sublayers, Mamba2 on the state cache, NoPE attention
and relu-squared MLP blocks that hold no cache at all, against transformers 5.25 as the oracle,
with tests/test_lfm2.py's method: a tiny random model built by transformers, saved as
safetensors (backbone.* names, as the checkpoints ship) and loaded through ridge's loader.

- teacher-forced logits over 96 positions, fp32 (relative error <= 1e-5, top-1 1.000) and FP8
  against transformers run on ridge's e4m3 weights;
- greedy tokens through the engine equal transformers' greedy: in one pass, in odd chunks beside
  other requests, after a prefix hit (from a checkpointed state), under n-gram speculation;
- the caches: KV for the attention layers only, Mamba2 states for the Mamba2 layers, nothing for
  the MLP blocks, and the memory plan counting just that;
- the config rule: every NemotronHConfig field read or ignored, values ridge cannot run refused
  by name, the older names and the pattern string honoured."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from engine_utils import make_engine
from hybrid_checks import (built_variants, check_fields_declared, check_greedy, check_ngram_rollback, check_prefix_hit,
                           draw_mamba2)
from ridge.cache.state_cache import LayerState
from ridge.config import kv_bytes_per_token
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import REGISTRY, read_hf_config
from ridge.quant.errors import ModelLoadError
from test_families import _dequantized, _write_config, assert_match, hf_logits

transformers = pytest.importorskip("transformers")

SHAPE = dict(mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4)
# id -> config fields. The first: the pattern string, Mamba2 first, an MLP after each mixer, two
# groups, 4 taps, and a dt clamp that bites (softplus(dt + dt_bias) runs about 0.3 to 2 here).
# The experts one: two experts blocks of 8 experts, top 3 within the 2 best of 4 groups, scaled by
# 2.5, in a latent width of 32 beside a shared MLP of 40. The last: layers_block_type with the older type names, attention first, two Mamba2 layers in a
# row, biases on the mixer's projections and the MLP, none on the convolution, one group, 3 taps,
# and tie_word_embeddings true (transformers ties nothing: the head stays its own).
VARIANTS = {
    "pattern-clamp": dict(hybrid_override_pattern="M-*-M-", time_step_limit=[0.05, 1.2], **SHAPE),
    "experts-latent": dict(
        hybrid_override_pattern="ME*E", n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        moe_intermediate_size=24, moe_shared_expert_intermediate_size=40, moe_latent_size=32, norm_topk_prob=True,
        routed_scaling_factor=2.5, **SHAPE),
    "block_types-biases": dict(
        layers_block_type=["attention", "mlp", "mamba", "linear_attention", "mlp"], use_bias=True,
        use_conv_bias=False, mlp_bias=True, tie_word_embeddings=True, **dict(SHAPE, n_groups=1, conv_kernel=3)),
}


def _draw_mixers(model):
    """Mamba2's parameters away from their init; routers drawn wide, with correction biases that
    change the choice (transformers' init: zeros)."""
    draw_mamba2(b.mixer for b in model.model.layers if b.block_type == "linear_attention")
    for b in model.model.layers:
        if b.block_type == "moe":
            b.mixer.gate.weight.copy_(torch.randn_like(b.mixer.gate.weight))
            b.mixer.gate.e_score_correction_bias.copy_(0.3 * torch.randn_like(b.mixer.gate.e_score_correction_bias))


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    return built_variants(tmp_path_factory, "nemotron_h", VARIANTS, _draw_mixers)


@pytest.fixture(params=list(VARIANTS))
def variant(request, variants):
    return variants(request.param)


@pytest.fixture(scope="module")
def fp32_default(variants):
    name, model, path, ids = variants("pattern-clamp")
    return model, load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False), ids


def test_fp32_logits_match_transformers(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    cfg, types = lm.config, model.config.layers_block_type
    assert cfg.arch == "nemotron_h" and cfg.num_layers == len(types)
    assert cfg.linear_layers == [i for i, t in enumerate(types) if t == "linear_attention"]
    assert cfg.mixerless_layers == [i for i, t in enumerate(types) if t in ("mlp", "moe")]
    assert cfg.num_experts == (model.config.n_routed_experts if "moe" in types else 0)
    assert not cfg.tie_word_embeddings
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def with_ridge_weights(model, lm):
    """The transformers model computing with ridge's weights (FP8: e4m3 times its scales, exact in fp32)."""
    hf = copy.deepcopy(model)
    cfg = lm.config
    with torch.no_grad():
        hf.get_input_embeddings().weight.copy_(_dequantized(lm.model.embed_tokens))
        hf.get_output_embeddings().weight.copy_(lm.model.lm_head.dequantized())
        for ours, theirs in zip(lm.model.layers, hf.model.layers):
            m = theirs.mixer
            if theirs.block_type == "linear_attention":
                m.in_proj.weight.copy_(ours.mixer.in_proj.dequantized())
                m.out_proj.weight.copy_(ours.mixer.out_proj.dequantized())
            elif theirs.block_type == "mlp":
                m.up_proj.weight.copy_(ours.up_proj.dequantized())
                m.down_proj.weight.copy_(ours.down_proj.dequantized())
            elif theirs.block_type == "moe":
                for e, expert in enumerate(ours.experts):
                    m.experts.up_proj[e].copy_(expert.up_proj.dequantized())
                    m.experts.down_proj[e].copy_(expert.down_proj.dequantized())
                for mine, hf_proj in ((ours.shared_experts.up_proj, m.shared_experts.up_proj),
                                      (ours.shared_experts.down_proj, m.shared_experts.down_proj),
                                      (ours.latent_in_proj, m.fc1_latent_proj), (ours.latent_out_proj, m.fc2_latent_proj)):
                    hf_proj.weight.copy_(mine.dequantized())
            else:
                for proj, w in zip((m.q_proj, m.k_proj, m.v_proj),
                                   ours.qkv_proj.dequantized().split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
                    proj.weight.copy_(w)
                m.o_proj.weight.copy_(ours.o_proj.dequantized())
    return hf


def test_fp8_logits_match_transformers_on_ridges_weights(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False, show_progress=False)
    hf = with_ridge_weights(model, lm)
    i = lm.config.linear_layers[0]
    assert not torch.equal(hf.model.layers[i].mixer.in_proj.weight, model.model.layers[i].mixer.in_proj.weight), \
        "in_proj not quantized"
    for j in lm.config.moe_layers or ():
        assert not torch.equal(hf.model.layers[j].mixer.experts.up_proj, model.model.layers[j].mixer.experts.up_proj), \
            "experts not quantized"
    assert_match(prompt_logits(lm.model, ids), hf_logits(hf, ids))


# -- through the engine -----------------------------------------------------------------------
def test_caches_hold_kv_for_attention_and_nothing_for_mlp_blocks(fp32_default):
    model, lm, ids = fp32_default
    cfg = lm.config
    eng = make_engine(lm, max_num_seqs=2, enable_prefix_caching=False)
    kinds = ["state" if isinstance(st, LayerState) else "none" if st is None else "kv" for st in eng.kv_cache.layers]
    assert kinds == ["state", "none", "kv", "none", "state", "none"]
    conv_dim = 8 * 16 + 2 * 2 * 16
    per_request = 4 * 2 * (3 * conv_dim + 8 * 16 * 16)
    assert cfg.state_bytes_per_request() == per_request
    assert eng.memory.state_bytes == eng.kv_cache.state_bytes == 2 * per_request
    assert cfg.num_kv_layers == 1 and kv_bytes_per_token(cfg, "fp32") == 2 * cfg.num_kv_heads * cfg.head_dim * 4
    shape = cfg.shape()
    assert (shape.state_layers, shape.mixerless_layers, shape.num_kv_layers) == (2, 3, 1)


@pytest.mark.parametrize("name,weights,chunk,seqs", [
    ("pattern-clamp", "fp32", 128, 1), ("pattern-clamp", "fp32", 7, 3),
    ("block_types-biases", "fp32", 5, 2), ("experts-latent", "fp32", 16, 2), ("pattern-clamp", "fp8", 16, 2),
    ("experts-latent", "fp8", 128, 1)],
    ids=["one-pass-batch-1", "chunks-of-7-batch-3", "biases-chunks-of-5", "experts-chunks-of-16", "fp8-chunks-of-16",
         "fp8-experts-one-pass"])
def test_greedy_through_the_engine(variants, name, weights, chunk, seqs):
    name, model, path, ids = variants(name)
    lm = load_model(path, device="cpu", weights=weights, use_cache=False, show_progress=False)
    check_greedy(model if weights == "fp32" else with_ridge_weights(model, lm), lm, ids, chunk, seqs)


@pytest.mark.parametrize("chunk,seqs", [(128, 1), (7, 2)])
def test_prefix_hit_continues_from_a_state_checkpoint(fp32_default, chunk, seqs):
    check_prefix_hit(*fp32_default, chunk, seqs)


def test_ngram_speculation_rolls_states_back(fp32_default):
    check_ngram_rollback(*fp32_default)


# -- config fidelity ----------------------------------------------------------------------------
def test_every_config_field_is_declared():
    check_fields_declared(REGISTRY["nemotron_h"].hf, transformers.NemotronHConfig)


@pytest.mark.parametrize("field,value,named", [
    ("n_group", 3, "n_group"),
    ("topk_group", 5, "topk_group"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("moe_shared_expert_intermediate_size", -1, "moe_shared_expert_intermediate_size"),
    ("layers_block_type", ["linear_attention", "mlp"], "layers_block_type"),
    ("layers_block_type", ["linear_attention", "sliding_attention"], "layers_block_type"),
    ("hybrid_override_pattern", "M-*X", "hybrid_override_pattern"),
    ("mlp_hidden_act", "silu", "mlp_hidden_act"),
    ("mamba_hidden_act", "gelu", "mamba_hidden_act"),
    ("n_groups", 3, "n_groups"),
    ("mamba_head_dim", 0, "mamba_head_dim"),
    ("conv_kernel", 1, "conv_kernel"),
    ("time_step_limit", [0.5], "time_step_limit"),
    ("use_bias", "no", "use_bias"),
])
def test_values_ridge_cannot_run_are_refused_by_name(variants, tmp_path, field, value, named):
    name, model, path, ids = variants("experts-latent")
    c = json.loads((path / "config.json").read_text())
    if field == "hybrid_override_pattern":
        c.pop("layers_block_type")
    c[field] = value
    with pytest.raises(ModelLoadError, match=named):
        read_hf_config(_write_config(tmp_path, **c))


def test_older_names_and_the_pattern(variants, tmp_path):
    """hybrid_override_pattern without layers_block_type, and the older mamba_* names, which win
    over the newer ones as NemotronHConfig lets them."""
    name, model, path, ids = variants("pattern-clamp")
    c = json.loads((path / "config.json").read_text())
    c.pop("layers_block_type")
    c.update(hybrid_override_pattern="-M*M", mamba_n_groups=4, mamba_d_conv=2, mamba_conv_bias=False,
             mamba_dt_limit=[0.0, 3.0])
    cfg = read_hf_config(_write_config(tmp_path, **c))
    ref = transformers.NemotronHConfig(**{k: v for k, v in c.items() if k not in ("model_type", "time_step_limit")})
    assert ref.layers_block_type == ["mlp", "linear_attention", "full_attention", "linear_attention"]
    assert cfg.num_layers == 4 and cfg.linear_layers == [1, 3] and cfg.mixerless_layers == [0]
    la = cfg.linear_attention
    assert (la["n_groups"], la["conv_kernel"], la["conv_bias"], la["dt_limit"]) == (4, 2, False, [0.0, 3.0])
    assert (ref.n_groups, ref.conv_kernel, ref.use_conv_bias, list(ref.time_step_limit)) == (4, 2, False, [0.0, 3.0])


def test_plan_counts_the_parameters(variant):
    """ridge plan's parameter count (norms, biases, the convolution, A, D and dt's bias left out)
    equals the transformers model's: the MLPs and experts ungated (up and down), the experts in
    their latent width between the two latent projections."""
    name, model, path, _ = variant
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    left_out = ("norm", "bias", "conv1d", "A_log", ".D", "e_score_correction")
    want = sum(p.numel() for n, p in model.named_parameters() if not any(k in n for k in left_out))
    assert lm.config.shape().num_params == want, name
