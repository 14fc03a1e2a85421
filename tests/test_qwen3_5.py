"""Qwen3.5 dense (qwen3_5_text), the first hybrid family, against transformers 5.25 as the oracle
(issue 41), with tests/test_families.py's method: a tiny random model built by transformers,
saved as safetensors and loaded through ridge's loader. Gated DeltaNet layers beside gated
attention layers; their states in the slot pool beside the paged KV (cache/state_cache.py).

- teacher-forced logits over 96 positions, fp32 (relative error <= 1e-5, top-1 1.000) and FP8
  against transformers run on ridge's e4m3 weights;
- greedy tokens through the engine equal transformers' greedy: in one pass and in odd chunks,
  at batch 1 and beside other requests (more requests than state slots, so slots change hands),
  under preemption (a request restarts from zeros), after an abort, and with n > 1;
- a prefix hit continues from the state checkpointed at its last block (cut back where none is
  kept); speculation (n-grams) rolls the states back on rejection; the KV tiers and self-drafting
  are refused by name for a hybrid and the engine runs without them;
- the memory plan counts the state bytes per request beside KV bytes per token;
- the config rule: every Qwen3_5TextConfig field declared, values ridge cannot run refused by name;
- the Hub's multimodal checkpoints (qwen3_5) served as their text model."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from engine_utils import assert_no_leak, greedy, make_engine, odd_prompts, run_named
from hybrid_checks import built_variants
from ridge.cache.state_cache import StateCheckpoints
from ridge.config import ModelShape, kv_bytes_per_request, kv_bytes_per_token
from ridge.engine.builder import STATE_CHECKPOINTS_PER_SEQ
from ridge.engine.hybrid import SPECULATIVE_REFUSAL, TIERS_REFUSAL
from ridge.engine.sampling_params import SamplingParams
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import REGISTRY, read_hf_config
from ridge.plan import format_plan, make_plan
from ridge.quant.errors import ModelLoadError
from ridge.quant.hf_config import BASE_IGNORED
from test_families import (BASE, N, V, _copy_mlp, _dequantized, _write_config, assert_match, build_hf, hf_greedy,
                           hf_logits)
from tiny_models import write_tokenizer_files

transformers = pytest.importorskip("transformers")

BASE_TEXT = {k: v for k, v in BASE.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
# id -> config fields. The first: transformers' defaults of the pattern (every fourth layer attends)
# and of partial rotary (a quarter of each head), value heads twice the key heads. The second: its
# own layer_types (attention first and last), biases, a tied head, one value head per key head,
# a 3-tap convolution, half of each head rotary, mrope's keys (no effect on text).
VARIANTS = {
    "qwen3_5-default-pattern": dict(num_hidden_layers=4, **LINEAR),
    "qwen3_5-layer_types-biases-tied": dict(
        num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_conv_kernel_dim=3, attention_bias=True, tie_word_embeddings=True,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
}


def _centred_norms(model) -> None:
    """Qwen3.5's norms multiply by 1 + w, initialised at w = 0 (its gated norm by w, at 1): draw w
    around 0, as checkpoints hold it (build_hf drew it around 1, which doubles every norm)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.copy_(0.1 * torch.randn_like(p))


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    return built_variants(tmp_path_factory, "qwen3_5_text", VARIANTS, _centred_norms)


@pytest.fixture(params=list(VARIANTS))
def variant(request, variants):
    return variants(request.param)


@pytest.fixture(scope="module")
def fp32_default(variants):
    name, model, path, ids = variants("qwen3_5-default-pattern")
    return model, load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False), ids


