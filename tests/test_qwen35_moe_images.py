"""Qwen3.5-MoE with images (ridge/models/qwen3_5_moe/: the Hub's Qwen3_5MoeForConditionalGeneration,
its vision tower Qwen3.5's, ridge/models/qwen3_5/vision.py): a tiny random model built by
transformers 5.25 (a 3-block ViT with a 4 x 4 learned position table beside a 4-layer hybrid of
Gated DeltaNet and gated attention, half of each head rotary, interleaved mrope_section [2, 3, 3],
four experts, two a token, and a gated shared expert in every layer), saved as an HF directory with
Qwen2.5-VL's preprocessor and the chat template of tests/test_qwen_vl.py.

Oracles: transformers' get_image_features for the tower and merger, the model's logits and
generate (its get_rope_index gives the three positions), Qwen2VLImageProcessorPil for the pixels
and grids (hf_batch in tests/test_qwen_vl.py restates the processor's expansion)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from engine_utils import make_engine
import test_qwen_vl as QVL
from test_idefics3 import assert_close, assert_logits, png
from test_mistral3 import greedy_hf
from test_qwen_vl import (CHAT_TEMPLATE, IMAGES, MERGE, PAD, PREPROCESSOR, SPECIALS, TEXT35, VISION35, engine_greedy,
                          hf_batch, hf_pixels, image_features, load_hf, logits_with_images, ridge_inputs, run_request,
                          vocab)
from test_qwen3_next import EXPERTS
from vlm_models import write_vlm_tokenizer
from ridge.models.loader import load_model
from ridge.models.qwen3_5 import vision as Q35
from ridge.models.registry import load_vision, read_hf_config
from ridge.quant.errors import ModelLoadError
from ridge.quant.hf_config import BASE_IGNORED

TEXT = {**{k: v for k, v in TEXT35.items() if k != "intermediate_size"}, **EXPERTS}  # no dense MLP in the MoE


def build(seed: int = 3):
    v = vocab()
    cfg = transformers.Qwen3_5MoeConfig(
        text_config={**TEXT, "vocab_size": len(v) + 3, "bos_token_id": None, "eos_token_id": v.index("<|im_end|>")},
        vision_config=VISION35, image_token_id=v.index(PAD), video_token_id=v.index(SPECIALS[3]),
        vision_start_token_id=v.index(SPECIALS[0]), vision_end_token_id=v.index(SPECIALS[1]))
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            text = "visual" not in name
            if text and name.endswith("norm.weight") and "linear_attn" not in name:
                p.normal_(0.0, 0.1)  # Qwen3_5MoeRMSNorm multiplies by 1 + w: checkpoints hold w near 0
            elif text and name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)  # routers drawn wide: no near tie between a token's k-th and (k+1)-th experts
            elif ".experts." in name or ".shared_expert." in name:
                # narrower than the other weights: experts of 0.15 grew the residual stream until
                # either side's fp32 rounding (each measured against fp64) reached 2e-5 of the logits
                p.normal_(0.0, 0.08)
            else:
                norm = "norm" in name
                p.normal_(1.0 if norm else 0.0, 0.3 if norm else 0.15)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    build().save_pretrained(str(path))
    write_vlm_tokenizer(path, SPECIALS, "<|im_start|>", "<|im_end|>", CHAT_TEMPLATE)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path, load_hf(path)


def test_the_wrapper_serves_the_moe_text_model_with_its_mrope(moe):
    """The text model is the MoE one, its extra keeps mrope's section and interleaving beside the
    shared expert's gate, and the tower is loaded beside it."""
    path, _ = moe
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    cfg = lm.config
    assert cfg.arch == "qwen3_5_moe_text" and cfg.num_experts == 4 and cfg.linear_layers == [0, 2]
    assert cfg.extra["mrope_section"] == [2, 3, 3] and cfg.extra["mrope_interleaved"] is True
    assert cfg.extra["shared_expert_gate"] is True and cfg.extra["attention_output_gate"] is True
    assert lm.vision is not None and len(lm.vision.visual.blocks) == VISION35["depth"]


def test_encode_matches_get_image_features(moe):
    """Three images (wide, tall, scaled up to the minimum) against transformers' tower and merger, fp32."""
    path, hf = moe
    vision = load_vision(path, "cpu", torch.float32)
    inputs = ridge_inputs(path, IMAGES, hf_batch(path, IMAGES)["input_ids"][0].tolist())
    got = vision.encode(list(inputs))
    assert [tuple(g.shape) for g in got] == [(i.length, TEXT["hidden_size"]) for i in inputs]
    with torch.no_grad():
        ref = image_features(hf, *hf_pixels(IMAGES))
    assert_close(torch.cat(got), ref)


