"""Granite 4 hybrid (granitemoehybrid): Mamba2 layers on the state cache beside attention layers,
with Granite's multipliers and a mixture of experts beside a shared MLP, against transformers 5.25
as the oracle, with tests/test_lfm2.py's method: a tiny random model built by transformers, saved
as safetensors and loaded through ridge's loader.

- teacher-forced logits over 96 positions, fp32 (relative error <= 1e-5, top-1 1.000) and FP8
  against transformers run on ridge's e4m3 weights;
- greedy tokens through the engine equal transformers' greedy: in one pass, in odd chunks beside
  other requests, after a prefix hit (from a checkpointed state), under n-gram speculation, and
  through the Triton kernels (the interpreter here);
- the state cache holds Mamba2's window and [P, N] state per head; the memory plan counts them;
- the config rule: every GraniteMoeHybridConfig field read or ignored, values ridge cannot run
  refused by name, the old layer type names honoured."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from engine_utils import make_engine
from hybrid_checks import (built_variants, check_fields_declared, check_greedy, check_ngram_rollback, check_prefix_hit,
                           check_triton, draw_mamba2)
from ridge.cache.state_cache import LayerState
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import REGISTRY, read_hf_config
from ridge.quant.errors import ModelLoadError
from test_families import _dequantized, _write_config, assert_match, hf_logits

transformers = pytest.importorskip("transformers")

MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
# id -> config fields. The first: the old layer type names, Mamba2 first, 4 experts top 2 beside a
# shared MLP of 48, RoPE, Granite's multipliers, attention biases, and a dt clamp that bites
# (softplus(dt + dt_bias) runs about 0.3 to 2 here). The second: no experts (the shared MLP
# alone), NoPE ("nope", as Granite 4's files write it), projection biases and no convolution
# bias, one group, 3 taps, a tied head.
VARIANTS = {
    "moe-rope-multipliers": dict(
        num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, position_embedding_type="rope",
        embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.1, logits_scaling=4.0,
        attention_bias=True, time_step_limit=[0.05, 1.2], **MAMBA),
    "dense-nope-biases-tied": dict(
        num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"],
        num_local_experts=0, shared_intermediate_size=80, position_embedding_type="nope", mamba_proj_bias=True,
        mamba_conv_bias=False, tie_word_embeddings=True, **dict(MAMBA, mamba_n_groups=1, mamba_d_conv=3)),
}


def _draw_mixers(model):
    draw_mamba2(layer.mamba for layer in model.model.layers if layer.mamba is not None)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    return built_variants(tmp_path_factory, "granitemoehybrid", VARIANTS, _draw_mixers)


@pytest.fixture(params=list(VARIANTS))
def variant(request, variants):
    return variants(request.param)


@pytest.fixture(scope="module")
def fp32_default(variants):
    name, model, path, ids = variants("moe-rope-multipliers")
    return model, load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False), ids


def test_fp32_logits_match_transformers(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    cfg = lm.config
    assert cfg.arch == "granitemoehybrid"
    assert cfg.linear_layers == [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    assert cfg.num_experts == model.config.num_local_experts
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def with_ridge_weights(model, lm):
    """The transformers model computing with ridge's weights (FP8: e4m3 times its scales, exact in
    fp32): the projections, experts and shared MLP as ridge holds them."""
    hf = copy.deepcopy(model)
    cfg = lm.config
    with torch.no_grad():
        hf.get_input_embeddings().weight.copy_(_dequantized(lm.model.embed_tokens))
        if not cfg.tie_word_embeddings:
            hf.get_output_embeddings().weight.copy_(lm.model.lm_head.dequantized())
        for ours, theirs in zip(lm.model.layers, hf.model.layers):
            if theirs.mamba is not None:
                theirs.mamba.in_proj.weight.copy_(ours.mixer.in_proj.dequantized())
                theirs.mamba.out_proj.weight.copy_(ours.mixer.out_proj.dequantized())
            else:
                attn = theirs.self_attn
                for proj, w in zip((attn.q_proj, attn.k_proj, attn.v_proj),
                                   ours.qkv_proj.dequantized().split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
                    proj.weight.copy_(w)
                attn.o_proj.weight.copy_(ours.o_proj.dequantized())
            shared = ours.shared_experts if cfg.num_experts else ours
            theirs.shared_mlp.input_linear.weight.copy_(shared.gate_up_proj.dequantized())
            theirs.shared_mlp.output_linear.weight.copy_(shared.down_proj.dequantized())
            if cfg.num_experts:
                gate_up, down = ours.experts.dequantized()
                theirs.block_sparse_moe.experts.gate_up_proj.copy_(gate_up)
                theirs.block_sparse_moe.experts.down_proj.copy_(down)
    return hf


def test_fp8_logits_match_transformers_on_ridges_weights(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False, show_progress=False)
    i = lm.config.linear_layers[0]
    hf = with_ridge_weights(model, lm)
    for proj in ("in_proj", "out_proj"):
        assert not torch.equal(getattr(hf.model.layers[i].mamba, proj).weight,
                               getattr(model.model.layers[i].mamba, proj).weight), f"{proj} not quantized"
    assert_match(prompt_logits(lm.model, ids), hf_logits(hf, ids))


# -- through the engine -----------------------------------------------------------------------
def test_the_state_cache_holds_mamba2_states(fp32_default):
    model, lm, ids = fp32_default
    eng = make_engine(lm, max_num_seqs=2, enable_prefix_caching=False)
    states = [st for st in eng.kv_cache.layers if isinstance(st, LayerState)]
    conv_dim = 8 * 16 + 2 * 2 * 16  # x, then B and C of 2 groups of 16
    assert len(states) == 3
    assert all(tuple(st.conv.shape) == (2, 3, conv_dim) and tuple(st.recurrent.shape) == (2, 8, 16, 16)
               for st in states)
    per_request = 4 * 3 * (3 * conv_dim + 8 * 16 * 16)
    assert lm.config.state_bytes_per_request() == per_request
    assert eng.memory.state_bytes == eng.kv_cache.state_bytes == 2 * per_request
    assert lm.config.shape().state_layers == 3


@pytest.mark.parametrize("name,weights,chunk,seqs", [
    ("moe-rope-multipliers", "fp32", 128, 1), ("moe-rope-multipliers", "fp32", 7, 3),
    ("dense-nope-biases-tied", "fp32", 5, 2), ("moe-rope-multipliers", "fp8", 16, 2)],
    ids=["one-pass-batch-1", "chunks-of-7-batch-3", "dense-nope-chunks-of-5", "fp8-chunks-of-16"])
def test_greedy_through_the_engine(variants, name, weights, chunk, seqs):
    name, model, path, ids = variants(name)
    lm = load_model(path, device="cpu", weights=weights, use_cache=False, show_progress=False)
    check_greedy(model if weights == "fp32" else with_ridge_weights(model, lm), lm, ids, chunk, seqs)


@pytest.mark.parametrize("chunk,seqs", [(128, 1), (7, 2)])
def test_prefix_hit_continues_from_a_state_checkpoint(fp32_default, chunk, seqs):
    check_prefix_hit(*fp32_default, chunk, seqs)


def test_ngram_speculation_rolls_states_back(fp32_default):
    check_ngram_rollback(*fp32_default)


def test_triton_kernels_through_the_engine(variants):
    """On the dense variant: the experts' Triton kernel is tests/test_moe.py's, and slow interpreted."""
    name, model, path, ids = variants("dense-nope-biases-tied")
    check_triton(model, load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False), ids)


# -- config fidelity ----------------------------------------------------------------------------
def test_every_config_field_is_declared():
    check_fields_declared(REGISTRY["granitemoehybrid"].hf, transformers.GraniteMoeHybridConfig)


@pytest.mark.parametrize("field,value,named", [
    ("layer_types", ["mamba", "sliding_attention", "mamba", "attention"], "layer_types"),
    ("layer_types", ["mamba"] * 4, "layer_types"),
    ("hidden_act", "gelu", "hidden_act"),
    ("position_embedding_type", "alibi", "position_embedding_type"),
    ("mamba_d_head", 12, "mamba_d_head"),
    ("mamba_n_groups", 3, "mamba_n_groups"),
    ("mamba_d_conv", 1, "mamba_d_conv"),
    ("time_step_limit", [1.0, 0.5], "time_step_limit"),
    ("time_step_limit", None, "time_step_limit"),
    ("mamba_conv_bias", "yes", "mamba_conv_bias"),
    ("logits_scaling", 0, "logits_scaling"),
    ("num_experts_per_tok", 5, "num_experts_per_tok"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4}, "rope_parameters.rope_type"),
])
def test_values_ridge_cannot_run_are_refused_by_name(variants, tmp_path, field, value, named):
    name, model, path, ids = variants("moe-rope-multipliers")
    c = json.loads((path / "config.json").read_text())
    c[field] = value
    with pytest.raises(ModelLoadError, match=named):
        read_hf_config(_write_config(tmp_path, **c))


def test_old_names_and_defaults(variants, tmp_path):
    """layers_block_type (layer_types' old name) with mamba/attention, mamba_d_head "auto" and a
    time_step_limit of plain numbers, as Granite 4's checkpoints write them."""
    name, model, path, ids = variants("moe-rope-multipliers")
    c = json.loads((path / "config.json").read_text())
    c.pop("layer_types")
    c.update(layers_block_type=["attention", "mamba", "mamba", "mamba"], mamba_d_head="auto",
             time_step_limit=[0.0, 1e9])
    cfg = read_hf_config(_write_config(tmp_path, **c))
    assert cfg.linear_layers == [1, 2, 3]
    assert cfg.linear_attention["head_dim"] == 16 and cfg.linear_attention["dt_limit"] == [0.0, 1e9]
    c["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    assert read_hf_config(_write_config(tmp_path, **c)).linear_attention["dt_limit"] == [0.0, math.inf]
