"""Ministral 3 from GGUF (issue 41): a tiny random Ministral 3 built by transformers 5.25, written
as llama.cpp's converter writes it (conversion/mistral3.py Mistral3Model.Ministral3Model over
LlamaModel: architecture mistral3, YaRN under rope.scaling.*, mscale_all_dim as
yarn_log_multiplier, llama_4_scaling_beta as attention.temperature_scale, q and k permuted), then
loaded through ridge's real loader and compared with transformers:

- teacher-forced fp32 logits (relative error <= 1e-5, top-1 1.000) over 96 positions, two
  periods of the query scale, with YaRN's betas off their defaults and mscale_all_dim 1, and
  with mscale_all_dim 0 (the log multiplier written as 0) and untied embeddings;
- greedy tokens through the engine equal transformers' (two requests, a prefix hit, chunks of 7);
- metadata ridge cannot honour refused by name."""
from __future__ import annotations

import pytest
import torch

from ridge.models.oneshot import prompt_logits
from ridge.quant.errors import ModelLoadError
from test_families import N, V, assert_match, build_hf, check_greedy_through_engine, hf_logits
from tiny_models import permute_qk

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from test_gguf_2026 import _close, _load, _put, _tokenizer  # noqa: E402

ARCH = "mistral3"
# a low base and a long original context, so that YaRN's ramp spans dims that both betas move
ROPE = {"rope_type": "yarn", "rope_theta": 10.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 4.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3,
        "max_position_embeddings": 256}
VARIANTS = {
    "yarn-betas-temperature": dict(sliding_window=None, rope_parameters=ROPE),
    "log-mul-0-untied": dict(sliding_window=None, tie_word_embeddings=False,
                             rope_parameters={**ROPE, "mscale_all_dim": 0.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                              "llama_4_scaling_beta": 0.1}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (transformers model, token ids), built once."""
    cache = {}

    def get(name):
        if name not in cache:
            model, _ = build_hf(tmp_path_factory.mktemp(name), "ministral3", VARIANTS[name])
            ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
            cache[name] = model, ids
        return cache[name]
    return get


def write_mistral3_gguf(path, model, meta: dict | None = None):
    """What Ministral3Model writes: TextModel's keys (YaRN's from rope_parameters), LlamaModel's
    (vocab size, rotary dims; q and k permuted), its own two; meta: {arch}.* values that replace
    or add to the converter's."""
    c = model.config
    rope, n = c.rope_parameters, c.num_hidden_layers
    w = gguf.GGUFWriter(str(path), ARCH)
    for add, value in ((w.add_block_count, n), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads)):
        add(value)
    assert rope["rope_type"] == "yarn"  # the converter asserts it for ministral3
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if (attention_factor := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
        w.add_rope_scaling_yarn_attn_factor(attention_factor)
    for add, key in ((w.add_rope_scaling_yarn_beta_fast, "beta_fast"),
                     (w.add_rope_scaling_yarn_beta_slow, "beta_slow")):
        if rope.get(key) is not None:
            add(rope[key])
    for add, value in ((w.add_rope_freq_base, rope["rope_theta"]), (w.add_layer_norm_rms_eps, c.rms_norm_eps),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_file_type, gguf.LlamaFileType.ALL_F32), (w.add_vocab_size, c.vocab_size),
                       (w.add_rope_dimension_count, c.head_dim),
                       (w.add_rope_scaling_yarn_log_mul, rope["mscale_all_dim"]),
                       (w.add_attn_temperature_scale, rope["llama_4_scaling_beta"])):
        add(value)
    _put(w, ARCH, meta)
    _tokenizer(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MISTRAL3, n)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().float()
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute_qk(t, c.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute_qk(t, c.num_key_value_heads)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, t.contiguous().numpy())
    return _close(w, path)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gguf_logits_match_transformers(built, tmp_path, name):
    model, ids = built(name)
    lm = _load(write_mistral3_gguf(tmp_path / f"{name}.gguf", model))
    rope, cfg = model.config.rope_parameters, lm.config
    assert cfg.arch == "ministral3" and cfg.sliding_window is None
    period = rope["original_max_position_embeddings"]
    assert cfg.query_scale == pytest.approx(dict(beta=rope["llama_4_scaling_beta"], period=period))
    assert cfg.rope_scaling["beta_fast"] == rope["beta_fast"] and cfg.rope_scaling["beta_slow"] == rope["beta_slow"]
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def test_gguf_greedy_through_the_engine(built, tmp_path):
    model, ids = built("yarn-betas-temperature")
    check_greedy_through_engine(_load(write_mistral3_gguf(tmp_path / "m.gguf", model)), model, ids, 7)


# metadata ridge cannot honour -> the name its refusal gives
REFUSALS = [({"rope.scaling.yarn_attn_factor": 1.5}, "mistral3.rope.scaling.yarn_attn_factor"),
            ({"attention.sliding_window": 16}, "mistral3.attention.sliding_window"),
            ({"rope.scaling.original_context_length": 0}, "mistral3.rope.scaling.original_context_length=0")]


@pytest.mark.parametrize("meta,named", REFUSALS, ids=[n.split(".", 1)[1] for _, n in REFUSALS])
def test_gguf_values_ridge_cannot_honour_are_refused_by_name(built, tmp_path, meta, named):
    model, _ = built("yarn-betas-temperature")
    with pytest.raises(ModelLoadError, match=named.replace(".", r"\.")):
        _load(write_mistral3_gguf(tmp_path / "refused.gguf", model, meta=meta))
