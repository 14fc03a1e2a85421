"""Gemma 4 text (issue 41), against transformers 5.25 as the oracle, with tests/test_families.py's
method: tiny random models written by transformers as HF directories and loaded through ridge's
loader; teacher-forced logits over 96 positions in fp32 and with FP8 weights (against transformers
run on ridge's e4m3 weights); greedy tokens through the engine in one pass, in chunks and after a
prefix hit. The variants reach per-layer input embeddings, KV-shared layers (sliding and full
ones reading an earlier layer's blocks), the double-wide MLP of the shared layers, full layers
with wider heads and their own KV heads (blocks of their own shape), keys as values on them,
windows of 16 and 20 tokens against 16-token blocks, proportional RoPE and the final soft-cap;
the multimodal checkpoint served as text. Then the rotary tables on their own (the full layers'
proportional RoPE turns only the first partial_rotary_factor of a head's frequencies, still
pairing dim j with j + head_dim / 2), and the config rule: every field declared, what ridge
cannot run refused by name."""
from __future__ import annotations

import copy
import re
import dataclasses
import json

import pytest
import torch

from ridge.kernels import ops
from ridge.models.layers.rope import rope_cos_sin
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import REGISTRY, read_hf_config
from ridge.quant.errors import ModelLoadError
from ridge.quant.hf_config import BASE_IGNORED
from test_families import BASE, N, V, _dequantized, assert_match, build_hf, check_greedy_through_engine, hf_logits

transformers = pytest.importorskip("transformers")
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig  # noqa: E402
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

POSITIONS = 300
ROPES = {
    "checkpoint-defaults": None,  # what Gemma4TextConfig fills: 10k default / 1M proportional at 0.25
    "half-turning-scaled": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                               "rope_theta": 50_000.0, "factor": 4.0}},
    "all-turning": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.0,
                                       "rope_theta": 1_000_000.0}},
}


def _oracle(rope):
    cfg = Gemma4TextConfig(num_hidden_layers=6, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, global_head_dim=32, rope_parameters=rope, max_position_embeddings=POSITIONS)
    return cfg, Gemma4TextRotaryEmbedding(cfg)


def _table(cfg, layer_type: str) -> torch.Tensor:
    params = cfg.rope_parameters[layer_type]
    dim = cfg.per_layer_config[layer_type].head_dim
    return rope_cos_sin(dim, POSITIONS, params["rope_theta"], params)


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_rope_table_matches_transformers(rope, layer_type):
    cfg, emb = _oracle(rope)
    dim = cfg.per_layer_config[layer_type].head_dim
    positions = torch.arange(POSITIONS)
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), positions[None], layer_type)
    table = _table(cfg, layer_type)
    assert table.shape == (POSITIONS, dim)
    half = dim // 2
    # transformers' cos and sin repeat each half: [f | f]
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], rtol=0, atol=2e-5)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], rtol=0, atol=2e-5)
    if layer_type == "full_attention":
        turning = int(cfg.rope_parameters[layer_type]["partial_rotary_factor"] * dim // 2)
        assert (table[:, turning:half] == 1).all() and (table[:, half + turning:] == 0).all()


@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_rotation_matches_transformers(rope):
    """ridge's rope op on the full layers' table rotates q and k as transformers' Gemma 4 does."""
    cfg, emb = _oracle(rope)
    dim, T = cfg.per_layer_config["full_attention"].head_dim, 40
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(T, 2, dim, generator=g), torch.randn(T, 1, dim, generator=g)
    positions = torch.randint(0, POSITIONS, (T,), generator=g)
    cos, sin = emb(q, positions[None], "full_attention")  # [1, T, dim]
    want_q = apply_rotary_pos_emb(q[None], cos, sin, unsqueeze_dim=2)[0]
    want_k = apply_rotary_pos_emb(k[None], cos, sin, unsqueeze_dim=2)[0]
    got_q, got_k = ops.rope(q.clone(), k.clone(), positions, _table(cfg, "full_attention"))
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-4)


