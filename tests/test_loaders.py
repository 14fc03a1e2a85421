"""Loaders on tiny random models written as real GGUF files and HF directories,
checked against transformers on the same weights."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ridge.kernels import ops
from ridge.models.fp8_calibrate import calibrate
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import convert
from ridge.quant.errors import ModelLoadError
from ridge.quant.recipe import DEVICE_RECIPES
from ridge.quant.gguf_loader import unpermute_qk
from tiny_models import make_tiny, permute_qk, random_state_dict, tiny_config, write_gguf, write_hf_dir, write_tokenizer_files

PROMPT = [1, 40, 71, 200, 33, 5, 90, 12, 140, 7, 260, 3, 88, 99, 100, 101, 17, 18, 19, 44]


def hf_logits(hf_dir, ids):
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    cfg = tiny_config(arch)
    sd = random_state_dict(cfg, seed=1)
    hf = write_hf_dir(tmp / "hf", cfg, sd)
    write_tokenizer_files(hf)
    return arch, cfg, sd, hf, write_gguf(tmp / "m.gguf", cfg, sd), hf_logits(hf, PROMPT)


def test_gguf_matches_transformers(tiny):
    arch, cfg, sd, hf, gguf_path, ref = tiny
    lm = load_model(gguf_path, device="cpu", weights="fp32", use_cache=False)
    assert lm.config.arch == arch and lm.config.tie_word_embeddings == cfg.tie_word_embeddings
    torch.testing.assert_close(prompt_logits(lm.model, PROMPT), ref, atol=1e-4, rtol=1e-4)


def test_hf_dir_matches_transformers(tiny):
    arch, cfg, sd, hf, gguf_path, ref = tiny
    lm = load_model(hf, device="cpu", weights="fp32", use_cache=False)
    torch.testing.assert_close(prompt_logits(lm.model, PROMPT), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hf_half_precision_files(tmp_path, dtype):
    cfg = tiny_config("llama")
    sd = random_state_dict(cfg, seed=2)
    d = write_hf_dir(tmp_path / "hf", cfg, sd, dtype=dtype)
    write_tokenizer_files(d)
    conv = convert(d, quantize=False, use_cache=False)
    w = conv.state_dict["layers.0.o_proj.weight"]
    torch.testing.assert_close(w.float(), sd["model.layers.0.self_attn.o_proj.weight"].to(dtype).float())


def test_qk_permutation_is_undone(tiny):
    """llama.cpp stores llama's Q/K rows permuted; loading them raw gives wrong logits."""
    arch, cfg, sd, hf, gguf_path, ref = tiny
    w = torch.randn(cfg.q_size, cfg.hidden_size)
    assert torch.equal(unpermute_qk(permute_qk(w, cfg.num_heads), cfg.num_heads), w)
    if arch != "llama":
        return
    assert not torch.equal(permute_qk(w, cfg.num_heads), w)
    conv = convert(gguf_path, quantize=False, use_cache=False)
    q_rows = cfg.q_size
    torch.testing.assert_close(conv.state_dict["layers.0.qkv_proj.weight"][:q_rows],
                               sd["model.layers.0.self_attn.q_proj.weight"])


def test_tied_embeddings_share_the_table(tmp_path):
    path, cfg, sd = make_tiny(tmp_path, "llama")
    assert cfg.tie_word_embeddings
    lm = load_model(path, device="cpu", use_cache=False)
    assert lm.model.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
    # The head's logits are the hidden state against the embedding rows: on a CPU with ridge's
    # products those rows are the table's int8 codes (quant/embedding.py), within half a step
    # of the source's.
    h = torch.randn(3, cfg.hidden_size)
    source = sd["model.embed_tokens.weight"].float()
    emb = lm.model.embed_tokens
    table = emb.dequantized() if hasattr(emb, "dequantized") else emb.weight.float()
    assert (table - source).abs().max() <= source.abs().max() / 254 * 1.01
    torch.testing.assert_close(lm.model.compute_logits(h), h @ table.T, atol=1e-4, rtol=1e-4)


def test_untied_head_is_its_own_weight(tmp_path):
    path, cfg, sd = make_tiny(tmp_path, "qwen2")
    assert not cfg.tie_word_embeddings
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    torch.testing.assert_close(lm.model.lm_head.weight, sd["lm_head.weight"])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_gguf_quant_types_dequantize_like_gguf(tmp_path, qtype):
    import gguf
    from gguf.quants import dequantize, quantize

    cfg = tiny_config("qwen3", hidden_size=64, intermediate_size=64)
    sd = random_state_dict(cfg, seed=3)
    path = write_gguf(tmp_path / "q.gguf", cfg, sd, qtype=qtype)
    conv = convert(path, quantize=False, use_cache=False)
    qt = gguf.GGMLQuantizationType[qtype]
    want = dequantize(quantize(sd["model.layers.1.mlp.down_proj.weight"].numpy(), qt), qt)
    assert np.array_equal(conv.state_dict["layers.1.down_proj.weight"].numpy(), want)


