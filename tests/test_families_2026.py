"""This year's families against transformers as the oracle (issue 41): OLMo 3, SmolLM3, Ministral
and Ministral 3, EXAONE 4, Seed-OSS, ERNIE 4.5, GLM-4.5 MoE and Llama 4 text, with tests/test_families.py's
method. Each variant is a tiny random model built by transformers from a config, saved as
safetensors (and, where llama.cpp writes the architecture, as the GGUF its converter writes),
loaded through ridge's loader: teacher-forced logits over 96 positions with fp32 weights, and
with FP8 weights against transformers run on ridge's e4m3 weights; greedy tokens through the
engine in one pass, in chunks, after a prefix hit and under speculation. Then the config rule:
every field of each config class is declared, and each value ridge cannot run is refused by name.

What each variant reaches: windows of 16 and 20 tokens against 16-token blocks, past every
prompt; per-layer-type RoPE (OLMo 3's YaRN on full layers only); NoPE layers (SmolLM3's, EXAONE
4's global layers); Ministral 3's query scale, whose period (32) the 96 positions cross twice;
GLM's grouped sigmoid routing with a drawn correction bias; Llama 4's temperature tuning, weightless
QK-norm and experts weighted on their input. The multimodal checkpoints the Hub ships (mistral3,
llama4) are served as their text models."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine_utils import assert_no_leak, greedy, make_engine
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import REGISTRY, read_hf_config
from ridge.quant.errors import ModelLoadError
from ridge.quant.hf_config import BASE_IGNORED
from test_families import (BASE, N, V, _dequantized, _write_config, assert_match, build_hf,
                           check_greedy_through_engine, hf_greedy, hf_logits, with_ridge_weights)
from tiny_models import permute_qk, write_gguf

transformers = pytest.importorskip("transformers")

OLMO3_ROPES = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64, "attention_factor": 1.2}}
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.1, "max_position_embeddings": 256}

# id -> (model_type, config fields)
VARIANTS = {
    "olmo3-yarn-window16": ("olmo3", dict(num_hidden_layers=4, sliding_window=16, rope_parameters=OLMO3_ROPES)),
    "olmo3-biases-tied-window20": ("olmo3", dict(num_hidden_layers=4, sliding_window=20, attention_bias=True,
                                                 tie_word_embeddings=True)),
    "smollm3": ("smollm3", dict(num_hidden_layers=4)),
    "smollm3-nope-slides-biases": ("smollm3", dict(use_sliding_window=True, sliding_window=16,
                                                   no_rope_layers=[1, 0, 1, 0], num_hidden_layers=4,
                                                   attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "ministral-window16": ("ministral", dict(sliding_window=16)),
    "ministral-mixed-window20": ("ministral", dict(sliding_window=20, layer_types=["full_attention", "sliding_attention"],
                                                   rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                    "original_max_position_embeddings": 64})),
    "ministral3": ("ministral3", dict(rope_parameters=MINISTRAL3_ROPE)),
    "ministral3-window16-mscale": ("ministral3", dict(sliding_window=16, tie_word_embeddings=True,
                                                      rope_parameters={**MINISTRAL3_ROPE, "mscale": 2.0,
                                                                       "llama_4_scaling_beta": 0.5})),
    "exaone4-window16": ("exaone4", dict(num_hidden_layers=4, sliding_window=16)),
    # the 32B's depth: the one llama.cpp slides (3 layers in 4, NoPE on the fourth)
    "exaone4-64-layers-window16": ("exaone4", dict(num_hidden_layers=64, sliding_window=16, hidden_size=32,
                                                   intermediate_size=48, head_dim=8)),
    "exaone4-1.2b-style": ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 2,
                                           tie_word_embeddings=True)),  # no window: RoPE on every layer
    "exaone4-global-only": ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 2,
                                            rope_parameters={"rope_type": "linear", "factor": 2.0})),
    "seed_oss": ("seed_oss", {}),
    "seed_oss-all-biases": ("seed_oss", dict(attention_out_bias=True, mlp_bias=True)),
    "ernie4_5": ("ernie4_5", {}),
    "ernie4_5-biases-untied": ("ernie4_5", dict(use_bias=True, tie_word_embeddings=False)),
    # a dense first layer, then 8 experts in 2 groups (1 chosen), 2 a token, scaled by 2.5, one shared
    "glm4_moe": ("glm4_moe", dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                  topk_group=1, moe_intermediate_size=32, routed_scaling_factor=2.5,
                                  attention_bias=True, use_qk_norm=True)),
    "glm4_moe-4-groups-unnormed-2-shared": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                                             topk_group=2, moe_intermediate_size=24,
                                                             n_shared_experts=2, first_k_dense_replace=0,
                                                             norm_topk_prob=False, tie_word_embeddings=True)),
    # NoPE on layer 3 with temperature tuning over 32-token periods, chunks of 128 (past the prompts:
    # ridge serves one chunk), Llama 3 RoPE, experts on layers 1 and 3, one a token
    "llama4_text": ("llama4_text", dict(num_hidden_layers=4, num_local_experts=4, intermediate_size=32,
                                        intermediate_size_mlp=96, interleave_moe_layer_step=2,
                                        attention_chunk_size=128, floor_scale=32, attn_scale=0.5,
                                        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64})),
    # what llama.cpp fixes for llama4 (8192-token chunks, every fourth layer NoPE, temperature 0.1 over 8192)
    "llama4_text-llama.cpp-defaults": ("llama4_text", dict(num_hidden_layers=4, num_local_experts=4,
                                                           intermediate_size=32, intermediate_size_mlp=96,
                                                           interleave_moe_layer_step=2)),
    "llama4_text-k2-biases-no-qk-norm": ("llama4_text", dict(num_local_experts=4, num_experts_per_tok=2,
                                                             intermediate_size=32, no_rope_layers=[0, 1],
                                                             attention_chunk_size=None, attention_bias=True,
                                                             use_qk_norm=False, floor_scale=16,
                                                             tie_word_embeddings=True)),
}


def _spread_router(model) -> None:
    """GLM's routers start at zero: draw them, and the correction bias, so that the groups, the
    bias's choice and the sigmoids' weights all matter."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.weight.normal_(0.0, 0.3)
            gate.e_score_correction_bias.normal_(0.0, 0.2)


