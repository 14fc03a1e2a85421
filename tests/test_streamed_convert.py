"""Streamed conversion (issue 39): a model is read, fused, quantized and cached one layer at a
time, and the cache is read back by memory map. Checked on tiny random models written as real
files: the streamed result is byte for byte the whole-model path's, no earlier layer's source
tensors are alive while a layer is converted, and the cached weights are the shards' mappings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ridge.models.fp8_calibrate import STREAMED, calibrate
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import REGISTRY, convert
from ridge.quant import store
from ridge.quant.fuse import fuse_hf_state_dict
from ridge.quant.source import read_source
from tiny_models import make_tiny, write_tokenizer_files

FP8 = torch.float8_e4m3fn
SPECS = ["g16", "g16+act", "channel+head", "g32+gptq", "auto"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _hf_moe(path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=269, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if name.endswith("norm.weight") else 0.15)
    model.save_pretrained(str(path))
    write_tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("streamed")
    return {"llama-hf": make_tiny(tmp, "llama", "hf", num_layers=3)[0],
            "qwen3-gguf-q8": make_tiny(tmp, "qwen3", "gguf", qtype="Q8_0", num_layers=3)[0],
            "qwen3_moe-hf-bf16": _hf_moe(tmp / "moe")}


@pytest.mark.parametrize("name,spec", [(n, s) for n in ("llama-hf", "qwen3-gguf-q8", "qwen3_moe-hf-bf16")
                                       for s in SPECS if (n, s) != ("qwen3_moe-hf-bf16", "auto")])  # the slowest
def test_streamed_equals_the_whole_model_path_and_holds_one_layer(sources, name, spec, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = sources[name]
    cfg, sd, freq, tok = read_source(path, REGISTRY, False)  # the whole-model path, as convert ran it before
    fused = fuse_hf_state_dict(sd, cfg, path, REGISTRY[cfg.arch].weights)
    recipe, hess, _ = calibrate(cfg, fused, freq, tok, spec)
    want = recipe.quantize(fused, "mse", hess)

    alive = []
    got = convert(path, recipe=spec, calibrate=calibrate, calibrate_layers=STREAMED,
                  show_progress=False, on_layer=lambda i, layers: alive.append((i, layers)))
    # While layer i is converted, no other layer's source tensor is alive (the callback sees
    # every tensor the source gave, through weak references).
    assert alive == [(i, [i]) for i in range(cfg.num_layers)]
    uncached = convert(path, recipe=spec, calibrate=calibrate, calibrate_layers=STREAMED,
                       use_cache=False, show_progress=False)
    cached = convert(path, recipe=spec, calibrate=calibrate, calibrate_layers=STREAMED,
                     show_progress=False)
    assert not got.from_cache and cached.from_cache and got.recipe["spec"] == recipe.spec
    for conv in (got, uncached, cached):
        assert set(conv.state_dict) == set(want)
        for k, v in want.items():
            assert conv.state_dict[k].dtype == v.dtype and torch.equal(_bytes(conv.state_dict[k]), _bytes(v)), k


def _mapped_files() -> list[tuple[int, int, str]]:
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[5]))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings")
def test_the_cache_is_written_a_layer_a_shard_and_read_by_memory_map(sources, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = sources["llama-hf"]
    first = convert(path, recipe="g16", show_progress=False)
    entry = store.cache_root() / first.identity
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["shards"] == first.config.num_layers + 1  # the globals, then one a layer
    second = convert(path, recipe="g16", show_progress=False)
    assert second.from_cache
    _, mapped = store.load(first.identity, copy_below=0)  # the tiny model's tensors are all below the default
    maps = _mapped_files()
    for name, t in mapped.items():
        assert any(lo <= t.data_ptr() < hi and Path(f).parent.name == first.identity for lo, hi, f in maps), name
        assert torch.equal(_bytes(t), _bytes(second.state_dict[name]))
    # Below the threshold a tensor is copied out, so that a norm the model keeps pins no mapping.
    small = second.state_dict["layers.0.input_layernorm.weight"].data_ptr()
    assert not any(lo <= small < hi and Path(f).parent.name == first.identity for lo, hi, f in maps)


def test_the_streamed_model_runs_as_the_whole_model_path_did(sources, tmp_path, monkeypatch):
    """load_model on the default CPU recipe (g16+act, streamed) against a model built from the
    whole-model path's weights: the same logits."""
    from ridge.models.fp8_calibrate import build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = sources["qwen3_moe-hf-bf16"]
    cfg, sd, freq, tok = read_source(path, REGISTRY, False)
    fused = fuse_hf_state_dict(sd, cfg, path, REGISTRY[cfg.arch].weights)
    recipe, hess, _ = calibrate(cfg, fused, freq, tok, "g16+act")
    ids = [1, 40, 71, 200, 33, 5, 90, 12]
    ref = prompt_logits(build(cfg, recipe.quantize(fused, "mse", hess), freq), ids)
    for _ in range(2):  # converted, then from the cache
        lm = load_model(path, device="cpu", recipe="g16+act", show_progress=False)
        torch.testing.assert_close(prompt_logits(lm.model, ids), ref, rtol=0, atol=0)


