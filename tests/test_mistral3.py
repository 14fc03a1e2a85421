"""Mistral 3 with images (ridge/models/mistral3/, ridge/vision/prompt.py PixtralPrompt): tiny random
Mistral3ForConditionalGeneration built by transformers 5.25 (tests/vlm_models.py
write_tiny_mistral3) over a mistral and over a ministral3 text model, saved as HF directories.

Oracles: transformers' get_image_features for the Pixtral tower and the projector, the wrapper's
logits and generate for the whole model, transformers' PixtralImageProcessorPil for the pixels and
image sizes. PixtralProcessor imports torchvision (not installed here), so its prompt expansion
(replace_image_token) is restated in `expansion` below from transformers' source."""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import math

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from engine_utils import make_engine
from test_idefics3 import assert_close, assert_fp8_tower, assert_logits, on_ridge_weights, png
from ridge.cache.kv_cache import KVCache
from ridge.engine.admit import Admitted
from ridge.engine.sampling_params import SamplingParams
from ridge.kernels.metadata import AttentionMetadata
from ridge.models.loader import load_model
from ridge.models.mistral3.config import (VISION_DEFAULTS, VISION_IGNORED, WRAPPER_DEFAULTS, WRAPPER_IGNORED,
                                          WRAPPER_READ)
from ridge.models.mistral3.vision import load_vision
from ridge.models.registry import read_hf_config
from ridge.quant.errors import ModelLoadError
from ridge.quant.hf_config import BASE_IGNORED
from ridge.vision import decode_image
from ridge.vision.inputs import ImageInput
from ridge.vision.prompt import place, read_prompt_rules
from vlm_models import (M3_BREAK, M3_END, M3_IMG, M3_MERGE, M3_PATCH, M3_PREPROCESSOR, mistral3_vocab,
                        write_tiny_mistral3)

TEXTS = ("mistral", "ministral3")
CELL = M3_PATCH * M3_MERGE
NEW = 10


# (width, height): wide and scaled down to 64 x 38 (8 x 5 cells); tall, 3 x 8; small, scaled up to none
IMAGES = [png(100, 60, 0), png(22, 61, 1), png(13, 9, 2)]


@pytest.fixture(scope="module", params=TEXTS)
def m3(request, tmp_path_factory):
    path = write_tiny_mistral3(tmp_path_factory.mktemp(request.param), request.param, seed=TEXTS.index(request.param))
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    return request.param, path, hf