EDITS = {name: _spread_router for name, (kind, _) in VARIANTS.items() if kind == "glm4_moe"}
# The families llama.cpp's converter writes: OLMo 3 as olmo2 (in llama.cpp's 3-sliding-to-1
# pattern, one RoPE base), SmolLM3 (every fourth layer NoPE), EXAONE 4 (windows at 64 layers
# only), Seed-OSS and ERNIE 4.5; GLM-4.5's and Llama 4's files by their own writers below.
GGUF_VARIANTS = ["olmo3-biases-tied-window20", "smollm3", "exaone4-64-layers-window16", "exaone4-1.2b-style",
                 "seed_oss", "ernie4_5-biases-untied"]
ENGINE_VARIANTS = ["olmo3-yarn-window16", "smollm3-nope-slides-biases", "ministral-mixed-window20", "ministral3",
                   "exaone4-window16", "seed_oss-all-biases", "ernie4_5-biases-untied", "glm4_moe", "llama4_text"]


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """name -> (name, transformers model, its directory, token ids), built once."""
    built = {}

    def get(name):
        if name not in built:
            model_type, fields = VARIANTS[name]
            model, path = build_hf(tmp_path_factory.mktemp(name), model_type, fields, edit=EDITS.get(name))
            ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
            built[name] = name, model, path, ids
        return built[name]
    return get


@pytest.fixture(params=list(VARIANTS))
def variant(request, variants):
    return variants(request.param)


def load(path, weights: str):
    return load_model(path, device="cpu", weights=weights, use_cache=False, show_progress=False)