def test_logits_with_two_images_match_transformers(moe):
    """Two images with text between, fp32: relative error <= 1e-5, top-1 agreement 1.000."""
    path, hf = moe
    batch = hf_batch(path, IMAGES[:2], between="and then")
    ids = batch["input_ids"][0].tolist()
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    got = logits_with_images(lm.model, ids, ridge_inputs(path, IMAGES[:2], ids), lm.vision)
    with torch.no_grad():
        ref = hf(**batch).logits[0]
    assert_logits(got, ref)


@pytest.mark.parametrize("chunk", [512, 7])
def test_greedy_through_the_engine_equals_generate(moe, chunk):
    """In one prefill and in chunks of 7 that cut the images anywhere; decode past them at the
    shifted positions."""
    path, hf = moe
    batch = hf_batch(path, IMAGES[:2], between="and then")
    loaded = load_model(path, device="cpu", weights="fp32", use_cache=False)
    assert engine_greedy(loaded, path, batch, IMAGES[:2], chunk, enable_prefix_caching=False) == greedy_hf(hf, batch)


def test_the_same_image_again_hits_the_caches(moe):
    """The same image and question again: a prefix hit past the image (the recurrent state from a
    block-boundary checkpoint), no encoder run, transformers' answer both times."""
    path, hf = moe
    eng = make_engine(load_model(path, device="cpu", weights="fp32", use_cache=False), prefill_chunk=64)
    image = png(40, 24, 5)
    batch = hf_batch(path, [image])
    ids = batch["input_ids"][0].tolist()
    first, _ = run_request(eng, "first", path, [image], ids)
    misses = eng.runner.encoder.cache.misses
    again, cached = run_request(eng, "again", path, [image], ids)
    assert again == first == greedy_hf(hf, batch)
    last = max(i for i, t in enumerate(ids) if t == vocab().index(PAD))
    assert cached >= (last + 1) // eng.config.block_size * eng.config.block_size > 0
    assert eng.runner.encoder.cache.misses == misses


def test_encode_in_fp8_matches_get_image_features_on_ridges_weights(moe):
    """Every Linear of the tower e4m3; its rows equal transformers' on a copy holding the
    dequantized weights, and differ from the checkpoint's (tests/test_qwen_vl.py's check: the tower
    is Qwen3.5's)."""
    QVL.test_encode_in_fp8_matches_get_image_features_on_ridges_weights(moe)


def test_plan_counts_the_images_tokens(moe, capsys):
    """ridge plan DIR --image WxH: each image's placeholders (one per merged token of the
    processor's grid) and its two markers."""
    from ridge.cli import main

    path, _ = moe
    sizes = [(50, 22), (13, 41)]
    assert main(["plan", str(path), *(a for w, h in sizes for a in ("--image", f"{w}x{h}"))]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    _, grids = hf_pixels([png(w, h, 0) for w, h in sizes])
    a, b = (int(g.prod()) // MERGE ** 2 + 2 for g in grids)
    assert line == f"images: {a + b} prompt tokens (50x22: {a}, 13x41: {b})"


# -- the config: the tower's fields declared, a tower ridge cannot run refused by name

def test_vision_config_fields_are_declared():
    fields = {f.name: f.default for f in dataclasses.fields(transformers.Qwen3_5MoeVisionConfig)}
    assert not set(fields) - set(Q35.VISION_DEFAULTS) - Q35.VISION_IGNORED - BASE_IGNORED
    assert {k: fields[k] for k in Q35.VISION_DEFAULTS} == Q35.VISION_DEFAULTS


@pytest.mark.parametrize("vision, named", [
    ({"out_hidden_size": 32}, "vision_config.out_hidden_size=32"),
    ({"hidden_act": "relu"}, "vision_config.hidden_act='relu'"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "vision_config.rope_parameters="),
])
def test_vision_refusals_name_the_field(moe, tmp_path, vision, named):
    c = json.loads((moe[0] / "config.json").read_text())
    c["vision_config"].update(vision)
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ModelLoadError) as e:
        read_hf_config(tmp_path)
    assert named in str(e.value)
