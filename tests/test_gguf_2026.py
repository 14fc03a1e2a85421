"""GGUF for this year's hybrid and new families (issue 41): each file written as llama.cpp's
convert_hf_to_gguf.py writes that architecture (the `gguf` package's GGUFWriter and tensor name
map, and every transformation the converter's class makes), from a tiny random model built by
transformers 5.25 (from its saved safetensors where the converter reads old names), then loaded
through ridge's real loader and compared with transformers.

- teacher-forced fp32 logits (relative error <= 1e-5, top-1 1.000) from the files of qwen35
  (value heads tiled, an MTP block appended and dropped, ssm_a as -exp(A_log), norms as 1 + w),
  qwen35moe, qwen3next (in_proj_qkvz split, in_proj_ba kept), gemma4 (every variant of
  tests/test_gemma4.py: per-layer inputs, KV sharing, k_eq_v, double-wide MLP, experts; the
  proportional RoPE as rope_freqs), granitehybrid (q and k permuted, Mamba2 tensors reshaped,
  experts split) and nemotron_h (one sublayer a block);
- a metadata value ridge cannot honour refused by name, one per architecture, and a file without
  an attention layer;
- greedy tokens through the engine from each architecture's file equal transformers' greedy
  (odd chunks, more requests than slots);
- `ridge plan` reads the shape from each architecture's file."""
from __future__ import annotations

import re

import pytest
import torch

from engine_utils import assert_no_leak, make_engine, odd_prompts, run_named
from hybrid_checks import built_variants
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.quant.errors import ModelLoadError
from test_families import assert_match, hf_greedy, hf_logits
from tiny_models import CHATML, tiny_vocab

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from test_qwen3_5 import VARIANTS as QWEN3_5, _centred_norms  # noqa: E402
from test_qwen3_5_moe import VARIANTS as QWEN3_5_MOE  # noqa: E402
from test_qwen3_next import SEED, centred_norms_and_decisive_routers  # noqa: E402
from test_qwen3_next import VARIANTS as QWEN3_NEXT  # noqa: E402

# model_type -> (llama.cpp's architecture, its MODEL_ARCH, the variants, their edit, seed)
FAMILIES = {
    "qwen3_5_text": ("qwen35", gguf.MODEL_ARCH.QWEN35, QWEN3_5, _centred_norms, 0),
    "qwen3_5_moe_text": ("qwen35moe", gguf.MODEL_ARCH.QWEN35MOE, QWEN3_5_MOE, centred_norms_and_decisive_routers, SEED),
    # Only the default: llama.cpp's qwen3next has no dense layer (mlp_only_layers, decoder_sparse_step)
    # and always renormalises the top k (norm_topk_prob false), so no converter writes the other.
    "qwen3_next": ("qwen3next", gguf.MODEL_ARCH.QWEN3NEXT, {"qwen3_next-default-pattern": QWEN3_NEXT[
        "qwen3_next-default-pattern"]}, centred_norms_and_decisive_routers, SEED),
}
CASES = [(mt, name) for mt, f in FAMILIES.items() for name in f[2]]
QWEN35_DEFAULT_MROPE_SECTION = [11, 11, 10, 0]  # _Qwen35MRopeMixin's, written where the config has none


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    families = {mt: built_variants(tmp_path_factory, mt, f[2], f[3], f[4]) for mt, f in FAMILIES.items()}
    return lambda mt, name: families[mt](name)