def _llama4_on_ridge_weights(model, lm):
    """Llama 4's feed_forward (dense, or stacked experts [E, H, 2I] / [E, I, H], router and shared
    expert) and attention with ridge's weights."""
    hf, cfg = copy.deepcopy(model), lm.config
    with torch.no_grad():
        hf.get_input_embeddings().weight.copy_(_dequantized(lm.model.embed_tokens))
        if not cfg.tie_word_embeddings:
            hf.get_output_embeddings().weight.copy_(lm.model.lm_head.dequantized())
        for ours, theirs in zip(lm.model.layers, hf.model.layers):
            attn, ff = theirs.self_attn, theirs.feed_forward
            for proj, w in zip((attn.q_proj, attn.k_proj, attn.v_proj),
                               ours.qkv_proj.dequantized().split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
                proj.weight.copy_(w)
            attn.o_proj.weight.copy_(ours.o_proj.dequantized())
            if hasattr(ours, "experts"):
                gate_up, down = ours.experts.dequantized()
                ff.experts.gate_up_proj.copy_(gate_up.transpose(1, 2))
                ff.experts.down_proj.copy_(down.transpose(1, 2))
                assert torch.equal(ff.router.weight, ours.router.weight), "the router stays as shipped"
                mlp, fused, down_proj = ff.shared_expert, ours.shared_experts.gate_up_proj, ours.shared_experts.down_proj
            else:
                mlp, fused, down_proj = ff, ours.gate_up_proj, ours.down_proj
            gate, up = fused.dequantized().chunk(2)
            mlp.gate_proj.weight.copy_(gate)
            mlp.up_proj.weight.copy_(up)
            mlp.down_proj.weight.copy_(down_proj.dequantized())
    return hf


def on_ridge_weights(model, lm):
    """transformers' model computing with ridge's weights; ERNIE 4.5's and Llama 4's q and k rows
    are ridge's reordering of the checkpoint's (ridge/models/ernie4_5/model.py), put back in its order."""
    hf = _llama4_on_ridge_weights(model, lm) if lm.config.arch == "llama4_text" else with_ridge_weights(model, lm)
    with torch.no_grad():
        for ours, theirs in zip(lm.model.layers, hf.model.layers):
            if getattr(ours, "shared_experts", None) is not None and hasattr(theirs, "mlp"):  # GLM-4.5's
                gate, up = ours.shared_experts.gate_up_proj.dequantized().chunk(2)
                shared = theirs.mlp.shared_experts
                shared.gate_proj.weight.copy_(gate)
                shared.up_proj.weight.copy_(up)
                shared.down_proj.weight.copy_(ours.shared_experts.down_proj.dequantized())
    if lm.config.arch in ("ernie4_5", "llama4_text"):
        with torch.no_grad():
            for layer in hf.model.layers:
                attn = layer.self_attn
                attn.q_proj.weight.copy_(permute_qk(attn.q_proj.weight, lm.config.num_heads))
                attn.k_proj.weight.copy_(permute_qk(attn.k_proj.weight, lm.config.num_kv_heads))
    return hf


def test_fp32_logits_match_transformers(variant):
    name, model, path, ids = variant
    lm = load(path, "fp32")
    assert lm.config.arch == VARIANTS[name][0]
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def test_fp8_logits_match_transformers_on_ridges_weights(variant):
    name, model, path, ids = variant
    lm = load(path, "fp8")
    hf = on_ridge_weights(model, lm)
    assert any(not torch.equal(a, b) for a, b in zip(hf.parameters(), model.parameters())), "weights not quantized"
    assert_match(prompt_logits(lm.model, ids), hf_logits(hf, ids))


@pytest.mark.parametrize("name", GGUF_VARIANTS)
def test_gguf_logits_match_transformers(tmp_path, variants, name):
    name, model, path, ids = variants(name)
    gguf_path = write_gguf(tmp_path / f"{name}.gguf", read_hf_config(path), model.state_dict())
    lm = load(gguf_path, "fp32")
    assert lm.config.arch == VARIANTS[name][0]
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


@pytest.mark.parametrize("weights,chunk", [("fp32", 128), ("fp32", 16), ("fp32", 7), ("fp8", 16)],
                         ids=["one-pass", "chunks-of-a-block", "chunks-of-7", "fp8-chunks-of-a-block"])
@pytest.mark.parametrize("name", ENGINE_VARIANTS)
def test_greedy_through_the_engine(variants, name, weights, chunk):
    """Two prompts of 50 tokens, the second sharing two blocks with the first (a prefix hit)."""
    name, model, path, ids = variants(name)
    lm = load(path, weights)
    check_greedy_through_engine(lm, on_ridge_weights(model, lm) if weights == "fp8" else model, ids, chunk)


@pytest.mark.parametrize("spec", ["ngram", "self:1"])
@pytest.mark.parametrize("name", ENGINE_VARIANTS)
def test_greedy_under_speculation(variants, name, spec):
    """Prompt lookup (a prompt that repeats itself) and the self-draft: greedy tokens are
    transformers' whatever the proposer drafts."""
    name, model, path, ids = variants(name)
    lm = load(path, "fp32")
    prompt = ids[:24] + ids[:24]
    eng = make_engine(lm, speculative=spec, max_num_seqs=2)
    eng.add_request("r", prompt, greedy(16))
    got = []
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
    assert got == hf_greedy(model, prompt, 16)
    assert eng.stats()["speculative"]["total"]["drafted"] > 0
    assert_no_leak(eng)


# -- config fidelity ---------------------------------------------------------------------------
CONFIG_CLASSES = {"olmo3": "Olmo3Config", "smollm3": "SmolLM3Config", "ministral": "MinistralConfig",
                  "ministral3": "Ministral3Config", "exaone4": "Exaone4Config", "seed_oss": "SeedOssConfig",
                  "ernie4_5": "Ernie4_5Config", "glm4_moe": "Glm4MoeConfig", "llama4_text": "Llama4TextConfig"}


@pytest.mark.parametrize("model_type", list(CONFIG_CLASSES))
def test_every_field_of_transformers_config_is_declared(model_type):
    fam = REGISTRY[model_type].hf
    cls = getattr(transformers, CONFIG_CLASSES[model_type])
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    undeclared = sorted(set(fields) - fam.fields - fam.ignored - BASE_IGNORED)
    assert not undeclared, f"{model_type}: fields neither read nor ignored: {undeclared}"
    wrong = {k: (v, fields[k]) for k, v in fam.defaults.items() if k in fields and fields[k] != v}
    assert not wrong, f"{model_type}: defaults differ from transformers' (ours, theirs): {wrong}"


def test_fields_transformers_reads_are_honoured(tmp_path):
    """What the fields become, with transformers' defaults where a file leaves one out."""
    olmo = read_hf_config(_write_config(tmp_path, "olmo3", num_hidden_layers=8, sliding_window=16))
    assert olmo.layer_types == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + \
        ["full_attention"]
    assert olmo.rope_theta == olmo.rope_local_theta == 500000.0 and olmo.qk_norm
    old = read_hf_config(_write_config(tmp_path, "olmo3", rope_scaling={"rope_type": "yarn", "factor": 2.0},
                                       rope_theta=500000.0))  # the older keys: the full layers' scaling
    assert old.rope_scaling["rope_type"] == "yarn" and old.rope_local_scaling is None
    smol = read_hf_config(_write_config(tmp_path, "smollm3", num_hidden_layers=8))
    assert smol.nope_layers == [3, 7] and smol.layer_types is None and smol.rope_theta == 2_000_000.0
    smol = read_hf_config(_write_config(tmp_path, "smollm3", num_hidden_layers=4, no_rope_layer_interval=2,
                                        use_sliding_window=True, sliding_window=8))
    assert smol.nope_layers == [1, 3] and smol.layer_types == ["full_attention", "sliding_attention"] * 2
    mini = read_hf_config(_write_config(tmp_path, "ministral", sliding_window=None))
    assert mini.layer_types is None and mini.sliding_window is None
    m3 = read_hf_config(_write_config(tmp_path, "ministral3", rope_parameters=None))  # Ministral3Config's YaRN
    assert m3.rope_scaling["factor"] == 16.0 and m3.query_scale == {"beta": 0.1, "period": 16384}
    ex = read_hf_config(_write_config(tmp_path, "exaone4", num_hidden_layers=4, sliding_window=8))
    assert ex.layer_types == ["sliding_attention"] * 3 + ["full_attention"] and ex.nope_layers == [3]
    ex = read_hf_config(_write_config(tmp_path, "exaone4", num_hidden_layers=4, sliding_window=8,
                                      sliding_window_pattern="LLLG", layer_types=["full_attention"] * 4))
    assert ex.layer_types is None and ex.nope_layers == [0, 1, 2, 3]  # a window: the global layers are NoPE
    seed = read_hf_config(_write_config(tmp_path, "seed_oss"))
    assert seed.attention_bias and not seed.o_bias and not seed.mlp_bias
    glm = read_hf_config(_write_config(tmp_path, "glm4_moe", n_routed_experts=8, num_experts_per_tok=2))
    assert glm.moe_router == "sigmoid_group_topk" and glm.moe_layers == [1] and glm.rotary_dim == 8
    assert glm.shared_expert_intermediate_size == 1408 and glm.norm_topk_prob and not glm.o_bias
    l4 = read_hf_config(_write_config(tmp_path, "llama4_text", num_hidden_layers=4, num_local_experts=4,
                                      max_position_embeddings=131072))
    assert l4.max_position == 8192 and l4.nope_layers == [3] and l4.moe_layers is None  # one chunk; experts everywhere
    assert l4.intermediate_size == 16384 and l4.moe_intermediate_size == l4.shared_expert_intermediate_size == 96
    assert l4.query_scale == {"beta": 0.1, "period": 8192, "offset": 1} and l4.rope_theta == 500000.0
    ernie = read_hf_config(_write_config(tmp_path, "ernie4_5", use_bias=True))
    assert ernie.attention_bias and ernie.o_bias and ernie.mlp_bias and ernie.rope_theta == 500000.0


REFUSED = [  # (model_type, fields, what the message names)
    ("olmo3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000.0}), "rope_parameters="),
    ("olmo3", dict(rope_theta=10000.0), "rope_theta=10000.0"),
    ("olmo3", dict(rope_parameters={**OLMO3_ROPES, "full_attention": {"rope_type": "dynamic", "factor": 2.0}}),
     "rope_parameters.full_attention.rope_type='dynamic'"),
    ("olmo3", dict(rope_parameters={**OLMO3_ROPES, "full_attention": {**OLMO3_ROPES["full_attention"],
                                                                     "truncate": False}}),
     "rope_parameters.full_attention.truncate=False"),
    ("olmo3", dict(sliding_window=None), "sliding_window=None"),
    ("smollm3", dict(no_rope_layers=[1]), "no_rope_layers=[1]"),
    ("smollm3", dict(no_rope_layers=[1, 2]), "no_rope_layers=[1, 2]"),
    ("smollm3", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8), "layer_types="),
    ("ministral", dict(sliding_window=None, layer_types=["sliding_attention"] * 2), "sliding_window=None"),
    ("ministral3", dict(rope_parameters={k: v for k, v in MINISTRAL3_ROPE.items() if k != "llama_4_scaling_beta"}),
     "rope_parameters.llama_4_scaling_beta=None"),
    ("ministral3", dict(rope_parameters={"rope_type": "default", "llama_4_scaling_beta": 0.1}),
     "rope_parameters.original_max_position_embeddings=None"),
    ("ministral3", dict(rope_parameters={**MINISTRAL3_ROPE, "rope_type": "longrope"}),
     "rope_parameters.rope_type='longrope'"),
    ("exaone4", dict(sliding_window=None), "layer_types=None"),
    ("exaone4", dict(sliding_window_pattern="LLLG"), "sliding_window_pattern='LLLG'"),
    ("exaone4", dict(sliding_window=None, layer_types=["sliding_attention"] * 2), "sliding_window=None"),
    ("seed_oss", dict(attention_out_bias="no"), "attention_out_bias='no'"),
    ("ernie4_5", dict(use_bias=None), "use_bias=None"),
    ("ernie4_5", dict(hidden_act="relu"), "hidden_act='relu'"),
    ("glm4_moe", dict(n_routed_experts=8, n_group=3), "n_group=3"),
    ("glm4_moe", dict(n_routed_experts=8, n_group=2, topk_group=3), "topk_group=3"),
    ("glm4_moe", dict(n_routed_experts=8, n_group=4, num_experts_per_tok=3), "num_experts_per_tok=3"),
    ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=-1), "n_shared_experts=-1"),
    ("llama4_text", dict(no_rope_layers=[1, 1, 0]), "no_rope_layers=[1, 1, 0]"),
    ("llama4_text", dict(layer_types=["sliding_attention"] * 2), "layer_types="),
    ("llama4_text", dict(attention_chunk_size=None, layer_types=["chunked_attention"] * 2),
     "attention_chunk_size=None"),
    ("llama4_text", dict(moe_layers=[2]), "moe_layers=[2]"),
    ("llama4", dict(text_config={"model_type": "llama"}), "text_config.model_type='llama'"),
]