def test_streamed_auto_measures_what_whole_models_measure(sources):
    """auto judges its candidates, each weight's sensitivity and the bf16 keeps in walks over the
    layers (ridge/models/fp8_stream.py); each KL it records is the one a whole model built with
    that recipe's weights gives (fp8_calibrate's whole-model functions, the oracle)."""
    from ridge.models.fp8_calibrate import (SENSITIVITY_TOKENS, build, calibration_ids, choose_recipe, hessians,
                                            recipe_kl, sensitivity, split_calibration)
    from ridge.quant.recipe import Recipe, long_name

    path = sources["llama-hf"]
    cfg, sd, freq, tok = read_source(path, REGISTRY, False)
    fused = fuse_hf_state_dict(sd, cfg, path, REGISTRY[cfg.arch].weights)
    chosen, _, measured = choose_recipe(cfg, fused, freq, tok, budget=0.0, groupings=("g32", "g64"), max_bf16=3)
    tried = measured["tried"]
    assert len(tried) == 6 + 3 and len(chosen.keep) == 3  # nothing meets a zero budget: every step measured
    fit, ids = split_calibration(calibration_ids(tok, cfg))
    model = build(cfg, fused, freq)
    ref, hess = prompt_logits(model, ids), hessians(model, fit)
    for t in tried:
        r = Recipe.parse(t["recipe"])
        want = recipe_kl(cfg, fused, freq, r, ids, ref, hess if r.calibrated else None)
        assert t["kl"] == pytest.approx(want, rel=1e-4, abs=1e-9), t["recipe"]
    best = Recipe.parse(tried[-1]["recipe"]).grouping
    whole = sensitivity(model, fused, ids[:SENSITIVITY_TOKENS], best)
    assert measured["sensitivity"]
    for short, v in measured["sensitivity"].items():
        assert v == pytest.approx(whole[long_name(short)], rel=1e-4, abs=1e-9), short


@pytest.mark.parametrize("name", ["llama-hf", "qwen3-gguf-q8"])
def test_unquantized_weights_load_a_layer_at_a_time(sources, name):
    """--weights fp32 (and bf16) read the source a layer at a time as the loader places it: the
    conversion holds the globals only, and the model is the whole-state-dict path's."""
    from ridge.models.fp8_calibrate import build

    path = sources[name]
    layered = convert(path, quantize=False, use_cache=False, show_progress=False, layered=True)
    assert layered.layer is not None and not any(n.startswith("layers.") for n in layered.state_dict)
    whole = convert(path, quantize=False, use_cache=False, show_progress=False)
    assert whole.layer is None
    for i in range(whole.config.num_layers):
        got = layered.layer(i)
        want = {n: t for n, t in whole.state_dict.items() if n.startswith(f"layers.{i}.")}
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    ids = [1, 40, 71, 200, 33, 5, 90, 12]
    lm = load_model(path, device="cpu", weights="fp32", show_progress=False)
    want = prompt_logits(build(whole.config, whole.state_dict, whole.freq_factors), ids)
    torch.testing.assert_close(prompt_logits(lm.model, ids), want, rtol=0, atol=0)


def test_an_untied_moe_model_under_head_loads_its_table_in_the_layers_grouping(sources, tmp_path, monkeypatch):
    """+head on an untied mixture of experts: the table takes the dense layers' grouping (1 x 16),
    not a stacked expert's per-channel scales, converted and from the cache alike."""
    from ridge.quant.embedding import PackedEmbedding

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = sources["qwen3_moe-hf-bf16"]
    for _ in range(2):  # converted, then from the cache (where the experts' scales may come first)
        lm = load_model(path, device="cpu", recipe="g16+act+head", show_progress=False)
        if isinstance(lm.model.embed_tokens, PackedEmbedding):
            scale = lm.model.embed_tokens.weight_scale
            assert scale.dim() == 3 and scale.shape[-1] == 16, tuple(scale.shape)  # [N/16, K/16, 16]: g16
        assert torch.isfinite(prompt_logits(lm.model, [1, 40, 71, 5])).all()