# -- the converter ------------------------------------------------------------------------------
def _tiled(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head -> tiled."""
    shape = t.shape
    return t.reshape(*shape[:dim], hk, r, d, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def _reorder_v(name: str, t: torch.Tensor, c) -> torch.Tensor:
    """What _LinearAttentionVReorderBase.modify_tensors does to a linear layer's tensor."""
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r, qk = hv // hk, 2 * hk * dk
    if hk == hv or "linear_attn." not in name:
        return t
    if ".in_proj_qkv." in name or ".conv1d" in name:
        t = t.squeeze() if ".conv1d" in name else t
        return torch.cat([t[:qk], _tiled(t[qk:], 0, hk, r, dv)])
    if ".in_proj_z." in name:
        return _tiled(t, 0, hk, r, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_bias" in name:
        return _tiled(t, 0, hk, r, 1)
    if ".out_proj." in name:
        return _tiled(t, 1, hk, r, dv)
    return t


def _qwen3next_tensor(name: str, t: torch.Tensor, c):
    """Qwen3NextModel.modify_tensors: A_log -> -exp(A_log), dt_bias renamed dt_proj.bias, the taps
    squeezed, the norms (not the gated one) + 1, in_proj_qkvz split into attn_qkv and attn_gate."""
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name[:-len("dt_bias")] + "dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    if "in_proj_qkvz.weight" in name:
        hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
        r = c.linear_num_value_heads // hk
        parts = t.permute(1, 0).reshape(c.hidden_size, hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        q, k, v, z = (p.reshape(c.hidden_size, -1) for p in parts)
        base = name[:-len("in_proj_qkvz.weight")]
        return [(base + "in_proj_qkv.weight", torch.cat([q, k, v], -1).T.contiguous()),
                (base + "in_proj_z.weight", z.T.contiguous())]
    return [(name, t)]


def _experts(name: str, t: torch.Tensor):
    """Qwen2MoeModel.modify_tensors: the stacked gate_up_proj split into gate and up."""
    if name.endswith("mlp.experts.down_proj"):
        return [(name + ".weight", t)]
    if name.endswith("mlp.experts.gate_up_proj"):
        gate, up = t.chunk(2, dim=-2)
        base = name[:-len("gate_up_proj")]
        return [(base + "gate_proj.weight", gate), (base + "up_proj.weight", up)]
    return [(name, t)]


def write_gguf(path, model, model_type: str, *, mtp: bool = True, meta: dict | None = None):
    """What the converter's class for model_type writes; mtp: one multi-token-prediction block
    after the trunk (nextn_predict_layers 1, as a Hub checkpoint's); meta: {arch}.* values that
    replace or add to the converter's."""
    arch, model_arch, *_ = FAMILIES[model_type]
    c = model.config
    n, moe = c.num_hidden_layers, model_type != "qwen3_5_text"
    rope = c.rope_parameters
    blocks = n + int(mtp)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(blocks)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    if getattr(c, "intermediate_size", None) is not None:
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0] * 4)[:4])
    elif arch != "qwen3next":
        w.add_rope_dimension_sections(QWEN35_DEFAULT_MROPE_SECTION)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if moe:
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    recurrent = [t == "linear_attention" for t in c.layer_types] + [False] * int(mtp)
    w.add_array(f"{arch}.attention.recurrent_layers", recurrent)  # add_recurrent_layers, newer than gguf 0.19
    w.add_full_attention_interval(getattr(c, "full_attention_interval", None) or 4)
    w.add_rope_dimension_count(int(c.head_dim * rope.get("partial_rotary_factor", 0.25)))
    _put(w, arch, meta)
    _tokenizer(w)
    names = gguf.get_tensor_name_map(model_arch, blocks)
    written = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().float()
        if arch != "qwen3next":
            t = _reorder_v(name, t, c)
        for hf, u in (x for part in _qwen3next_tensor(name, t, c) for x in _experts(*part)):
            gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert gname is not None, hf
            written[gname] = u.contiguous()
    if mtp:  # an attention block and the nextn tensors, which ridge does not run
        first = c.layer_types.index("full_attention")
        g = torch.Generator().manual_seed(3)
        for gname, t in list(written.items()):
            if gname.startswith(f"blk.{first}."):
                written[f"blk.{n}." + gname.split(".", 2)[2]] = torch.randn(t.shape, generator=g)
        for rest, shape in (("nextn.eh_proj.weight", (c.hidden_size, 2 * c.hidden_size)),
                            ("nextn.enorm.weight", (c.hidden_size,)), ("nextn.hnorm.weight", (c.hidden_size,)),
                            ("nextn.shared_head_norm.weight", (c.hidden_size,))):
            written[f"blk.{n}.{rest}"] = torch.randn(shape, generator=g)
    for gname, t in written.items():
        w.add_tensor(gname, t.numpy())
    return _close(w, path)