@pytest.mark.parametrize("model_type,fields,named", REFUSED, ids=[f"{r[0]}-{r[2].split('=')[0]}" for r in REFUSED])
def test_values_ridge_cannot_run_are_refused_by_name(tmp_path, model_type, fields, named):
    with pytest.raises(ModelLoadError, match=named.replace("[", r"\[").replace(".", r"\.")):
        read_hf_config(_write_config(tmp_path, model_type, **fields))


# -- Ministral 3 as the Hub ships it: Mistral3ForConditionalGeneration, served as its text model
@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    from tiny_models import write_tokenizer_files

    text = dict(model_type="ministral3", vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rope_parameters=MINISTRAL3_ROPE, tie_word_embeddings=True)  # the wrapper's flag decides, not this
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=16, image_size=28, patch_size=14)
    cfg = transformers.Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(3)
    model = transformers.Mistral3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.1)
    path = tmp_path_factory.mktemp("mistral3") / "mistral3"
    model.save_pretrained(path)
    write_tokenizer_files(path)
    return model, path


def test_mistral3_checkpoint_serves_its_text_model(mistral3):
    model, path = mistral3
    ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
    lm = load(path, "fp32")
    assert lm.config.arch == "ministral3" and not lm.config.tie_word_embeddings
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].float()
    assert_match(prompt_logits(lm.model, ids), ref)