def test_unknown_rope_type_is_named():
    with pytest.raises(ValueError, match="proportional"):
        rope_cos_sin(16, 8, 10_000.0, {"rope_type": "dynamic", "factor": 2.0})


# -- the model against transformers ---------------------------------------------------------------
SHARED = dict(num_hidden_layers=6, num_kv_shared_layers=2, sliding_window=16,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                           "sliding_attention", "full_attention"])
VARIANTS = {
    # the E2B-like shape: per-layer inputs, the last two layers reading layers 2's and 3's K and V,
    # full layers with heads twice as wide
    "ple-kv-shared-window16": dict(SHARED, hidden_size_per_layer_input=8, use_double_wide_mlp=True,
                                   global_head_dim=32),
    # the 31B-like shape: full layers with wider heads, one KV head, their keys as values
    "k-eq-v-biases-window20-softcap": dict(num_hidden_layers=4, sliding_window=20, attention_k_eq_v=True,
                                           global_head_dim=32, num_global_key_value_heads=1,
                                           attention_bias=True, hidden_size_per_layer_input=0,
                                           final_logit_softcapping=5.0, tie_word_embeddings=False,
                                           rope_parameters=ROPES["half-turning-scaled"]),
    # the default pattern, 5 sliding to 1 full, over 7 layers: transformers makes the last one full
    "default-pattern-no-ple": dict(num_hidden_layers=7, sliding_window=16, hidden_size_per_layer_input=0),
    # the 26B-A4B-like shape: experts beside every layer's dense MLP
    "moe-window16": dict(num_hidden_layers=4, sliding_window=16, hidden_size_per_layer_input=0, enable_moe_block=True,
                         num_experts=6, top_k_experts=2, moe_intermediate_size=24),
}
ENGINE_VARIANTS = ["ple-kv-shared-window16", "k-eq-v-biases-window20-softcap", "moe-window16"]


def _draw(model) -> None:
    """The layer scalars start at one: draw them so that a misplaced one shows. q and k are
    RMS-normed and the softmax scale is 1: with norm weights near 1 the scores' spread is
    sqrt(head_dim), and the tiny model is so sharp that transformers in fp32 differs from itself in
    fp64 by 1e-4; times head_dim ** -0.25, the scores spread as a usual model's and the budget
    measures ridge."""
    for layer in model.model.layers:
        layer.layer_scalar.copy_(0.5 + torch.rand(1))
        if getattr(layer, "enable_moe_block", False):  # the router's scales start at one too
            layer.router.scale.copy_(0.5 + torch.rand_like(layer.router.scale))
            layer.router.per_expert_scale.copy_(0.5 + torch.rand_like(layer.router.per_expert_scale))
        attn = layer.self_attn
        attn.q_norm.weight.mul_(attn.head_dim ** -0.25)
        if getattr(attn, "k_norm", None) is not None:
            attn.k_norm.weight.mul_(attn.head_dim ** -0.25)


def _fields(fields: dict) -> dict:
    # one head shape on every layer (ridge's paged KV); vocab_size_per_layer_input: the tiny vocabulary
    return {"head_dim": BASE["head_dim"], "global_head_dim": BASE["head_dim"], "vocab_size_per_layer_input": V,
            "hidden_activation": "gelu_pytorch_tanh", **fields}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}

    def get(name):
        if name not in out:
            model, path = build_hf(tmp_path_factory.mktemp(name), "gemma4_text", _fields(VARIANTS[name]), edit=_draw)
            ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
            out[name] = model, path, ids
        return out[name]
    return get