def test_fp32_logits_match_transformers(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    assert lm.config.arch == "qwen3_5_text" and lm.config.linear_layers
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def with_ridge_weights(model, lm):
    """The transformers model computing with ridge's weights (FP8: e4m3 times its scales, exact
    in fp32): in_proj split back into in_proj_qkv, _z, _b, _a; qkv_proj's [q | k | v | gate]
    back into q_proj's per-head [q | gate] rows."""
    hf = copy.deepcopy(model)
    cfg = lm.config
    with torch.no_grad():
        hf.get_input_embeddings().weight.copy_(_dequantized(lm.model.embed_tokens))
        if not cfg.tie_word_embeddings:
            hf.get_output_embeddings().weight.copy_(lm.model.lm_head.dequantized())
        for ours, theirs in zip(lm.model.layers, hf.model.layers):
            if hasattr(theirs, "linear_attn"):
                la = theirs.linear_attn
                w = ours.in_proj.dequantized()
                parts = w.split([ours.conv_dim, ours.value_dim, ours.hv, ours.hv])
                for proj, part in zip((la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a), parts):
                    proj.weight.copy_(part)
                la.out_proj.weight.copy_(ours.out_proj.dequantized())
            else:
                attn = theirs.self_attn
                q, k, v, gate = ours.qkv_proj.dequantized().split([cfg.q_size, cfg.kv_size, cfg.kv_size, cfg.q_size])
                per_head = torch.stack([q.reshape(cfg.num_heads, cfg.head_dim, -1),
                                        gate.reshape(cfg.num_heads, cfg.head_dim, -1)], dim=1)
                attn.q_proj.weight.copy_(per_head.reshape(2 * cfg.q_size, -1))
                attn.k_proj.weight.copy_(k)
                attn.v_proj.weight.copy_(v)
                attn.o_proj.weight.copy_(ours.o_proj.dequantized())
            _copy_mlp(ours, theirs.mlp, cfg)
    return hf


def test_fp8_logits_match_transformers_on_ridges_weights(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False, show_progress=False)
    first = lm.model.layers[lm.config.linear_layers[0]]
    assert first.in_proj.is_fp8 or first.in_proj.cpu is not None, "in_proj not FP8"
    hf = with_ridge_weights(model, lm)
    la = [(a, b) for a, b in zip(hf.model.layers, model.model.layers) if hasattr(a, "linear_attn")][0]
    assert not torch.equal(la[0].linear_attn.in_proj_qkv.weight, la[1].linear_attn.in_proj_qkv.weight), \
        "the linear layers' projections not quantized"
    assert_match(prompt_logits(lm.model, ids), hf_logits(hf, ids))


# -- through the engine -----------------------------------------------------------------------
@pytest.mark.parametrize("weights,chunk,seqs", [("fp32", 128, 1), ("fp32", 128, 3), ("fp32", 7, 3), ("fp8", 16, 2)],
                         ids=["one-pass-batch-1", "one-pass-batch-3", "chunks-of-7-batch-3", "fp8-chunks-of-16"])
def test_greedy_through_the_engine(variants, weights, chunk, seqs):
    """Four requests through max_num_seqs slots: with fewer slots than requests, a slot is reused
    by the next request, which must start from zeros whatever the last one left there."""
    name, model, path, ids = variants("qwen3_5-default-pattern")
    lm = load_model(path, device="cpu", weights=weights, use_cache=False, show_progress=False)
    ref = model if weights == "fp32" else with_ridge_weights(model, lm)
    prompts = odd_prompts(ids)
    eng = make_engine(lm, prefill_chunk=chunk, max_num_seqs=seqs)
    got = run_named(eng, prompts, 10)
    assert got == {k: hf_greedy(ref, p, 10) for k, p in prompts.items()}
    assert_no_leak(eng)
    assert eng.state_slots.num_free == seqs


def test_preempted_requests_restart_from_zeros(fp32_default):
    """A pool of 7 blocks for three requests of 50-70 tokens: the newest is preempted, its slot
    freed, and it recomputes its prompt and output from zeros in whatever slot it gets next."""
    model, lm, ids = fp32_default
    prompts = {"a": ids[:50], "b": ids[5:45], "d": ids[20:90]}
    eng = make_engine(lm, prefill_chunk=16, max_num_seqs=3, num_kv_blocks=7)
    got = run_named(eng, prompts, 12)
    assert eng.scheduler.num_preemptions > 0
    assert got == {k: hf_greedy(model, p, 12) for k, p in prompts.items()}
    assert_no_leak(eng)
    assert eng.state_slots.num_free == 3


def test_abort_frees_the_slot(fp32_default):
    model, lm, ids = fp32_default
    eng = make_engine(lm, prefill_chunk=16, max_num_seqs=2)
    eng.add_request("gone", ids[:60], greedy(20))
    eng.add_request("kept", ids[30:70], greedy(8))
    got = {"gone": [], "kept": [], "next": []}
    for _ in range(3):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert eng.abort_request("gone")
    assert eng.state_slots.num_free == 1
    eng.add_request("next", ids[3:33], greedy(8))  # takes the aborted request's slot
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert got["kept"] == hf_greedy(model, ids[30:70], 8) and got["next"] == hf_greedy(model, ids[3:33], 8)
    assert_no_leak(eng)
    assert eng.state_slots.num_free == 2


def test_n_samples_each_get_a_slot(fp32_default):
    model, lm, ids = fp32_default
    eng = make_engine(lm, prefill_chunk=16, max_num_seqs=4)
    eng.add_request("n3", ids[:40], SamplingParams(max_tokens=6, ignore_eos=True, n=3))
    got: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.index, []).extend(o.new_token_ids)
    want = hf_greedy(model, ids[:40], 6)
    assert got == {0: want, 1: want, 2: want}
    assert_no_leak(eng)
    assert eng.state_slots.num_free == 4