def test_mistral3_config_fields_are_declared():
    from ridge.models.mistral3.config import WRAPPER_DEFAULTS, WRAPPER_IGNORED, WRAPPER_READ

    fields = {f.name: f.default for f in dataclasses.fields(transformers.Mistral3Config)}
    undeclared = sorted(set(fields) - WRAPPER_READ - WRAPPER_IGNORED - BASE_IGNORED)
    assert not undeclared, f"Mistral3Config fields neither read nor ignored: {undeclared}"
    assert all(fields[k] == v for k, v in WRAPPER_DEFAULTS.items())


@pytest.mark.parametrize("text,named", [
    (dict(model_type="llama"), "text_config.model_type='llama'"),
    (dict(model_type="ministral3", rope_parameters={"rope_type": "default"}),
     "text_config.rope_parameters.llama_4_scaling_beta=None"),
])
def test_mistral3_refusals_name_the_field(tmp_path, text, named):
    d = _write_config(tmp_path, "mistral3", text_config={**{k: v for k, v in BASE.items()}, **text})
    with pytest.raises(ModelLoadError, match=named.replace(".", r"\.")):
        read_hf_config(d)


# -- GGUF files whose layer pattern llama.cpp would not run as the checkpoint does
def test_gguf_windows_llama_cpp_would_not_run_are_refused(tmp_path, variants):
    _, model, path, _ = variants("exaone4-window16")  # 4 layers: llama.cpp slides only the 64-layer model
    f = write_gguf(tmp_path / "e.gguf", read_hf_config(path), model.state_dict())
    with pytest.raises(ModelLoadError, match=r"exaone4\.attention\.sliding_window=16"):
        load(f, "fp32")
    _, model, path, _ = variants("olmo3-biases-tied-window20")
    cfg = dataclasses.replace(read_hf_config(path), layer_types=["full_attention", "sliding_attention"] * 2)
    f = write_gguf(tmp_path / "o.gguf", cfg, model.state_dict())
    with pytest.raises(ModelLoadError, match=r"olmo2\.attention\.sliding_window_pattern="):
        load(f, "fp32")