def _exact_logits(model, ids) -> torch.Tensor:
    """transformers' logits computed in fp64: with Gemma 4's softmax scale of 1 these tiny models
    are sensitive enough that transformers' own fp32 result lies about half the 1e-5 budget from
    the exact one, so the exact one is the oracle (ridge runs fp32 against it)."""
    exact = copy.deepcopy(model).double()
    exact.config._experts_implementation = "eager"  # the grouped product takes no fp64
    return hf_logits(exact, ids).float()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fp32_logits_match_transformers(built, name):
    model, path, ids = built(name)
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    assert_match(prompt_logits(lm.model, ids), _exact_logits(model, ids))


@pytest.mark.parametrize("name", ENGINE_VARIANTS)
@pytest.mark.parametrize("chunk", [256, 16])
def test_greedy_through_engine(built, name, chunk):
    model, path, ids = built(name)
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    check_greedy_through_engine(lm, model, ids, chunk)


def _with_ridge_weights(model, lm):
    """A copy of the transformers model computing with ridge's e4m3 weights (exact in fp32)."""
    hf = copy.deepcopy(model)
    with torch.no_grad():
        hf.get_input_embeddings().weight.copy_(_dequantized(lm.model.embed_tokens))
        if not lm.config.tie_word_embeddings:
            hf.get_output_embeddings().weight.copy_(lm.model.lm_head.dequantized())
        for ours, theirs in zip(lm.model.layers, hf.model.layers):
            attn, mlp, cfg = theirs.self_attn, theirs.mlp, ours.cfg  # the layer's own head shape
            q, *kv = ours.qkv_proj.dequantized().split([cfg.q_size, cfg.kv_size, cfg.kv_size][: 1 + 2 * (
                ours.kv_source is None)])
            attn.q_proj.weight.copy_(q)
            if kv:
                attn.k_proj.weight.copy_(kv[0])
                if attn.v_proj is None:  # keys as values: both row sets quantized alike
                    assert torch.equal(kv[0], kv[1])
                else:
                    attn.v_proj.weight.copy_(kv[1])
            attn.o_proj.weight.copy_(ours.o_proj.dequantized())
            gate, up = ours.gate_up_proj.dequantized().chunk(2)
            mlp.gate_proj.weight.copy_(gate)
            mlp.up_proj.weight.copy_(up)
            mlp.down_proj.weight.copy_(ours.down_proj.dequantized())
            if ours.experts is not None:
                gate_up, down = ours.experts.dequantized()
                theirs.experts.gate_up_proj.copy_(gate_up)
                theirs.experts.down_proj.copy_(down)
    return hf


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fp8_logits_match_transformers_on_ridges_weights(built, name):
    model, path, ids = built(name)
    lm = load_model(path, device="cpu", weights="fp8", recipe="channel", use_cache=False, show_progress=False)
    hf = _with_ridge_weights(model, lm)
    assert any(not torch.equal(a, b) for a, b in zip(hf.parameters(), model.parameters())), "weights not quantized"
    assert_match(prompt_logits(lm.model, ids), _exact_logits(hf, ids))


def test_fp8_greedy_through_engine(built):
    model, path, ids = built("ple-kv-shared-window16")
    lm = load_model(path, device="cpu", weights="fp8", recipe="channel", use_cache=False, show_progress=False)
    check_greedy_through_engine(lm, _with_ridge_weights(model, lm), ids, 16)


def test_calibrated_recipes_are_refused_by_name(built):
    """The calibrated FP8 recipes run each layer on its own (fp8_stream.walk), without the
    per-layer inputs or the source layers' K and V."""
    _, path, _ = built("ple-kv-shared-window16")
    with pytest.raises(Exception, match="fp8-recipe channel"):
        load_model(path, device="cpu", weights="fp8", recipe="g16+act", use_cache=False, show_progress=False)


# -- the config rule ----------------------------------------------------------------------------------
def test_every_field_of_transformers_config_is_declared():
    fam = REGISTRY["gemma4_text"].hf
    fields = {f.name: f.default for f in dataclasses.fields(Gemma4TextConfig)}
    undeclared = sorted(set(fields) - fam.fields - fam.ignored - BASE_IGNORED)
    assert not undeclared, f"fields neither read nor ignored: {undeclared}"
    wrong = {k: (v, fields[k]) for k, v in fam.defaults.items() if k in fields and fields[k] != v}
    assert not wrong, f"defaults differ from transformers' (ours, theirs): {wrong}"