def test_kv_tiers_and_self_drafting_are_refused_by_name(fp32_default):
    model, lm, ids = fp32_default
    eng = make_engine(lm, speculative="self:1", kv_disk=True, max_num_seqs=2)
    assert TIERS_REFUSAL in eng.hybrid_refusals
    assert any(r.startswith(SPECULATIVE_REFUSAL) and "self:1" in r for r in eng.hybrid_refusals)
    assert eng.speculator is None and eng.tiers is None and eng.config.enable_prefix_caching
    got = run_named(eng, {"first": ids[:40]}, 8)
    assert got["first"] == hf_greedy(model, ids[:40], 8)
    assert_no_leak(eng)


@pytest.mark.parametrize("chunk,seqs", [(128, 1), (16, 3), (7, 2)])
def test_prefix_hit_continues_from_a_state_checkpoint(fp32_default, chunk, seqs):
    """A shared "system prompt" of 37 tokens (two whole blocks and some): the first request
    checkpoints the state at each block boundary of its prompt, the later ones hit its blocks,
    cut back to the last checkpointed one (32 tokens), and continue from that state."""
    model, lm, ids = fp32_default
    system = ids[:37]
    eng = make_engine(lm, prefill_chunk=chunk, max_num_seqs=seqs)
    assert eng.config.enable_prefix_caching and eng.state_checkpoints is not None
    first = system + ids[60:70]
    got = run_named(eng, {"first": first}, 8)
    assert len(eng.state_checkpoints) == len(first) // 16
    later = {f"user-{i}": system + ids[70 + 5 * i:80 + 5 * i] for i in range(seqs)}
    cached = {}
    for rid, p in later.items():
        eng.add_request(rid, p, greedy(8))
        got[rid] = []
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
    assert cached == {rid: 32 for rid in later}
    assert got == {rid: hf_greedy(model, p, 8) for rid, p in {"first": first, **later}.items()}
    assert_no_leak(eng)


def test_a_hit_without_a_checkpoint_is_cut_back(fp32_default):
    """Checkpoints evicted (one slot for many boundaries): the KV hit is cut back to the blocks
    whose state is still kept, or to nothing, and the tokens stay plain greedy's."""
    model, lm, ids = fp32_default
    eng = make_engine(lm, prefill_chunk=16, max_num_seqs=1)
    small = StateCheckpoints(eng.state_slots.pool_size, 1)  # the first of the engine's checkpoint slots
    eng.state_checkpoints = eng.scheduler.state_checkpoints = eng.runner.state_checkpoints = small
    prompt = ids[:70]  # four block boundaries: only the last one's checkpoint survives
    got = run_named(eng, {"first": prompt}, 4)
    assert len(eng.state_checkpoints) == 1
    eng.add_request("again", ids[:40] + ids[80:90], greedy(4))  # shares two blocks, whose checkpoints are gone
    got["again"] = []
    hit = None
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            hit = o.num_cached_tokens
    assert hit == 0 and eng.kv_cache_manager.prefix_hits == 0  # the cut hit is counted as used
    assert got == {"first": hf_greedy(model, prompt, 4), "again": hf_greedy(model, ids[:40] + ids[80:90], 4)}
    assert_no_leak(eng)


@pytest.mark.parametrize("seqs", [1, 3])
def test_ngram_speculation_rolls_states_back(fp32_default, seqs):
    """Prompt lookup drafts from repeated text; a rejected draft leaves the request's state as
    after its last accepted token (the scratch slot's copy), so the tokens are plain greedy's."""
    model, lm, ids = fp32_default
    # p, the model's own greedy continuation of p, then p again: prompt lookup drafts that
    # continuation, which the target follows for a few tokens (on this model: 8, 4 and 7 of them)
    # and then leaves, so spans are accepted whole, in part and not at all
    prompts = {}
    for start in (36, 18, 42)[:seqs]:
        p = ids[start:start + 16]
        prompts[f"from-{start}"] = p + hf_greedy(model, p, 16) + p
    eng = make_engine(lm, speculative="ngram", num_speculative_tokens=4, prefill_chunk=16, max_num_seqs=seqs)
    assert eng.speculator is not None and not [r for r in eng.hybrid_refusals if "speculative" in r]
    seen = []
    verified = eng.speculator.on_verified
    eng.speculator.on_verified = lambda req, drafted, accepted: (seen.append((drafted, accepted)),
                                                                 verified(req, drafted, accepted))
    got = run_named(eng, prompts, 24)
    assert got == {k: hf_greedy(model, p, 24) for k, p in prompts.items()}
    assert any(a < d for d, a in seen), f"no draft was rejected: {seen}"
    assert any(0 < a < d for d, a in seen), f"no span was accepted in part: {seen}"
    assert any(a == d for d, a in seen), f"no span was accepted whole: {seen}"
    assert_no_leak(eng)
    assert eng.state_slots.num_free == seqs