# -- Llama 4 as the Hub ships it: Llama4ForConditionalGeneration, served as its text model
def test_llama4_checkpoint_serves_its_text_model(tmp_path):
    from tiny_models import write_tokenizer_files

    text = dict(VARIANTS["llama4_text"][1], model_type="llama4_text", vocab_size=V, hidden_size=64,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                tie_word_embeddings=True)  # text_config's flag ties the head, not the wrapper's
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)
    cfg = transformers.Llama4Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(4)
    model = transformers.Llama4ForConditionalGeneration(cfg).eval()
    model.save_pretrained(tmp_path / "llama4")
    write_tokenizer_files(tmp_path / "llama4")
    ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
    lm = load(tmp_path / "llama4", "fp32")
    assert lm.config.arch == "llama4_text" and lm.config.tie_word_embeddings and lm.config.max_position == 128
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].float()
    assert_match(prompt_logits(lm.model, ids), ref)


def test_llama4_config_fields_are_declared():
    from ridge.models.llama4_text import WRAPPER_DEFAULTS, WRAPPER_IGNORED

    fields = {f.name: f.default for f in dataclasses.fields(transformers.Llama4Config)}
    undeclared = sorted(set(fields) - {"text_config"} - WRAPPER_IGNORED - BASE_IGNORED)
    assert not undeclared, f"Llama4Config fields neither read nor ignored: {undeclared}"
    assert all(fields[k] == v for k, v in WRAPPER_DEFAULTS.items())