def _tokenizer(w) -> None:
    """The tiny byte-level vocabulary, as the converter's _set_vocab_gpt2 writes one, and ChatML."""
    tokens, types, merges = tiny_vocab()
    for add, value in ((w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "default"), (w.add_token_list, tokens),
                       (w.add_token_types, types), (w.add_token_merges, merges), (w.add_bos_token_id, 1),
                       (w.add_eos_token_id, 2), (w.add_chat_template, CHATML)):
        add(value)


def _close(w, path):
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return path


def _put(w, arch: str, meta: dict | None) -> None:
    """{arch}.* values that replace or add to the converter's (GGUFWriter keeps the last)."""
    for key, value in (meta or {}).items():
        add = w.add_bool if isinstance(value, bool) else w.add_uint32 if isinstance(value, int) else w.add_float32
        add(f"{arch}.{key}", value)


def _load(path):
    return load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)


# -- the tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type,name", CASES, ids=[n for _, n in CASES])
def test_gguf_logits_match_transformers(built, tmp_path, model_type, name):
    _, model, _, ids = built(model_type, name)
    lm = _load(write_gguf(tmp_path / f"{name}.gguf", model, model_type))
    c, cfg = model.config, lm.config
    assert cfg.arch == model_type and cfg.num_layers == c.num_hidden_layers
    assert cfg.linear_layers == [i for i, t in enumerate(c.layer_types) if t == "linear_attention"]
    assert cfg.linear_attention["value_head_dim"] == c.linear_value_head_dim
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


# arch -> (metadata that ridge cannot honour, the name its refusal gives)
REFUSALS = {
    "qwen3_5_text": ({"attention.sliding_window": 8}, "qwen35.attention.sliding_window"),
    "qwen3_5_moe_text": ({"ssm.inner_size": 30}, "qwen35moe.ssm.inner_size=30"),
    "qwen3_next": ({"ssm.time_step_rank": 3}, "qwen3next.ssm.time_step_rank=3"),
}


@pytest.mark.parametrize("model_type", list(REFUSALS))
def test_gguf_values_ridge_cannot_honour_are_refused_by_name(built, tmp_path, model_type):
    _, model, _, _ = built(model_type, next(iter(FAMILIES[model_type][2])))
    meta, named = REFUSALS[model_type]
    with pytest.raises(ModelLoadError, match=named.replace(".", r"\.")):
        _load(write_gguf(tmp_path / "refused.gguf", model, model_type, meta=meta))


def test_gguf_file_without_an_attention_layer_is_refused(built, tmp_path):
    _, model, _, _ = built("qwen3_5_text", "qwen3_5-default-pattern")
    path = write_gguf(tmp_path / "all-linear.gguf", model, "qwen3_5_text", mtp=False)
    reader = gguf.GGUFReader(str(path), "r+")
    flags = reader.fields["qwen35.attention.recurrent_layers"]
    for i in flags.data:
        flags.parts[i][...] = 1  # every layer recurrent
    del reader
    with pytest.raises(ModelLoadError, match="no attention layer"):
        _load(path)


# -- Gemma 4 (gemma4) ---------------------------------------------------------------------------
from test_gemma4 import VARIANTS as _GEMMA4, _draw, _exact_logits, _fields  # noqa: E402

# tests/test_gemma4.py's variants; the converter writes no proportional `factor` (llama.cpp runs
# none), so the variant with one is built without it
GEMMA4 = {name: dict(f, rope_parameters={
    t: {k: v for k, v in p.items() if k != "factor"} for t, p in f["rope_parameters"].items()})
    if "rope_parameters" in f else f for name, f in _GEMMA4.items()}


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    built = built_variants(tmp_path_factory, "gemma4_text", {n: _fields(f) for n, f in GEMMA4.items()}, _draw)
    return lambda name: (built(name)[1], built(name)[3])


def _gemma4_name(name: str) -> str:
    """Gemma4Model.filter_tensors: the scalars and the stacked experts take a .weight suffix."""
    if name.endswith(("per_dim_scale", "layer_scalar")) or (".experts." in name and not name.endswith(".weight")):
        return name + ".weight"
    return name