def _config(tmp_path, **fields):
    d = tmp_path / "gemma4"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "gemma4_text", **BASE, **_fields(fields)}))
    return read_hf_config(d)


def test_fields_are_honoured(tmp_path):
    cfg = _config(tmp_path, num_hidden_layers=4, num_kv_shared_layers=2, sliding_window=16,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
    assert cfg.layer_types[-1] == "full_attention"  # forced, as transformers forces it
    assert cfg.extra["kv_source"] == [None, None, 0, 1]
    assert cfg.softmax_scale == 1.0 and cfg.qk_norm
    assert cfg.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 1.0}
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_local_scaling) == (1_000_000.0, 10_000.0, None)
    assert (cfg.global_head_dim, cfg.global_kv_heads) == (None, None)  # as wide as the sliding layers'
    # as the Hub's files say it: global_head_dim, and KV heads of their own with keys as values
    cfg = _config(tmp_path, global_head_dim=64, attention_k_eq_v=True, num_global_key_value_heads=1)
    assert (cfg.global_head_dim, cfg.global_kv_heads, cfg.layer_kv_shape(0), cfg.layer_kv_shape(1)) == \
        (64, 1, (2, 16), (1, 64))
    cfg = _config(tmp_path, global_head_dim=64, num_global_key_value_heads=1)  # read only with keys as values
    assert (cfg.global_head_dim, cfg.global_kv_heads) == (64, None)


LAYERS3 = ["full_attention", "sliding_attention", "full_attention"]
REFUSED = [  # (fields, what the message names)
    (dict(enable_moe_block=True), "num_experts=None"),
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=5, moe_intermediate_size=8), "top_k_experts=5"),
    (dict(enable_moe_block="yes"), "enable_moe_block='yes'"),
    (dict(global_head_dim=15), "global_head_dim=15"),
    (dict(per_layer_config={"0": {"head_dim": 32}}), "per_layer_config="),  # layer 0 slides
    (dict(attention_k_eq_v=True, num_global_key_value_heads=3), "num_global_key_value_heads=3"),
    (dict(num_kv_shared_layers=2), "num_kv_shared_layers=2"),  # every layer: none computes K and V
    (dict(num_hidden_layers=3, layer_types=LAYERS3, num_kv_shared_layers=2), "num_kv_shared_layers=2"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    (dict(hidden_activation="silu"), "hidden_activation='silu'"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0}}),
     "rope_parameters.full_attention.rope_type='yarn'"),
    (dict(rope_parameters={**ROPES["all-turning"], "global": {}}), "rope_parameters="),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0},
                           "full_attention": {"rope_type": "default"}}), "rope_parameters.sliding_attention.factor"),
    (dict(rope_theta=10000.0), "rope_theta=10000.0"),
    (dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=V - 1), f"vocab_size_per_layer_input={V - 1}"),
    (dict(sliding_window=None), "sliding_window=None"),
    (dict(final_logit_softcapping=-1.0), "final_logit_softcapping=-1.0"),
]


@pytest.mark.parametrize("fields,named", REFUSED, ids=[n.split("=")[0].split(":")[0] for _, n in REFUSED])
def test_values_ridge_cannot_run_are_refused_by_name(tmp_path, fields, named):
    with pytest.raises(ModelLoadError, match=re.escape(named)):
        _config(tmp_path, **fields)