def test_draft_model_speculation(fp32_default, tmp_path):
    """A dense draft (a one-layer qwen3 of the same vocabulary) keeps its KV in the target's
    attention blocks; the hybrid target's states roll back on its rejected drafts."""
    model, lm, ids = fp32_default
    _, draft = build_hf(tmp_path, "qwen3", dict(num_hidden_layers=1))
    eng = make_engine(lm, speculative=f"draft:{draft}", num_speculative_tokens=3, max_num_seqs=2, prefill_chunk=16)
    assert eng.speculator is not None and eng.speculator.name == "draft:qwen3"
    prompts = {"a": ids[:30], "b": ids[40:60]}
    assert run_named(eng, prompts, 12) == {k: hf_greedy(model, p, 12) for k, p in prompts.items()}
    assert_no_leak(eng)


def test_a_hybrid_draft_model_is_refused(fp32_default, tmp_path):
    model, lm, ids = fp32_default
    _, path = build_hf(tmp_path, "qwen3_5_text", dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        layer_types=["linear_attention", "full_attention"], **LINEAR))
    with pytest.raises(ValueError, match="a hybrid model .* cannot draft"):
        make_engine(lm, speculative=f"draft:{path}")


# -- memory -------------------------------------------------------------------------------------
def test_memory_plan_counts_states_beside_kv(fp32_default):
    model, lm, ids = fp32_default
    cfg = lm.config
    la = cfg.linear_attention
    conv = (la["conv_kernel"] - 1) * (2 * la["num_key_heads"] * la["key_head_dim"]
                                      + la["num_value_heads"] * la["value_head_dim"])
    per_request = 4 * len(cfg.linear_layers) * (conv + la["num_value_heads"] * la["key_head_dim"] * la["value_head_dim"])
    assert cfg.state_bytes_per_request() == per_request
    assert cfg.num_kv_layers == 1  # only the attention layer holds KV
    assert kv_bytes_per_token(cfg, "fp32") == 2 * 1 * cfg.num_kv_heads * cfg.head_dim * 4
    plain = make_engine(lm, max_num_seqs=3, enable_prefix_caching=False)
    assert plain.memory.state_bytes == plain.kv_cache.state_bytes == 3 * per_request
    assert "state pool" in plain.memory.summary()
    # with the prefix cache, its checkpoints; with speculation, a scratch slot per draft and request
    both = make_engine(lm, max_num_seqs=3, speculative="ngram", num_speculative_tokens=2)
    slots = 3 * (1 + 2) + STATE_CHECKPOINTS_PER_SEQ * 3
    assert both.memory.state_bytes == both.kv_cache.state_bytes == slots * per_request
    shape = cfg.shape()
    assert (shape.state_layers, shape.state_bytes_per_request) == (3, per_request)
    assert kv_bytes_per_request(shape, "bf16", 1024, 16) == kv_bytes_per_token(shape, "bf16") * 1024 + per_request
    text = format_plan(make_plan(shape, memory_gib=1, context_len=1024, weights="bf16", block_size=16))
    assert "linear attention (Gated DeltaNet)" in text and "recurrent state per request" in text
    # the dense shape of the same layers keeps KV in every layer
    dense = ModelShape("dense", 4, cfg.num_kv_heads, cfg.head_dim)
    assert kv_bytes_per_token(dense, "bf16") == 4 * kv_bytes_per_token(shape, "bf16")


# -- config fidelity ----------------------------------------------------------------------------
def test_every_config_field_is_declared():
    fam = REGISTRY["qwen3_5_text"].hf
    fields = {f.name: f.default for f in dataclasses.fields(transformers.Qwen3_5TextConfig)}
    undeclared = sorted(set(fields) - fam.fields - fam.ignored - BASE_IGNORED)
    assert not undeclared, f"Qwen3_5TextConfig fields neither read nor ignored: {undeclared}"
    wrong = {k: (v, fields[k]) for k, v in fam.defaults.items() if k in fields and fields[k] != v}
    assert not wrong, f"defaults differ from transformers' (ours, theirs): {wrong}"


