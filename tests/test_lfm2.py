"""LFM2 (lfm2), a hybrid of gated short-convolution layers and GQA attention, against
transformers 5.25 as the oracle (issue 41), with tests/test_qwen3_5.py's method: a tiny random
model built by transformers, saved as safetensors and loaded through ridge's loader. The
convolution layers' windows live in the state cache beside the paged KV (cache/state_cache.py),
which holds no delta-rule pool for them.

- teacher-forced logits over 96 positions, fp32 (relative error <= 1e-5, top-1 1.000) and FP8
  against transformers run on ridge's e4m3 weights;
- greedy tokens through the engine equal transformers' greedy: in one pass and in odd chunks, at
  batch 1 and beside other requests (more requests than slots), under preemption, after an
  abort, with n > 1, after a prefix hit (from a checkpointed window), under n-gram speculation
  (windows rolled back on rejection) and through the Triton kernels;
- a GGUF written as llama.cpp's converter writes LFM2 loads to the same logits;
- the memory plan counts the window bytes per request; the config rule: every Lfm2Config field
  read or ignored, values ridge cannot run refused by name, the old field names honoured."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from engine_utils import assert_no_leak, greedy, make_engine, odd_prompts, run_named
from hybrid_checks import built_variants
from ridge.cache.state_cache import LayerState
from ridge.config import kv_bytes_per_token
from ridge.engine.sampling_params import SamplingParams
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import REGISTRY, read_hf_config
from ridge.quant.errors import ModelLoadError
from ridge.quant.hf_config import BASE_IGNORED
from test_families import N, V, _dequantized, _write_config, assert_match, build_hf, hf_greedy, hf_logits
from tiny_models import CHATML, tiny_vocab

transformers = pytest.importorskip("transformers")

# id -> config fields. The first: attention in the second layer of four, 3 taps, a tied head, the
# MLP sized by block_auto_adjust_ff_dim (two thirds of 96, rounded up to 32). The second: the
# attention layers from full_attn_idxs (first and last), biases on the convolution and its
# projections, 4 taps, an untied head, the MLP as intermediate_size gives it, its own rope_theta.
VARIANTS = {
    "lfm2-layer_types-tied": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"],
                                  block_multiple_of=32),
    "lfm2-full_attn_idxs-bias-untied": dict(
        num_hidden_layers=4, full_attn_idxs=[0, 3], conv_bias=True, conv_L_cache=4, tie_word_embeddings=False,
        block_auto_adjust_ff_dim=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    return built_variants(tmp_path_factory, "lfm2", VARIANTS)


@pytest.fixture(params=list(VARIANTS))
def variant(request, variants):
    return variants(request.param)


@pytest.fixture(scope="module")
def fp32_default(variants):
    name, model, path, ids = variants("lfm2-layer_types-tied")
    return model, load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False), ids


def test_fp32_logits_match_transformers(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    cfg = lm.config
    want = [i for i, t in enumerate(model.config.layer_types) if t == "conv"]
    assert cfg.arch == "lfm2" and cfg.linear_layers == want
    assert cfg.intermediate_size == model.model.layers[0].feed_forward.w1.out_features
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def with_ridge_weights(model, lm):
    """The transformers model computing with ridge's weights (FP8: e4m3 times its scales, exact in
    fp32): in_proj, out_proj and the attention's projections as ridge holds them, the MLP's
    gate_up_proj split back into w1 and w3."""
    hf = copy.deepcopy(model)
    cfg = lm.config
    with torch.no_grad():
        hf.get_input_embeddings().weight.copy_(_dequantized(lm.model.embed_tokens))
        if not cfg.tie_word_embeddings:
            hf.get_output_embeddings().weight.copy_(lm.model.lm_head.dequantized())
        for ours, theirs in zip(lm.model.layers, hf.model.layers):
            if theirs.is_attention_layer:
                attn = theirs.self_attn
                for proj, w in zip((attn.q_proj, attn.k_proj, attn.v_proj),
                                   ours.qkv_proj.dequantized().split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
                    proj.weight.copy_(w)
                attn.out_proj.weight.copy_(ours.o_proj.dequantized())
            else:
                theirs.conv.in_proj.weight.copy_(ours.in_proj.dequantized())
                theirs.conv.out_proj.weight.copy_(ours.out_proj.dequantized())
            ff = theirs.feed_forward
            gate, up = ours.gate_up_proj.dequantized().chunk(2)
            ff.w1.weight.copy_(gate)
            ff.w3.weight.copy_(up)
            ff.w2.weight.copy_(ours.down_proj.dequantized())
    return hf


def test_fp8_logits_match_transformers_on_ridges_weights(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False, show_progress=False)
    first = lm.model.layers[lm.config.linear_layers[0]]
    assert first.in_proj.is_fp8 or first.in_proj.cpu is not None, "in_proj not FP8"
    hf = with_ridge_weights(model, lm)
    i = lm.config.linear_layers[0]
    for proj in ("in_proj", "out_proj"):
        assert not torch.equal(getattr(hf.model.layers[i].conv, proj).weight,
                               getattr(model.model.layers[i].conv, proj).weight), f"{proj} not quantized"
    assert_match(prompt_logits(lm.model, ids), hf_logits(hf, ids))


# -- GGUF ---------------------------------------------------------------------------------------
# transformers' names -> llama.cpp's (its tensor map for LFM2, gguf.constants MODEL_TENSORS)
GGUF_LAYER = {"operator_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
              "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
              "feed_forward.w2.weight": "ffn_down.weight", "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.out_proj.weight": "attn_output.weight", "self_attn.q_layernorm.weight": "attn_q_norm.weight",
              "self_attn.k_layernorm.weight": "attn_k_norm.weight", "conv.in_proj.weight": "shortconv.in_proj.weight",
              "conv.out_proj.weight": "shortconv.out_proj.weight", "conv.conv.weight": "shortconv.conv.weight"}
GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.embedding_norm.weight": "token_embd_norm.weight",
               "lm_head.weight": "output.weight"}


def write_lfm2_gguf(path, model, extra: dict | None = None):
    """What convert_hf_to_gguf.py's LFM2Model writes: head_count_kv per layer (0 on the convolution
    layers), shortconv.l_cache, the MLP's adjusted width, the taps squeezed to [hidden, L], the
    final norm as token_embd_norm; extra: more {arch}.* keys."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(model.model.layers[0].feed_forward.w1.out_features)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t == "full_attention" else 0 for t in c.layer_types])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_shortconv_l_cache(c.conv_L_cache)
    for key, value in (extra or {}).items():
        w.add_uint32(f"lfm2.{key}", value)
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name in GGUF_GLOBAL:
            gname = GGUF_GLOBAL[name]
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{GGUF_LAYER[rest]}"
        t = t.float()
        if gname.endswith("shortconv.conv.weight"):
            t = t.squeeze(1)
        w.add_tensor(gname, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_logits_match_transformers(variants, tmp_path):
    name, model, path, ids = variants("lfm2-layer_types-tied")
    lm = load_model(write_lfm2_gguf(tmp_path / "lfm2.gguf", model), device="cpu", weights="fp32", use_cache=False,
                    show_progress=False)
    assert lm.config.arch == "lfm2" and lm.config.linear_layers == [0, 2, 3]
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def test_gguf_keys_ridge_does_not_honour_are_refused(variants, tmp_path):
    name, model, path, ids = variants("lfm2-layer_types-tied")
    with pytest.raises(ModelLoadError, match="lfm2.attention.sliding_window"):
        load_model(write_lfm2_gguf(tmp_path / "lfm2.gguf", model, {"attention.sliding_window": 8}), device="cpu",
                   weights="fp32", use_cache=False, show_progress=False)


# -- through the engine -----------------------------------------------------------------------
def test_the_state_cache_holds_windows_only(fp32_default):
    model, lm, ids = fp32_default
    eng = make_engine(lm, max_num_seqs=2, enable_prefix_caching=False)
    states = [st for st in eng.kv_cache.layers if isinstance(st, LayerState)]
    assert len(states) == 3 and all(st.recurrent is None for st in states)
    assert all(tuple(st.conv.shape) == (2, 2, lm.config.hidden_size) for st in states)


@pytest.mark.parametrize("name,weights,chunk,seqs", [
    ("lfm2-layer_types-tied", "fp32", 128, 1), ("lfm2-layer_types-tied", "fp32", 128, 3),
    ("lfm2-layer_types-tied", "fp32", 7, 3), ("lfm2-full_attn_idxs-bias-untied", "fp32", 5, 2),
    ("lfm2-layer_types-tied", "fp8", 16, 2)],
    ids=["one-pass-batch-1", "one-pass-batch-3", "chunks-of-7-batch-3", "bias-4-taps-chunks-of-5", "fp8-chunks-of-16"])
def test_greedy_through_the_engine(variants, name, weights, chunk, seqs):
    """Four requests through max_num_seqs slots: a reused slot starts from zeros whatever the
    last request left in its window."""
    name, model, path, ids = variants(name)
    lm = load_model(path, device="cpu", weights=weights, use_cache=False, show_progress=False)
    ref = model if weights == "fp32" else with_ridge_weights(model, lm)
    prompts = odd_prompts(ids)
    eng = make_engine(lm, prefill_chunk=chunk, max_num_seqs=seqs)
    got = run_named(eng, prompts, 10)
    assert got == {k: hf_greedy(ref, p, 10) for k, p in prompts.items()}
    assert_no_leak(eng)
    assert eng.state_slots.num_free == seqs


def test_preempted_requests_restart_from_zeros(fp32_default):
    model, lm, ids = fp32_default
    prompts = {"a": ids[:50], "b": ids[5:45], "d": ids[20:90]}
    eng = make_engine(lm, prefill_chunk=16, max_num_seqs=3, num_kv_blocks=7)
    got = run_named(eng, prompts, 12)
    assert eng.scheduler.num_preemptions > 0
    assert got == {k: hf_greedy(model, p, 12) for k, p in prompts.items()}
    assert_no_leak(eng)
    assert eng.state_slots.num_free == 3


def test_abort_and_n_samples(fp32_default):
    model, lm, ids = fp32_default
    eng = make_engine(lm, prefill_chunk=16, max_num_seqs=3)
    eng.add_request("gone", ids[:60], greedy(20))
    eng.add_request("kept", ids[30:70], greedy(8))
    got: dict = {"gone": [], "kept": []}
    for _ in range(3):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert eng.abort_request("gone")
    assert eng.state_slots.num_free == 2
    eng.add_request("n2", ids[3:33], SamplingParams(max_tokens=6, ignore_eos=True, n=2))
    samples: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == "kept":
                got["kept"] += o.new_token_ids
            else:
                samples.setdefault(o.index, []).extend(o.new_token_ids)
    want = hf_greedy(model, ids[3:33], 6)
    assert got["kept"] == hf_greedy(model, ids[30:70], 8) and samples == {0: want, 1: want}
    assert_no_leak(eng)
    assert eng.state_slots.num_free == 3


@pytest.mark.parametrize("chunk,seqs", [(128, 1), (7, 2)])
def test_prefix_hit_continues_from_a_state_checkpoint(fp32_default, chunk, seqs):
    """A shared prompt of 37 tokens: later requests hit its first two blocks (32 tokens) and
    continue from the windows checkpointed at that boundary."""
    model, lm, ids = fp32_default
    system = ids[:37]
    eng = make_engine(lm, prefill_chunk=chunk, max_num_seqs=seqs)
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


@pytest.mark.parametrize("seqs", [1, 3])
def test_ngram_speculation_rolls_states_back(fp32_default, seqs):
    """Prompt lookup drafts the model's own continuation, which it follows for a while and then
    leaves: rejected drafts roll each window back to its last accepted token."""
    model, lm, ids = fp32_default
    prompts = {}
    for start in (60, 42, 36)[:seqs]:  # from 60 this model leaves the continuation early and often
        p = ids[start:start + 16]
        prompts[f"from-{start}"] = p + hf_greedy(model, p, 16) + p
    eng = make_engine(lm, speculative="ngram", num_speculative_tokens=4, prefill_chunk=16, max_num_seqs=seqs)
    assert eng.speculator is not None
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
    """A dense draft (a one-layer qwen3 of the same vocabulary): the LFM2 target's windows roll
    back on its rejected drafts; an LFM2 draft, itself hybrid, is refused."""
    model, lm, ids = fp32_default
    _, draft = build_hf(tmp_path, "qwen3", dict(num_hidden_layers=1))
    eng = make_engine(lm, speculative=f"draft:{draft}", num_speculative_tokens=3, max_num_seqs=2, prefill_chunk=16)
    assert eng.speculator is not None and eng.speculator.name == "draft:qwen3"
    prompts = {"a": ids[:30], "b": ids[40:60]}
    assert run_named(eng, prompts, 12) == {k: hf_greedy(model, p, 12) for k, p in prompts.items()}
    assert_no_leak(eng)
    (tmp_path / "hybrid").mkdir()
    _, hybrid = build_hf(tmp_path / "hybrid", "lfm2", dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, layer_types=["conv", "full_attention"], block_multiple_of=16))
    with pytest.raises(ValueError, match="a hybrid model .* cannot draft"):
        make_engine(lm, speculative=f"draft:{hybrid}")


