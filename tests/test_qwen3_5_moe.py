"""Qwen3.5-MoE (qwen3_5_moe_text, and the Hub's qwen3_5_moe served as text) against transformers
5.25 as the oracle, with tests/test_qwen3_5.py's method: a tiny random model built by
transformers, saved as safetensors and loaded through ridge's loader. Qwen3.5's hybrid layers
(their tensors as Qwen3.5's) with a mixture of experts and a gated shared expert in every layer.

- teacher-forced logits over 96 positions, fp32 (relative error <= 1e-5, top-1 1.000) and FP8
  against transformers run on ridge's e4m3 weights;
- greedy tokens through the engine equal transformers' greedy: in one pass, in odd chunks, with
  FP8 weights, and after a prefix hit;
- the config rule: every Qwen3_5MoeTextConfig field declared, values ridge cannot run refused by
  name; the multimodal wrapper's text model served, its refusals naming text_config's field."""
from __future__ import annotations

import pytest
import torch

from hybrid_checks import built_variants, check_fields_declared, check_prefix_hit
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import REGISTRY, read_hf_config
from ridge.quant.errors import ModelLoadError
from test_families import N, V, _write_config, assert_match, hf_logits
from test_qwen3_5 import BASE_TEXT
from test_qwen3_5 import with_ridge_weights as with_qwen3_5_weights
from test_qwen3_next import (ENGINE_RUNS, EXPERTS, LINEAR, SEED, centred_norms_and_decisive_routers, check_engine_runs,
                             check_refused, copy_shared_expert)
from tiny_models import write_tokenizer_files

transformers = pytest.importorskip("transformers")

# id -> config fields. The first: transformers' defaults of the pattern (every fourth layer
# attends) and of partial rotary. The second: its own layer_types, biases, a tied head, one value
# head per key head, a 3-tap convolution, half of each head rotary, mrope's keys (no effect on text).
VARIANTS = {
    "qwen3_5_moe-default-pattern": dict(num_hidden_layers=4, **LINEAR, **EXPERTS),
    "qwen3_5_moe-layer_types-biases-tied": dict(
        num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_conv_kernel_dim=3, attention_bias=True, tie_word_embeddings=True,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"], **EXPERTS,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    return built_variants(tmp_path_factory, "qwen3_5_moe_text", VARIANTS, centred_norms_and_decisive_routers, SEED)


@pytest.fixture(params=list(VARIANTS))
def variant(request, variants):
    return variants(request.param)


def test_fp32_logits_match_transformers(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    cfg = lm.config
    assert cfg.arch == "qwen3_5_moe_text" and cfg.linear_layers and cfg.moe_layers is None and cfg.norm_topk_prob
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def with_ridge_weights(model, lm):
    """Qwen3.5's copy (tests/test_qwen3_5.py: the linear layers', the attention's and the routed
    experts' weights as ridge holds them), and the shared experts'."""
    hf = with_qwen3_5_weights(model, lm)
    with torch.no_grad():
        for ours, theirs in zip(lm.model.layers, hf.model.layers):
            copy_shared_expert(ours, theirs.mlp)
    return hf


def test_fp8_logits_match_transformers_on_ridges_weights(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False, show_progress=False)
    shared = lm.model.layers[0].shared_experts.gate_up_proj
    assert shared.is_fp8 or shared.cpu is not None, "the shared expert not FP8"
    hf = with_ridge_weights(model, lm)
    assert not torch.equal(hf.model.layers[0].mlp.shared_expert.up_proj.weight,
                           model.model.layers[0].mlp.shared_expert.up_proj.weight), "the shared expert not quantized"
    assert_match(prompt_logits(lm.model, ids), hf_logits(hf, ids))


@ENGINE_RUNS
def test_greedy_through_the_engine(variants, weights, chunk, seqs):
    name, model, path, ids = variants("qwen3_5_moe-default-pattern")
    check_engine_runs(model, path, ids, weights, chunk, seqs, with_ridge_weights)


def test_prefix_hit_continues_from_a_state_checkpoint(variants):
    name, model, path, ids = variants("qwen3_5_moe-default-pattern")
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    check_prefix_hit(model, lm, ids, chunk=16, seqs=2)


# -- config fidelity ----------------------------------------------------------------------------
def test_every_config_field_is_declared():
    check_fields_declared(REGISTRY["qwen3_5_moe_text"].hf, transformers.Qwen3_5MoeTextConfig)


@pytest.mark.parametrize("field,value,named", [
    ("hidden_act", "gelu", "hidden_act"),
    ("layer_types", ["linear_attention"] * 4, "layer_types"),
    ("num_experts", 0, "num_experts"),
    ("num_experts_per_tok", 5, "num_experts_per_tok"),
    ("moe_intermediate_size", None, "moe_intermediate_size"),
    ("shared_expert_intermediate_size", 0, "shared_expert_intermediate_size"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4}, "rope_parameters.rope_type"),
])
def test_values_ridge_cannot_run_are_refused_by_name(variants, tmp_path, field, value, named):
    check_refused(variants("qwen3_5_moe-default-pattern")[2], tmp_path, field, value, named)


# -- the Hub's checkpoints: Qwen3_5MoeForConditionalGeneration served as text -------------------
def test_multimodal_checkpoint_served_as_text(tmp_path):
    text = {**BASE_TEXT, "num_hidden_layers": 4, **LINEAR, **EXPERTS}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"])
    config = transformers.AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=vision)
    torch.manual_seed(SEED)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    centred_norms_and_decisive_routers(model)
    path = tmp_path / "qwen3_5_moe"
    model.save_pretrained(path)
    write_tokenizer_files(path)
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    assert lm.config.arch == "qwen3_5_moe_text" and lm.config.linear_layers == [0, 1, 2] and lm.config.num_experts == 4
    ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].float()
    assert_match(prompt_logits(lm.model, ids), ref)


def test_multimodal_refusals_name_the_text_field(tmp_path):
    d = _write_config(tmp_path, "qwen3_5_moe", text_config={**BASE_TEXT, **LINEAR, **EXPERTS, "hidden_act": "gelu"})
    with pytest.raises(ModelLoadError, match="text_config.hidden_act"):
        read_hf_config(d)
    d = _write_config(tmp_path, "qwen3_5_moe", text_config={**BASE_TEXT, **LINEAR, "model_type": "qwen3_5_text"})
    with pytest.raises(ModelLoadError, match="text_config.model_type"):
        read_hf_config(d)