def expansion(height: int, width: int) -> str:
    """PixtralProcessor.replace_image_token (transformers 5.25), restated: rows of [IMG] per cell
    across, each row closed by [IMG_BREAK], then the last token made [IMG_END]."""
    rows = [[M3_IMG] * (width // CELL) + [M3_BREAK]] * (height // CELL)
    tokens = [t for row in rows for t in row]
    tokens[-1] = M3_END
    return "".join(tokens)


def hf_pixels(images: list[bytes]):
    """transformers' image processor, as PixtralProcessor calls it (patch_size times the merge)."""
    ip = transformers.PixtralImageProcessorPil(**{k: v for k, v in M3_PREPROCESSOR.items()
                                                  if k not in ("image_processor_type", "processor_class")})
    out = ip([Image.open(io.BytesIO(d)).convert("RGB") for d in images], patch_size=CELL, return_tensors="pt")
    return out["pixel_values"], out["image_sizes"]


def hf_batch(path, images: list[bytes], question: str = "what is it?") -> dict:
    """The processor's input to the model: the chat rendered, each [IMG] expanded, tokenized."""
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    pixels, sizes = hf_pixels(images)
    pieces = text.split(M3_IMG)
    assert len(pieces) == len(images) + 1
    text = pieces[0] + "".join(expansion(*map(int, s)) + p for s, p in zip(sizes, pieces[1:]))
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "pixel_values": pixels, "image_sizes": sizes}


def ridge_inputs(path, images: list[bytes], ids: list[int]) -> tuple[ImageInput, ...]:
    """The daemon's input processing: ridge's rules expand each image, place() locates the rows."""
    rules = read_prompt_rules(path)
    expanded = [rules.expand(decode_image(d)) for d in images]
    return place(ids, expanded, rules.image_token_id)


def test_the_prompt_rules_are_the_processors(m3):
    """ridge's expansion of each image is PixtralProcessor's text for transformers' image size,
    its pixels transformers', and place() gives one input per row of [IMG] tokens."""
    _, path, _ = m3
    rules = read_prompt_rules(path)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    assert (rules.marker, rules.image_token_id) == (M3_IMG, mistral3_vocab().index(M3_IMG))
    pixels, sizes = hf_pixels(IMAGES)
    for data, px, (h, w) in zip(IMAGES, pixels, sizes.tolist()):
        e = rules.expand(decode_image(data))
        assert e.text == expansion(h, w)
        assert [p.length for p in e.inputs] == [w // CELL] * (h // CELL)
        assert [p.meta["row"] for p in e.inputs] == list(range(h // CELL))
        assert len({p.content for p in e.inputs}) == len(e.inputs)  # each row its own content
        np.testing.assert_array_equal(e.inputs[0].pixel_values, px[:, :h, :w].numpy())
        width, height = Image.open(io.BytesIO(data)).size  # the header's size alone
        assert rules.num_image_tokens(height, width) == len(tok(e.text, add_special_tokens=False)["input_ids"])
    batch = hf_batch(path, IMAGES[:2])
    ids = batch["input_ids"][0].tolist()
    placed = ridge_inputs(path, IMAGES[:2], ids)
    assert len(placed) == 5 + 8
    assert all(ids[i.offset:i.end] == [rules.image_token_id] * i.length for i in placed)
    assert all(ids[i.end] in (mistral3_vocab().index(M3_BREAK), mistral3_vocab().index(M3_END)) for i in placed)


def test_encode_matches_get_image_features(m3):
    """Three images' rows in one call (one pass, the block-diagonal mask) against transformers'
    tower and projector on the padded batch, fp32; a row asked alone later is the same rows."""
    _, path, hf = m3
    vision = load_vision(path, "cpu", torch.float32)
    ids = hf_batch(path, IMAGES)["input_ids"][0].tolist()
    inputs = ridge_inputs(path, IMAGES, ids)
    got = vision.encode(list(inputs))
    assert [tuple(g.shape) for g in got] == [(i.length, hf.config.text_config.hidden_size) for i in inputs]
    pixels, sizes = hf_pixels(IMAGES)
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(pixels, image_sizes=sizes).pooler_output)
    assert_close(torch.cat(got), ref)
    # a fresh encoder given one row of the second image: the whole image runs, that row comes back
    alone = load_vision(path, "cpu", torch.float32).encode([inputs[6]])[0]
    assert_close(alone, got[6])
    with pytest.raises(ValueError, match="7 placeholder tokens for a row worth 8"):
        vision.encode([dataclasses.replace(inputs[0], length=7)])


@pytest.mark.parametrize("layer", [0, 1, -2])
def test_vision_feature_layer(tmp_path, layer):
    """The projector takes the hidden state vision_feature_layer names (0: ln_pre's output)."""
    path = write_tiny_mistral3(tmp_path, "mistral", seed=4, vision_feature_layer=layer)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    ids = hf_batch(path, IMAGES[:2])["input_ids"][0].tolist()
    got = torch.cat(load_vision(path, "cpu", torch.float32).encode(list(ridge_inputs(path, IMAGES[:2], ids))))
    pixels, sizes = hf_pixels(IMAGES[:2])
    with torch.no_grad():  # every hidden state asked for: transformers reads layer 0 as "none wanted"
        ref = torch.cat(hf.model.get_image_features(pixels, image_sizes=sizes, output_hidden_states=True).pooler_output)
    assert_close(got, ref)


def logits_with_images(model, ids: list[int], inputs, vision) -> torch.Tensor:
    """prompt_logits with the encoder's rows in place of the placeholders (CausalLM's embeds)."""
    n, bs = len(ids), 16
    nb = math.ceil(n / bs)
    cache = KVCache(model.cfg, nb, bs, "fp32", torch.device("cpu"))
    meta = AttentionMetadata.build([n], [n], [list(range(nb))], list(range(n)), torch.device("cpu"))
    rows = torch.cat([torch.arange(i.offset, i.end) for i in inputs])
    embeds = (rows, torch.cat(vision.encode(list(inputs))))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), meta, cache.layers, embeds=embeds)
        return model.compute_logits(hidden)


def test_logits_with_two_images_match_transformers(m3):
    """The text model (read and run as its own family) with load_vision's rows at the placeholders,
    against the wrapper's logits on the processor's input."""
    text, path, hf = m3
    batch = hf_batch(path, IMAGES[:2])
    ids = batch["input_ids"][0].tolist()
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    assert lm.config.arch == text and lm.config.tie_word_embeddings is False
    assert lm.vision is not None
    vision = load_vision(path, "cpu", torch.float32)
    got = logits_with_images(lm.model, ids, ridge_inputs(path, IMAGES[:2], ids), vision)
    with torch.no_grad():
        ref = hf(**batch).logits[0]
    assert_logits(got, ref)


def greedy_hf(hf, batch) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**batch, max_new_tokens=NEW, do_sample=False)
    return out[0, batch["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("chunk", [512, 7])
def test_greedy_through_the_engine_equals_generate(m3, chunk):
    """Two images (13 rows, each its own input) in one prefill, and in chunks of 7 that cut rows
    and images anywhere (later rows of an image come from the encoder's kept output)."""
    _, path, hf = m3
    batch = hf_batch(path, IMAGES[:2])
    loaded = load_model(path, device="cpu", weights="fp32", use_cache=False)
    assert engine_greedy(loaded, path, batch, chunk) == greedy_hf(hf, batch)


def engine_greedy(loaded, path, batch: dict, chunk: int) -> list[int]:
    """The engine's greedy tokens for the batch's prompt, its images' rows by ridge's rules."""
    ids = batch["input_ids"][0].tolist()
    eng = make_engine(loaded, prefill_chunk=chunk, enable_prefix_caching=False)
    eng.add_request("a", Admitted(ids, SamplingParams(max_tokens=NEW, ignore_eos=True),
                                  ridge_inputs(path, IMAGES[:2], ids)))
    got = []
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
    return got


def test_encode_in_fp8_matches_get_image_features_on_ridges_weights(m3):
    """weights "fp8": the tower's, the patch merger's and the projector's Linears are e4m3
    (per-output-channel scales); the rows equal transformers' on a copy holding those dequantized
    weights."""
    _, path, hf = m3
    vision = load_vision(path, "cpu", torch.float32, weights="fp8")
    assert_fp8_tower(vision, vision.multi_modal_projector.linear_1, hf.model.multi_modal_projector.linear_1.weight)
    inputs = ridge_inputs(path, IMAGES, hf_batch(path, IMAGES)["input_ids"][0].tolist())
    got = torch.cat(vision.encode(list(inputs)))
    pixels, sizes = hf_pixels(IMAGES)
    with torch.no_grad():
        ref = torch.cat(on_ridge_weights(hf, vision).model.get_image_features(pixels, image_sizes=sizes).pooler_output)
        plain = torch.cat(hf.model.get_image_features(pixels, image_sizes=sizes).pooler_output)
    assert_close(got, ref)
    assert not torch.allclose(got, plain, rtol=0, atol=1e-6)
    assert vision.weight_bytes() < load_vision(path, "cpu", torch.float32).weight_bytes()


def test_greedy_in_fp8_through_the_engine_equals_transformers_on_ridges_weights(m3):
    """load_model(weights="fp8"): tower, projector and decoder in e4m3; two images (13 rows) in one
    prefill, greedy against transformers' generate on a copy holding ridge's dequantized weights."""
    _, path, hf = m3
    batch = hf_batch(path, IMAGES[:2])
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False)
    assert lm.vision.vision_tower.transformer.layers[0].attention.q_proj.is_fp8
    assert engine_greedy(lm, path, batch, 512) == greedy_hf(on_ridge_weights(hf, lm.vision, lm), batch)


def test_the_same_image_again_hits_the_caches_and_another_never_does(m3):
    """The same image and question again: a prefix hit past the image's rows and no encoder run;
    another image of the same size (the same placeholder tokens): no hit past the text before it,
    and its own answer (transformers')."""
    _, path, hf = m3
    loaded = load_model(path, device="cpu", weights="fp32", use_cache=False)
    eng = make_engine(loaded, prefill_chunk=64)
    one, two = png(64, 64, 5), png(64, 64, 6)
    b1, b2 = hf_batch(path, [one]), hf_batch(path, [two])
    ids1, ids2 = b1["input_ids"][0].tolist(), b2["input_ids"][0].tolist()
    assert ids1 == ids2

    def run(rid, data, ids):
        eng.add_request(rid, Admitted(ids, SamplingParams(max_tokens=NEW, ignore_eos=True),
                                      ridge_inputs(path, [data], ids)))
        got, cached = [], None
        while eng.has_unfinished():
            for o in eng.step():
                got += o.new_token_ids
                cached = o.num_cached_tokens if o.finished else cached
        return got, cached

    first, _ = run("first", one, ids1)
    misses = eng.runner.encoder.cache.misses
    again, cached = run("again", one, ids1)
    assert again == first == greedy_hf(hf, b1)
    image_id, block = mistral3_vocab().index(M3_IMG), eng.config.block_size
    last = max(i for i, t in enumerate(ids1) if t == image_id)
    assert cached >= (last + 1) // block * block > 0
    assert eng.runner.encoder.cache.misses == misses
    other, cached = run("other", two, ids2)
    assert cached <= min(i for i, t in enumerate(ids2) if t == image_id) // block * block
    assert other == greedy_hf(hf, b2)


def test_the_tower_in_bf16(m3):
    """Loaded in bf16, the encoder computes in bf16 and stays near fp32's (bf16 rounding)."""
    _, path, _ = m3
    ids = hf_batch(path, IMAGES[:2])["input_ids"][0].tolist()
    inputs = list(ridge_inputs(path, IMAGES[:2], ids))
    ref = torch.cat(load_vision(path, "cpu", torch.float32).encode(inputs))
    got = torch.cat(load_vision(path, "cpu", torch.bfloat16).encode(inputs))
    assert got.dtype == torch.bfloat16
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 0.05


# -- the config: every field read or declared ignored, a value ridge cannot run refused by name

def test_config_fields_are_declared():
    fields = {f.name: f.default for f in dataclasses.fields(transformers.Mistral3Config)}
    assert not set(fields) - WRAPPER_READ - WRAPPER_IGNORED - BASE_IGNORED
    assert {k: fields[k] for k in WRAPPER_DEFAULTS} == WRAPPER_DEFAULTS
    vfields = {f.name: f.default for f in dataclasses.fields(transformers.PixtralVisionConfig)}
    assert not set(vfields) - set(VISION_DEFAULTS) - VISION_IGNORED - BASE_IGNORED
    assert {k: vfields[k] for k in VISION_DEFAULTS} == VISION_DEFAULTS


def _write_config(tmp_path, text: dict | None = None, vision: dict | None = None, **top) -> None:
    c = transformers.Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": 400, "hidden_size": 64, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "num_hidden_layers": 2},
        vision_config={"hidden_size": 32, "num_attention_heads": 2, "patch_size": 4, "num_hidden_layers": 2},
        image_token_index=300).to_dict()
    c["text_config"].update(text or {})
    c["vision_config"].update(vision or {})
    c.update(top)
    (tmp_path / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("text, vision, top, named", [
    ({}, {"hidden_act": "relu"}, {}, "vision_config.hidden_act='relu'"),
    ({}, {"patch_size": [4, 4]}, {}, "vision_config.patch_size=[4, 4]"),
    ({}, {"num_attention_heads": 3}, {}, "vision_config.num_attention_heads=3"),
    ({}, {"num_attention_heads": 32}, {}, "vision_config.num_attention_heads=32"),  # heads of 1: no rotary pair
    ({}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, {}, "vision_config.rope_parameters="),
    ({}, {"model_type": "siglip_vision_model"}, {}, "vision_config.model_type='siglip_vision_model'"),
    ({}, {}, {"vision_feature_layer": 3}, "vision_feature_layer=3"),
    ({}, {}, {"vision_feature_layer": [-1, -2]}, "vision_feature_layer=[-1, -2]"),
    ({}, {}, {"spatial_merge_size": 0}, "spatial_merge_size=0"),
    ({}, {}, {"projector_hidden_act": "relu"}, "projector_hidden_act='relu'"),
    ({}, {}, {"multimodal_projector_bias": "no"}, "multimodal_projector_bias='no'"),
    ({}, {}, {"image_token_index": 400}, "image_token_index=400"),
    ({"model_type": "llama"}, {}, {}, "text_config.model_type='llama'"),
    ({}, {}, {"text_config": [1]}, "text_config=[1]"),
    ({}, {}, {"vision_config": [1]}, "vision_config=[1]"),
    ({"hidden_act": "relu"}, {}, {}, "text_config.hidden_act='relu'"),
])
def test_refusals_name_the_field(tmp_path, text, vision, top, named):
    _write_config(tmp_path, text, vision, **top)
    with pytest.raises(ModelLoadError) as e:
        read_hf_config(tmp_path)
    assert named in str(e.value)


def test_config_without_sub_configs_is_transformers_default(tmp_path):
    """No text_config: transformers builds the wrapper's mistral (hidden 5120, 40 layers, ...)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral3"}))
    cfg = read_hf_config(tmp_path)
    ref = transformers.AutoConfig.from_pretrained(str(tmp_path)).text_config
    assert cfg.arch == "mistral"
    assert (cfg.hidden_size, cfg.num_layers, cfg.head_dim, cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps) == (
        ref.hidden_size, ref.num_hidden_layers, ref.head_dim, ref.vocab_size, ref.rope_parameters["rope_theta"],
        ref.rms_norm_eps)


# -- through the daemon: the openai package sends the image, the answer is transformers' greedy

QUESTION, MAX_TOKENS = "what is it?", 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """`ridge serve` with the OpenAI API (test_image_input's serve_both), in fp32 (weights and KV:
    transformers' dtype, so that its greedy answer is the oracle)."""
    from test_daemon_harness import Daemon
    from test_gateway import free_port, wait_http

    tmp = tmp_path_factory.mktemp("mistral3-daemon")
    path = write_tiny_mistral3(tmp / "mistral3", "mistral", seed=5)
    http = free_port()
    d = Daemon(tmp, str(path), "--num-kv-blocks", 256, "--kv-host-gib", "0.05", "--no-kv-disk", "--weights", "fp32",
               "--kv-dtype", "fp32", "--cpu-weight-format", "fp32", "--http", f"127.0.0.1:{http}",
               "--served-model-name", "tiny")
    d.url = f"http://127.0.0.1:{http}"
    wait_http(d.url)
    yield d, path
    d.stop()


def test_openai_package_gets_transformers_greedy_answer(daemon):
    import openai

    from ridge.daemon.client import Client

    d, path = daemon
    image = png(90, 150, 11)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    batch = hf_batch(path, [image], QUESTION)
    with torch.no_grad():
        want = hf.generate(**batch, max_new_tokens=MAX_TOKENS, do_sample=False)[0, batch["input_ids"].shape[1]:]
    with Client(d.endpoint, timeout=120) as c:
        own = c.generate(messages=[{"role": "user", "content": [{"type": "image", "image": 0},
                                                                {"type": "text", "text": QUESTION}]}],
                         images=[image], max_tokens=MAX_TOKENS, temperature=0)
    assert list(own.token_ids) == want.tolist()
    oai = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    answer = oai.chat.completions.create(model="tiny", max_tokens=MAX_TOKENS, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": QUESTION}]}])
    assert answer.choices[0].message.content == own.text