def _k_quant_bytes(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random but valid Q4_K / Q6_K blocks (gguf-py can read these but not write them)."""
    rng = np.random.default_rng(seed)
    block, size = {"Q4_K": (256, 144), "Q6_K": (256, 210)}[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = np.full((rows, cols // block), 0.01, dtype=np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    if qtype == "Q4_K":
        raw[..., 0:2] = d  # d
        raw[..., 2:4] = d  # dmin
    else:
        raw[..., 208:210] = d
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants(tmp_path, qtype):
    import gguf
    from gguf.quants import dequantize

    cfg = tiny_config("llama", hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=64)
    sd = random_state_dict(cfg, seed=4)
    qt = gguf.GGMLQuantizationType[qtype]
    raw = _k_quant_bytes(qtype, cfg.intermediate_size, cfg.hidden_size, 5)
    path = write_gguf(tmp_path / "k.gguf", cfg, sd, raw={"blk.0.ffn_gate.weight": (raw, qtype)})
    conv = convert(path, quantize=False, use_cache=False)
    gate = conv.state_dict["layers.0.gate_up_proj.weight"][: cfg.intermediate_size]
    assert np.array_equal(gate.numpy(), dequantize(raw, qt))


@pytest.mark.parametrize("scales", ["tensor", "channel"])
def test_fp8_checkpoint_loads_as_is(tmp_path, scales):
    cfg = tiny_config("llama")
    sd = random_state_dict(cfg, seed=6)
    d = write_hf_dir(tmp_path / "fp8", cfg, sd, fp8_scales=scales)
    write_tokenizer_files(d)
    from safetensors.torch import load_file
    on_disk = load_file(str(d / "model.safetensors"))
    conv = convert(d, use_cache=False)
    w = conv.state_dict["layers.1.o_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn
    assert torch.equal(w.view(torch.uint8), on_disk["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8))
    s = conv.state_dict["layers.1.o_proj.weight_scale"]
    assert s.shape == (cfg.hidden_size,)
    torch.testing.assert_close(s, on_disk["model.layers.1.self_attn.o_proj.weight_scale"].float().reshape(-1).expand(cfg.hidden_size))
    lm = load_model(d, device="cpu", use_cache=False)
    assert torch.isfinite(prompt_logits(lm.model, PROMPT[:8])).all()
    # +head quantizes what the checkpoint left unquantized, the head, and nothing else
    headed = convert(d, use_cache=False, recipe="channel+head")
    assert headed.recipe["spec"] == "checkpoint+head" and headed.state_dict["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert all(torch.equal(headed.state_dict[k].float(), conv.state_dict[k].float()) for k in conv.state_dict)


def test_converted_model_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, cfg, sd = make_tiny(tmp_path, "qwen3")
    first = convert(path, calibrate=calibrate)  # the default recipe on CPU, g16+act, runs the model once
    second = convert(path, calibrate=calibrate)
    assert not first.from_cache and second.from_cache
    assert first.recipe["spec"] == second.recipe["spec"] == DEVICE_RECIPES["cpu"] == "g16+act"
    assert second.config == first.config
    for k, v in first.state_dict.items():
        assert torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           second.state_dict[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else second.state_dict[k])
    assert second.tokenizer.encode("the") == first.tokenizer.encode("the")
    os.utime(path, ns=(1, 1))  # a changed source invalidates the entry
    assert not convert(path, calibrate=calibrate).from_cache
    assert convert(path, recipe="channel").recipe["spec"] == "channel"  # a recipe given is its own entry
    assert convert(path, device="cuda").recipe["spec"] == DEVICE_RECIPES["cuda"] == "channel"


def test_fp8_weights_are_per_channel_e4m3(tmp_path):
    path, cfg, sd = make_tiny(tmp_path, "llama")
    conv = convert(path, use_cache=False, recipe="channel")
    w, s = conv.state_dict["layers.0.gate_up_proj.weight"], conv.state_dict["layers.0.gate_up_proj.weight_scale"]
    assert w.dtype == torch.float8_e4m3fn and s.shape == (2 * cfg.intermediate_size,)
    ref = torch.cat([sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]])
    deq = w.float() * s[:, None]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values.
    assert ((deq - ref).abs() <= ref.abs() * 2 ** -4 + s[:, None] * 2 ** -9).all()
    assert (w.float().abs().amax(dim=1) == 448).all()
    # On CPU the runtime keeps the e4m3 bytes (packed for ridge's products; upcast once where
    # those are not built); the numbers it computes with are exactly the FP8 ones.
    lm = load_model(path, device="cpu", use_cache=False, recipe="channel")
    layer = lm.model.layers[0].gate_up_proj
    assert layer.is_fp8 == ops.resident_e4m3(torch.device("cpu"), tuple(w.shape))
    assert torch.equal(layer.dequantized(), deq)


def test_corrupt_and_truncated_gguf_name_the_file(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        convert(bad, use_cache=False)
    path, cfg, sd = make_tiny(tmp_path, "llama")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        convert(cut, use_cache=False)


def test_unsupported_architecture(tmp_path):
    cfg = tiny_config("llama")
    path = write_gguf(tmp_path / "m.gguf", cfg, random_state_dict(cfg))
    data = path.read_bytes().replace(b"llama", b"gpt2x", 1)  # general.architecture's value
    other = tmp_path / "other.gguf"
    other.write_bytes(data)
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        convert(other, use_cache=False)


def test_missing_tokenizer(tmp_path):
    cfg = tiny_config("llama")
    sd = random_state_dict(cfg)
    path = write_gguf(tmp_path / "notok.gguf", cfg, sd, tokenizer=False)
    with pytest.raises(ModelLoadError, match="notok.gguf.*tokenizer"):
        convert(path, use_cache=False)
    d = write_hf_dir(tmp_path / "hf", cfg, sd)
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        convert(d, use_cache=False)


def test_missing_path_and_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        convert(tmp_path / "nope.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        convert(tmp_path / "empty", use_cache=False)