# -- GLM-4.5 as llama.cpp's converter writes it (Glm4MoeModel), with an MTP block after the decoder's
def write_glm4_moe_gguf(path, cfg, sd: dict, mtp_block: bool = True):
    """transformers' tensors (experts stacked [E, 2I, H]) under llama.cpp's names and keys; with
    mtp_block a trailing block of nextn.* tensors (a checkpoint's MTP layer), which readers skip."""
    import gguf

    from tiny_models import _gguf_name, tiny_vocab

    E, n = cfg.num_experts, cfg.num_layers
    w = gguf.GGUFWriter(str(path), "glm4moe")
    w.add_block_count(n + mtp_block)
    for add, v in ((w.add_context_length, cfg.max_position), (w.add_embedding_length, cfg.hidden_size),
                   (w.add_feed_forward_length, cfg.intermediate_size), (w.add_head_count, cfg.num_heads),
                   (w.add_head_count_kv, cfg.num_kv_heads), (w.add_key_length, cfg.head_dim),
                   (w.add_value_length, cfg.head_dim), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                   (w.add_rope_freq_base, cfg.rope_theta), (w.add_vocab_size, cfg.vocab_size),
                   (w.add_rope_dimension_count, cfg.rotary_dim or cfg.head_dim), (w.add_expert_count, E),
                   (w.add_expert_used_count, cfg.num_experts_per_tok),
                   (w.add_expert_feed_forward_length, cfg.moe_intermediate_size),
                   (w.add_expert_shared_count, cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size),
                   (w.add_leading_dense_block_count, (cfg.moe_layers or [0])[0]),
                   (w.add_expert_gating_func, gguf.ExpertGatingFuncType.SIGMOID),
                   (w.add_expert_weights_scale, cfg.routed_scaling_factor),
                   (w.add_expert_weights_norm, cfg.norm_topk_prob), (w.add_nextn_predict_layers, int(mtp_block))):
        add(v)
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    special = {"mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
               "post_attention_layernorm.weight": "post_attention_norm.weight",
               **{f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")}}
    for name, t in sd.items():
        t = t.float()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        rest = name.split(".", 3)[3] if name.startswith("model.layers.") else None
        if rest == "mlp.experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            for kind, x in (("gate", gate), ("up", up)):
                w.add_tensor(f"blk.{name.split('.')[2]}.ffn_{kind}_exps.weight", x.contiguous().numpy())
        elif rest == "mlp.experts.down_proj":
            w.add_tensor(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", t.contiguous().numpy())
        elif rest in special:
            w.add_tensor(f"blk.{name.split('.')[2]}.{special[rest]}", t.numpy())
        else:
            w.add_tensor(_gguf_name(name), t.numpy())
    if mtp_block:  # what the MTP layer adds beyond a decoder block's tensors
        for kind in ("eh_proj", "shared_head_head"):
            w.add_tensor(f"blk.{n}.nextn.{kind}.weight", torch.randn(cfg.hidden_size, 2 * cfg.hidden_size).numpy())
        for kind in ("enorm", "hnorm", "shared_head_norm"):
            w.add_tensor(f"blk.{n}.nextn.{kind}.weight", torch.ones(cfg.hidden_size).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", ["glm4_moe", "glm4_moe-4-groups-unnormed-2-shared"])
def test_glm4_moe_gguf_logits_match_transformers(tmp_path, variants, name):
    """The file has no expert groups: the variant with 4 groups is read with one, as llama.cpp runs
    it, and matches transformers run with one group (n_group=1) on the same weights."""
    name, model, path, ids = variants(name)
    cfg = read_hf_config(path)
    lm = load(write_glm4_moe_gguf(tmp_path / f"{name}.gguf", cfg, model.state_dict()), "fp32")
    assert lm.config.arch == "glm4_moe" and lm.config.num_layers == cfg.num_layers
    ref = model
    if cfg.moe_n_group > 1:
        ref = copy.deepcopy(model)
        for layer in ref.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.num_group = layer.mlp.gate.topk_group = 1
    assert_match(prompt_logits(lm.model, ids), hf_logits(ref, ids))


# -- Llama 4 as llama.cpp's converter writes it (Llama4Model)
def write_llama4_gguf(path, cfg, sd: dict):
    """transformers' tensors under llama.cpp's names (experts split and transposed to [E, I, H] and
    [E, H, I]), rows unpermuted; llama.cpp's own constants are not in the file."""
    import gguf

    from tiny_models import _gguf_name, tiny_vocab

    w = gguf.GGUFWriter(str(path), "llama4")
    for add, v in ((w.add_block_count, cfg.num_layers), (w.add_context_length, 256),
                   (w.add_embedding_length, cfg.hidden_size), (w.add_feed_forward_length, cfg.intermediate_size),
                   (w.add_head_count, cfg.num_heads), (w.add_head_count_kv, cfg.num_kv_heads),
                   (w.add_key_length, cfg.head_dim), (w.add_value_length, cfg.head_dim),
                   (w.add_layer_norm_rms_eps, cfg.rms_norm_eps), (w.add_rope_freq_base, cfg.rope_theta),
                   (w.add_vocab_size, cfg.vocab_size), (w.add_rope_dimension_count, cfg.head_dim),
                   (w.add_expert_count, cfg.num_experts), (w.add_expert_used_count, cfg.num_experts_per_tok),
                   (w.add_expert_feed_forward_length, cfg.moe_intermediate_size),
                   (w.add_interleave_moe_layer_step, (cfg.moe_layers or [0])[0] + 1)):
        add(v)
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "feed_forward.router.weight": "ffn_gate_inp.weight",
             **{f"feed_forward.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},
             **{f"feed_forward.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")}}
    for name, t in sd.items():
        t = t.float()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if not name.startswith("model.layers."):
            w.add_tensor(_gguf_name(name), t.numpy())
            continue
        _, _, i, rest = name.split(".", 3)
        if rest == "feed_forward.experts.gate_up_proj":  # [E, H, 2I]
            for kind, x in zip(("gate", "up"), t.chunk(2, dim=2)):
                w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", x.transpose(1, 2).contiguous().numpy())
        elif rest == "feed_forward.experts.down_proj":  # [E, I, H]
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", t.transpose(1, 2).contiguous().numpy())
        elif rest in layer:
            w.add_tensor(f"blk.{i}.{layer[rest]}", t.numpy())
        else:
            w.add_tensor(_gguf_name(name), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llama4_gguf_logits_match_transformers(tmp_path, variants):
    name, model, path, ids = variants("llama4_text-llama.cpp-defaults")
    lm = load(write_llama4_gguf(tmp_path / "l4.gguf", read_hf_config(path), model.state_dict()), "fp32")
    assert lm.config.arch == "llama4_text" and lm.config.nope_layers == [3] and lm.config.moe_layers == [1, 3]
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))