# -- the multimodal checkpoints, served as text ----------------------------------------------------------
PLACEHOLDER_IDS = dict(image_token_id=250, video_token_id=251, audio_token_id=252)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """Gemma4ForConditionalGeneration with a vision tower (skipped by ridge) over the PLE and
    KV-shared text model; its prompt holds the three placeholders, which its text path embeds as
    the pad token."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = transformers.AutoConfig.for_model("gemma4_text", **{**BASE, **_fields(VARIANTS["ple-kv-shared-window16"])})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    config = Gemma4Config(text_config=text.to_dict(), vision_config=vision, **PLACEHOLDER_IDS)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).eval()
    draw_text_model(model)
    path = tmp_path_factory.mktemp("gemma4") / "gemma4"
    model.save_pretrained(path)
    from tiny_models import write_tokenizer_files
    write_tokenizer_files(path)
    ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
    ids[10], ids[40], ids[70] = 250, 251, 252
    return model, path, ids


class _Wrapped:
    """_draw's view of the multimodal model (its text model under .model)."""

    def __init__(self, model):
        self.model = model.model.language_model


@torch.no_grad()
def draw_text_model(model) -> None:
    """A multimodal model's text norms near 1 and _draw's scalars."""
    for name, p in model.model.language_model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn_like(p))
    _draw(_Wrapped(model))


def test_multimodal_checkpoint_served_as_text(multimodal):
    model, path, ids = multimodal
    assert (path / "config.json").exists() and json.loads((path / "config.json").read_text())["model_type"] == "gemma4"
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    assert lm.config.arch == "gemma4_text" and lm.config.extra["placeholders"] == [250, 251, 252]
    assert_match(prompt_logits(lm.model, ids), _exact_logits(model, ids))


def test_multimodal_placeholders_are_read_as_ids(tmp_path):
    d = tmp_path / "mm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gemma4", "image_token_id": 10 ** 6,
                                               "text_config": {"model_type": "gemma4_text", **BASE, **_fields({})}}))
    with pytest.raises(ModelLoadError, match="image_token_id=1000000"):
        read_hf_config(d)


def test_every_field_of_the_multimodal_config_is_declared():
    from transformers import Gemma4Config

    from ridge.models.gemma4.config import WRAPPER_DEFAULTS, WRAPPER_IGNORED, WRAPPER_READ

    fields = {f.name: f.default for f in dataclasses.fields(Gemma4Config)}
    assert not set(fields) - WRAPPER_READ - WRAPPER_IGNORED - BASE_IGNORED
    assert {k: fields[k] for k in WRAPPER_DEFAULTS} == WRAPPER_DEFAULTS


def test_kv_blocks_take_each_layers_shape(tmp_path):
    """The full layers' blocks are wider, with their own KV heads; the bytes a token takes count
    each layer's shape (FP8: its scales too)."""
    from ridge.cache.kv_cache import KVCache
    from ridge.config import layers_kv_bytes_per_token

    cfg = _config(tmp_path, num_hidden_layers=3, sliding_window=16, global_head_dim=64, attention_k_eq_v=True,
                  num_global_key_value_heads=1)
    cache = KVCache(cfg, [3, 5], 16, "fp8")
    assert [tuple(kv.k.shape) for kv in cache.layers] == [(5, 16, 2, 16), (5, 16, 2, 16), (3, 16, 1, 64)]
    assert cache.bytes_per_token == 2 * (2 * 2 * (16 + 2) + 1 * (64 + 2))
    assert cache.total_bytes == 16 * (3 * 2 * (64 + 2) + 5 * 2 * 2 * 2 * (16 + 2))
    assert layers_kv_bytes_per_token(cfg, "fp32", [2]) == 2 * 64 * 4


def test_plan_counts_the_moe_variants_parameters(built):
    """ridge plan's parameter count (norms, biases and per-channel scalars left out) equals the
    transformers model's: the dense MLP beside the experts counted on every layer."""
    model, path, _ = built("moe-window16")
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    scalars = ("norm", "layer_scalar", "router.scale", "per_expert_scale")
    want = sum(p.numel() for n, p in model.named_parameters() if not any(k in n for k in scalars))
    assert lm.config.shape().num_params == want