def write_gemma4_gguf(path, model, meta: dict | None = None):
    """What Gemma4Model (over Gemma3Model and TextModel) writes: the full layers' head width as
    key_length and the sliding layers' as key_length_swa, KV heads one a layer beside
    attention_k_eq_v, the pattern as flags, the double-wide MLP's widths one a layer, the full
    layers' proportional RoPE as the rope_freqs tensor, the norms unshifted."""
    c, layers = model.config, model.model.layers
    n, types = c.num_hidden_layers, list(c.layer_types)
    full = types.index("full_attention")
    swa = [t == "sliding_attention" for t in types]
    full_dim = layers[full].self_attn.head_dim
    swa_dim = layers[swa.index(True)].self_attn.head_dim if any(swa) else full_dim
    computing = [i for i in range(n) if getattr(layers[i].self_attn, "k_proj", None) is not None]
    heads = {types[i]: layers[i].self_attn.k_proj.out_features // layers[i].self_attn.head_dim for i in computing}
    kv = [heads[t] for t in types]
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    shared = c.num_kv_shared_layers
    if c.use_double_wide_mlp:
        w.add_feed_forward_length([c.intermediate_size * (2 if i >= n - shared else 1) for i in range(n)])
    else:
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(kv if c.attention_k_eq_v else c.num_key_value_heads)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.enable_moe_block:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(swa_dim)
    w.add_value_length_swa(swa_dim)
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(int(swa_dim * rope["sliding_attention"].get("partial_rotary_factor", 1.0)))
    _put(w, "gemma4", meta)
    _tokenizer(w)
    turning = int(full_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    freqs = torch.tensor([1.0] * turning + [1e30] * (full_dim // 2 - turning))
    w.add_tensor("rope_freqs.weight", freqs.numpy())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().float().contiguous()
        _, _, i, *_ = name.split(".", 3) + [""]
        if name.endswith("router.scale"):
            gname = f"blk.{i}.ffn_gate_inp.scale"
        elif name.endswith("router.per_expert_scale"):
            gname = f"blk.{i}.ffn_down_exps.scale"
        else:
            gname = names.get_name(_gemma4_name(name), try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, t.numpy())
    return _close(w, path)


@pytest.mark.parametrize("name", list(GEMMA4))
def test_gemma4_gguf_logits_match_transformers(gemma4, tmp_path, name):
    model, ids = gemma4(name)
    lm = _load(write_gemma4_gguf(tmp_path / "gemma4.gguf", model))
    assert lm.config.arch == "gemma4_text" and lm.config.layer_types == list(model.config.layer_types)
    assert_match(prompt_logits(lm.model, ids), _exact_logits(model, ids))


def test_gemma4_gguf_values_ridge_cannot_honour_are_refused_by_name(gemma4, tmp_path):
    model, _ = gemma4("default-pattern-no-ple")
    with pytest.raises(ModelLoadError, match=r"gemma4\.rope\.dimension_count_swa=8"):
        _load(write_gemma4_gguf(tmp_path / "gemma4.gguf", model, {"rope.dimension_count_swa": 8}))


# -- Granite 4 hybrid (granitehybrid) ------------------------------------------------------------
from test_granite_hybrid import VARIANTS as _GRANITE, _draw_mixers  # noqa: E402

# tests/test_granite_hybrid.py's variants as a GGUF can hold them: the converter marks every hybrid
# NoPE (rope.scaling.finetuned false) and writes no time_step_limit (dt unclamped)
GRANITE = {name: {**{k: v for k, v in f.items() if k != "time_step_limit"}, "position_embedding_type": "nope"}
           for name, f in _GRANITE.items()}


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return built_variants(tmp_path_factory, "granitemoehybrid", GRANITE, _draw_mixers)


def _llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: each head's rows interleaved for llama.cpp's NORM rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hybrid_tensor(name: str, t: torch.Tensor, mamba: bool, groups: int, inner: int, c) -> torch.Tensor:
    """GraniteHybridModel.modify_tensors on a layer's tensor: a Mamba2 layer's through
    Mamba2Model.modify_tensors (the taps squeezed, A as -exp(A_log) and D as [H, 1], the gated norm
    as [groups, width / groups]), any other through LlamaModel's (q and k permuted)."""
    if mamba:
        if name.endswith("conv1d.weight"):
            return t.squeeze()
        if name.endswith(".A_log"):
            return -torch.exp(t).reshape(*t.shape, 1)
        if name.endswith(".D"):
            return t.reshape(*t.shape, 1)
        return t.reshape(groups, inner // groups) if name.endswith(("mamba.norm.weight", "mixer.norm.weight")) else t
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return _llama_permute(t, c.num_attention_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return _llama_permute(t, c.num_key_value_heads)
    return t


def _writer(path, arch: str, n: int, c):
    """A GGUFWriter with the keys every converter class writes first: blocks, width, heads."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    return w


def _granite_hybrid_metadata(w, ssm: tuple, kv: list[int]) -> None:
    """GraniteHybridModel.set_gguf_parameters' own keys: the Mamba2 shape (taps, state, groups,
    width, heads), KV heads one a layer, no rope for a hybrid and so an arbitrary context."""
    for add, value in zip((w.add_ssm_conv_kernel, w.add_ssm_state_size, w.add_ssm_group_count, w.add_ssm_inner_size,
                           w.add_ssm_time_step_rank), ssm):
        add(value)
    w.add_head_count_kv(kv)
    w.add_rope_scaling_finetuned(False)
    w.add_context_length(2 ** 20)


def write_granite_gguf(path, model, checkpoint, meta: dict | None = None):
    """What GraniteHybridModel writes from the checkpoint's safetensors: head_count_kv one a layer
    (0 on the Mamba2 layers), the multipliers as scales, rope.scaling.finetuned false, the ssm.*
    shape, q and k permuted, the Mamba2 tensors reshaped (A as -exp(A_log))."""
    from safetensors.torch import load_file

    c = model.config
    n, types = c.num_hidden_layers, list(c.layer_types)
    attn = [i for i, t in enumerate(types) if t in ("attention", "full_attention")]
    experts = c.num_local_experts
    inner = c.mamba_expand * c.hidden_size
    w = _writer(path, "granitehybrid", n, c)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(experts)
    if experts:
        w.add_expert_used_count(c.num_experts_per_tok)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    for key, value in (("attention_multiplier", w.add_attention_scale), ("embedding_multiplier", w.add_embedding_scale),
                       ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
        if getattr(c, key):
            value(getattr(c, key))
    w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    _granite_hybrid_metadata(w, (c.mamba_d_conv, c.mamba_d_state, c.mamba_n_groups, inner, c.mamba_n_heads),
                             [c.num_key_value_heads if i in attn else 0 for i in range(n)])
    _put(w, "granitehybrid", meta)
    _tokenizer(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, n)
    for name, t in load_file(checkpoint / "model.safetensors").items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.float()
        i = int(name.split(".")[2]) if ".layers." in name else None
        if name.endswith(".dt_bias"):
            name = name[:-len("dt_bias")] + "dt_proj.bias"
        out = [(name, t)]
        if name.endswith("block_sparse_moe.input_linear.weight"):
            gate, up = t.split(c.intermediate_size, dim=-2)
            out = [(f"blk.{i}.ffn_gate_exps.weight", gate), (f"blk.{i}.ffn_up_exps.weight", up)]
        elif name.endswith("shared_mlp.input_linear.weight"):
            gate, up = t.split(c.shared_intermediate_size, dim=-2)
            kind = "shexp" if experts else ""
            out = [(f"blk.{i}.ffn_gate{'_' + kind if kind else ''}.weight", gate),
                   (f"blk.{i}.ffn_up{'_' + kind if kind else ''}.weight", up)]
        elif name.endswith("shared_mlp.output_linear.weight") and not experts:
            out = [(f"blk.{i}.ffn_down.weight", t)]
        else:
            out = [(name, _hybrid_tensor(name, t, i not in attn, c.mamba_n_groups, inner, c))]
        for hf, u in out:
            gname = hf if hf.startswith("blk.") else names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert gname is not None, hf
            w.add_tensor(gname, u.contiguous().numpy())
    return _close(w, path)


# -- Nemotron-H (nemotron_h) --------------------------------------------------------------------
from test_nemotron_h import VARIANTS as _NEMOTRON, _draw_mixers as _draw_nemotron  # noqa: E402

# tests/test_nemotron_h.py's variants without experts (llama.cpp writes those as nemotron_h_moe),
# less the dt clamp, which no GGUF carries
NEMOTRON = {name: {k: v for k, v in f.items() if k != "time_step_limit"}
            for name, f in _NEMOTRON.items() if "n_routed_experts" not in f}


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return built_variants(tmp_path_factory, "nemotron_h", NEMOTRON, _draw_nemotron)


def write_nemotron_gguf(path, model, checkpoint, meta: dict | None = None):
    """What NemotronHModel (non-MoE) writes over GraniteHybridModel: head_count_kv and
    feed_forward_length one a layer, key_length the heads' width, layer_norm_epsilon, the ssm.*
    shape, rope.scaling.finetuned false; q and k permuted, the Mamba2 tensors reshaped."""
    import json

    from safetensors.torch import load_file

    c = model.config
    raw = json.loads((checkpoint / "config.json").read_text())
    types = list(c.layers_block_type)
    n = len(types)
    attn = [i for i, t in enumerate(types) if t in ("attention", "full_attention")]
    mlp = [i for i, t in enumerate(types) if t == "mlp"]
    inner = c.mamba_num_heads * c.mamba_head_dim
    w = _writer(path, "nemotron_h", n, c)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    if "rms_norm_eps" in raw:
        w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    _granite_hybrid_metadata(w, (c.conv_kernel, c.ssm_state_size, c.n_groups, inner, c.mamba_num_heads),
                             [c.num_key_value_heads if i in attn else 0 for i in range(n)])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_feed_forward_length([c.intermediate_size if i in mlp else 0 for i in range(n)])
    _put(w, "nemotron_h", meta)
    _tokenizer(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NEMOTRON_H, n)
    for name, t in load_file(checkpoint / "model.safetensors").items():
        t = t.float()
        i = int(name.split(".")[2]) if ".layers." in name else None
        if name.endswith(".dt_bias"):
            name = name[:-len("dt_bias")] + "dt_proj.bias"
        if i is not None:
            t = _hybrid_tensor(name, t, types[i] in ("mamba", "linear_attention"), c.n_groups, inner, c)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, t.contiguous().numpy())
    return _close(w, path)


# Mamba2 hybrids: fixture, writer, arch, the config's layer types, metadata ridge cannot honour and
# the name its refusal gives
MAMBA2_HYBRIDS = {
    "granitehybrid": ("granite", write_granite_gguf, "granitemoehybrid", "layer_types", {"ssm.group_count": 3},
                      r"granitehybrid\.ssm\.inner_size=128, .*ssm\.group_count=3"),
    "nemotron_h": ("nemotron", write_nemotron_gguf, "nemotron_h", "layers_block_type",
                   {"rope.scaling.finetuned": True}, r"nemotron_h\.rope\.scaling\.finetuned=True"),
}
MAMBA2_CASES = [("granitehybrid", n) for n in GRANITE] + [("nemotron_h", n) for n in NEMOTRON]


@pytest.mark.parametrize("arch,name", MAMBA2_CASES, ids=[f"{a}-{n}" for a, n in MAMBA2_CASES])
def test_mamba2_hybrid_gguf_logits_match_transformers(request, tmp_path, arch, name):
    fixture, write, model_type, types_key, _, _ = MAMBA2_HYBRIDS[arch]
    _, model, checkpoint, ids = request.getfixturevalue(fixture)(name)
    lm = _load(write(tmp_path / f"{arch}.gguf", model, checkpoint))
    types = list(getattr(model.config, types_key))
    assert lm.config.arch == model_type
    assert lm.config.linear_layers == [i for i, t in enumerate(types) if t in ("mamba", "linear_attention")]
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


@pytest.mark.parametrize("arch", list(MAMBA2_HYBRIDS))
def test_mamba2_hybrid_gguf_values_ridge_cannot_honour_are_refused_by_name(request, tmp_path, arch):
    fixture, write, _, _, meta, named = MAMBA2_HYBRIDS[arch]
    built = request.getfixturevalue(fixture)
    _, model, checkpoint, _ = built(next(iter(GRANITE if arch == "granitehybrid" else NEMOTRON)))
    with pytest.raises(ModelLoadError, match=named):
        _load(write(tmp_path / f"{arch}.gguf", model, checkpoint, meta))


# -- `ridge plan` on each architecture's file -----------------------------------------------------
def _plan_files(tmp, built, gemma4, granite, nemotron):
    """-> (label, GGUF path, transformers config, its layer count) per architecture."""
    for mt, f in FAMILIES.items():
        name = next(iter(f[2]))
        _, model, _, _ = built(mt, name)
        yield f[0], write_gguf(tmp / f"{name}.gguf", model, mt), model.config
    model, _ = gemma4("default-pattern-no-ple")
    yield "gemma4", write_gemma4_gguf(tmp / "gemma4.gguf", model), model.config
    _, model, checkpoint, _ = granite("dense-nope-biases-tied")
    yield "granitehybrid", write_granite_gguf(tmp / "granite.gguf", model, checkpoint), model.config
    _, model, checkpoint, _ = nemotron("block_types-biases")
    yield "nemotron_h", write_nemotron_gguf(tmp / "nemotron.gguf", model, checkpoint), model.config


def test_ridge_plan_reads_each_gguf(built, gemma4, granite, nemotron, tmp_path, capsys):
    """The shape `ridge plan` prints: the layers, the (sliding layers') KV heads and head width."""
    from ridge.cli import main

    for arch, path, c in _plan_files(tmp_path, built, gemma4, granite, nemotron):
        assert main(["plan", str(path), "--memory-gib", "1"]) == 0, arch
        out = capsys.readouterr().out
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        layers = len(c.layers_block_type) if arch == "nemotron_h" else c.num_hidden_layers
        shape = rf"{layers} layers( \([^)]*\))?, {c.num_key_value_heads} KV heads, head_dim {head_dim},"
        assert re.search(shape, out), (arch, out)


# -- through the engine --------------------------------------------------------------------------
def _from_gguf(request, tmp, arch: str, name: str):
    """-> (transformers model, ridge's model loaded from the file written as the converter writes it, ids)."""
    if arch in FAMILIES:
        _, model, _, ids = request.getfixturevalue("built")(arch, name)
        path = write_gguf(tmp / f"{name}.gguf", model, arch)
    elif arch == "gemma4":
        model, ids = request.getfixturevalue("gemma4")(name)
        path = write_gemma4_gguf(tmp / f"{name}.gguf", model)
    else:
        fixture, write, *_ = MAMBA2_HYBRIDS[arch]
        _, model, checkpoint, ids = request.getfixturevalue(fixture)(name)
        path = write(tmp / f"{name}.gguf", model, checkpoint)
    return model, _load(path), ids


GREEDY = [("qwen3_5_text", "qwen3_5-default-pattern", 128, 1), ("qwen3_5_text", "qwen3_5-default-pattern", 7, 3),
          ("qwen3_5_moe_text", "qwen3_5_moe-default-pattern", 7, 3), ("qwen3_next", "qwen3_next-default-pattern", 7, 3),
          ("gemma4", "ple-kv-shared-window16", 16, 3), ("granitehybrid", "moe-rope-multipliers", 7, 3),
          ("nemotron_h", "pattern-clamp", 7, 3)]


@pytest.mark.parametrize("arch,name,chunk,seqs", GREEDY, ids=[f"{a}-chunk{c}-batch{s}" for a, _, c, s in GREEDY])
def test_gguf_greedy_through_the_engine(request, tmp_path, arch, name, chunk, seqs):
    """Four requests through `seqs` slots in prefill chunks of `chunk`, the engine's default
    speculation (a qwen35 file's MTP block is dropped on reading: no draft head)."""
    model, lm, ids = _from_gguf(request, tmp_path, arch, name)
    prompts = odd_prompts(ids)
    eng = make_engine(lm, prefill_chunk=chunk, max_num_seqs=seqs)
    assert run_named(eng, prompts, 8) == {k: hf_greedy(model, p, 8) for k, p in prompts.items()}
    assert_no_leak(eng)