def test_triton_kernels_through_the_engine(fp32_default):
    """The GPU path's convolution (Triton, under the interpreter here) with kept windows, a prefix
    hit from a checkpoint and n-gram speculation."""
    from ridge.kernels import ops

    model, lm, ids = fp32_default
    system = ids[:37]
    prompts = {"a": system + ids[60:64], "b": system + ids[70:75]}
    eng = make_engine(lm, prefill_chunk=16, max_num_seqs=2, speculative="ngram", num_speculative_tokens=3)
    got, cached = {}, {}
    with ops.use_triton(True):
        for rid, p in prompts.items():
            eng.add_request(rid, p, greedy(6))
            got[rid] = []
            while eng.has_unfinished():
                for o in eng.step():
                    got[o.request_id] += o.new_token_ids
                    cached[o.request_id] = o.num_cached_tokens
    assert got == {k: hf_greedy(model, p, 6) for k, p in prompts.items()}
    assert cached == {"a": 0, "b": 32}
    assert_no_leak(eng)


# -- memory -------------------------------------------------------------------------------------
def test_memory_plan_counts_windows_beside_kv(fp32_default):
    model, lm, ids = fp32_default
    cfg = lm.config
    per_request = 4 * 3 * (3 - 1) * cfg.hidden_size  # three conv layers, a window of K - 1 inputs each
    assert cfg.state_bytes_per_request() == per_request
    assert cfg.num_kv_layers == 1
    assert kv_bytes_per_token(cfg, "fp32") == 2 * cfg.num_kv_heads * cfg.head_dim * 4
    plain = make_engine(lm, max_num_seqs=3, enable_prefix_caching=False)
    assert plain.memory.state_bytes == plain.kv_cache.state_bytes == 3 * per_request
    shape = cfg.shape()
    assert (shape.state_layers, shape.state_bytes_per_request) == (3, per_request)