@pytest.mark.parametrize("field,value,named", [
    ("hidden_act", "gelu", "hidden_act"),
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"], "layer_types"),
    ("layer_types", ["linear_attention"] * 4, "layer_types"),
    ("linear_num_value_heads", 3, "linear_num_value_heads"),
    ("linear_conv_kernel_dim", 1, "linear_conv_kernel_dim"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4}, "rope_parameters.rope_type"),
])
def test_values_ridge_cannot_run_are_refused_by_name(variants, tmp_path, field, value, named):
    name, model, path, ids = variants("qwen3_5-default-pattern")
    c = json.loads((path / "config.json").read_text())
    c[field] = value
    with pytest.raises(ModelLoadError, match=named):
        read_hf_config(_write_config(tmp_path, **c))


def test_full_attention_interval_when_layer_types_is_absent(variants, tmp_path):
    name, model, path, ids = variants("qwen3_5-default-pattern")
    c = json.loads((path / "config.json").read_text())
    del c["layer_types"]
    c["full_attention_interval"] = 2
    assert read_hf_config(_write_config(tmp_path, **c)).linear_layers == [0, 2]


# -- the Hub's checkpoints: Qwen3_5ForConditionalGeneration served as text --------------------
def test_multimodal_checkpoint_served_as_text(tmp_path):
    text = {**BASE_TEXT, "num_hidden_layers": 4, **LINEAR}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"])
    config = transformers.AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    _centred_norms(model)
    path = tmp_path / "qwen3_5"
    model.save_pretrained(path)
    write_tokenizer_files(path)
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    assert lm.config.arch == "qwen3_5_text" and lm.config.linear_layers == [0, 1, 2]
    ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].float()
    assert_match(prompt_logits(lm.model, ids), ref)


def test_multimodal_refusals_name_the_text_field(tmp_path):
    d = _write_config(tmp_path, "qwen3_5", text_config={**BASE_TEXT, "model_type": "qwen3_5_text",
                                                        "tie_word_embeddings": True, **LINEAR})
    with pytest.raises(ModelLoadError, match="text_config.tie_word_embeddings"):
        read_hf_config(d)
    d = _write_config(tmp_path, "qwen3_5", text_config={**BASE_TEXT, "hidden_act": "gelu", **LINEAR})
    with pytest.raises(ModelLoadError, match="text_config.hidden_act"):
        read_hf_config(d)


def test_triton_kernels_through_the_engine(fp32_default):
    """The GPU path's kernels (Triton, under the interpreter here): the varlen convolution and
    delta rule with kept states, a prefix hit from a checkpoint and n-gram speculation."""
    from ridge.kernels import ops

    model, lm, ids = fp32_default
    system = ids[:37]
    prompts = {"a": system + ids[60:64], "b": system + ids[70:75]}
    eng = make_engine(lm, prefill_chunk=16, max_num_seqs=2, speculative="ngram", num_speculative_tokens=3)
    got, cached = {}, {}
    with ops.use_triton(True):
        for rid, p in prompts.items():  # one after the other: b hits a's blocks
            eng.add_request(rid, p, greedy(6))
            got[rid] = []
            while eng.has_unfinished():
                for o in eng.step():
                    got[o.request_id] += o.new_token_ids
                    cached[o.request_id] = o.num_cached_tokens
    assert got == {k: hf_greedy(model, p, 6) for k, p in prompts.items()}
    assert cached == {"a": 0, "b": 32}
    assert_no_leak(eng)


def test_state_checkpoints_shrink_to_half_the_caches_room(fp32_default):
    """A cache budget whose half holds the 16 requests' states and 8 checkpoints, not the 64 they
    would get: 8 checkpoints, the prefix hit still served from one, the answers transformers'."""
    model, lm, ids = fp32_default
    per = lm.config.state_bytes_per_request()
    eng = make_engine(lm, prefill_chunk=16, kv_memory_gib=2 * (16 + 8) * per / 2 ** 30, num_kv_blocks=None)
    assert eng.state_checkpoints.count == 8
    prompt = ids[:48]
    first = run_named(eng, {"a": prompt}, 6)
    again = run_named(eng, {"b": prompt}, 6)
    assert first["a"] == again["b"] == hf_greedy(model, prompt, 6)