# -- config fidelity ----------------------------------------------------------------------------
def test_every_config_field_is_declared():
    fam = REGISTRY["lfm2"].hf
    fields = {f.name: f.default for f in dataclasses.fields(transformers.Lfm2Config)}
    undeclared = sorted(set(fields) - fam.fields - fam.ignored - BASE_IGNORED)
    assert not undeclared, f"Lfm2Config fields neither read nor ignored: {undeclared}"
    wrong = {k: (v, fields[k]) for k, v in fam.defaults.items() if k in fields and fields[k] != v}
    assert not wrong, f"defaults differ from transformers' (ours, theirs): {wrong}"


@pytest.mark.parametrize("field,value,named", [
    ("layer_types", ["conv", "sliding_attention", "conv", "full_attention"], "layer_types"),
    ("layer_types", ["conv"] * 4, "layer_types"),
    ("conv_L_cache", 1, "conv_L_cache"),
    ("conv_bias", "yes", "conv_bias"),
    ("norm_eps", "small", "norm_eps"),
    ("block_multiple_of", 0, "block_multiple_of"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4}, "rope_parameters.rope_type"),
])
def test_values_ridge_cannot_run_are_refused_by_name(variants, tmp_path, field, value, named):
    name, model, path, ids = variants("lfm2-layer_types-tied")
    c = json.loads((path / "config.json").read_text())
    c[field] = value
    with pytest.raises(ModelLoadError, match=named):
        read_hf_config(_write_config(tmp_path, **c))


def test_old_field_names_and_full_attn_idxs(variants, tmp_path):
    """LiquidAI's checkpoints write block_ff_dim, tie_embedding and full_attn_idxs without
    layer_types; Lfm2Config reads them, and so does ridge, as transformers does."""
    name, model, path, ids = variants("lfm2-layer_types-tied")
    c = json.loads((path / "config.json").read_text())
    for k in ("layer_types", "intermediate_size", "tie_word_embeddings"):
        c.pop(k, None)
    c.update(full_attn_idxs=[1, 3], block_ff_dim=192, tie_embedding=False, hidden_act="gelu")
    d = _write_config(tmp_path, **c)
    cfg = read_hf_config(d)
    ref = transformers.Lfm2Config(**{k: v for k, v in c.items() if k != "model_type"})
    mlp = transformers.models.lfm2.modeling_lfm2.Lfm2MLP(ref)
    assert cfg.linear_layers == [0, 2] and ref.layer_types == ["conv", "full_attention", "conv", "full_attention"]
    assert cfg.intermediate_size == mlp.w1.out_features == 128
    assert cfg.tie_word_embeddings is False and ref.tie_word_embeddings is False
    assert cfg.hidden_act == "silu" and cfg.rms_norm_eps == ref.norm_eps
