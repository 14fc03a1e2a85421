"""Qwen2.5-VL with images (ridge/models/qwen2_5_vl/, ridge/models/layers/mrope.py, ridge/vision/prompt.py
QwenVLPrompt): a tiny random Qwen2_5_VLForConditionalGeneration built by transformers 5.25 (a
3-block ViT, one block attending over the whole image and two in windows of 2 x 2 merged tokens,
beside a 2-layer text model with mrope_section [2, 3, 3]), saved as an HF directory.

Oracles: transformers' get_image_features for the tower and merger, the model's logits and generate
(its get_rope_index gives the three positions from mm_token_type_ids), transformers'
Qwen2VLImageProcessorPil for the pixels and grids. Qwen2_5_VLProcessor needs a video processor
(torchvision, not installed), so its expansion (each <|image_pad|> repeated once per merged token)
is restated in `hf_batch`.

Qwen3-VL (ridge/models/qwen3_vl/) the same way: a tiny Qwen3VLForConditionalGeneration (a 3-block
ViT with a 4 x 4 learned position table and deepstack mergers after blocks 0 and 1, beside a
3-layer Qwen3 text model with interleaved mrope_section [2, 3, 3]); and Qwen3.5 with vision
(ridge/models/qwen3_5/vision.py: Qwen3-VL's tower without deepstack, beside a hybrid of Gated
DeltaNet and gated attention layers, half of each head rotary, interleaved mrope)."""
from __future__ import annotations

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
from test_mistral3 import NEW, greedy_hf
from tiny_models import tiny_vocab
from vlm_models import write_vlm_tokenizer
from ridge.cache.kv_cache import KVCache
from ridge.engine.admit import Admitted
from ridge.engine.sampling_params import SamplingParams
from ridge.kernels.metadata import AttentionMetadata
from ridge.models.layers.mrope import position_table, step_positions
from ridge.models.loader import load_model
from ridge.models.qwen2_5_vl.config import (TEXT_DEFAULTS, TEXT_IGNORED, VISION_DEFAULTS, VISION_IGNORED,
                                            WRAPPER_DEFAULTS, WRAPPER_IGNORED, WRAPPER_READ)

from ridge.models.qwen3_5 import vision as Q35
from ridge.models.qwen3_vl import config as Q3
from ridge.models.registry import load_vision, read_hf_config
from ridge.quant.errors import ModelLoadError
from ridge.quant.hf_config import BASE_IGNORED
from ridge.vision import decode_image
from ridge.vision.prompt import place, read_prompt_rules

START, PAD, END, VIDEO = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
SPECIALS = [START, END, PAD, VIDEO]
PATCH, MERGE, TEMPORAL = 4, 2, 2
CELL = PATCH * MERGE
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-6, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
              temporal_patch_size=TEMPORAL, window_size=2 * CELL, out_hidden_size=64, fullatt_block_indexes=[1])
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor", "do_convert_rgb": True,
    "do_resize": True, "size": {"shortest_edge": 4 * CELL * CELL, "longest_edge": 36 * CELL * CELL}, "resample": 3,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE}
# Qwen2.5-VL's chat template, reduced to user and assistant turns: an image part as the triple.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# (width, height): wide, 6 x 3 merged tokens (windows cut at the right edge); tall, 2 x 5; small,
# scaled up to the minimum of 2 x 2
IMAGES = [png(50, 22, 0), png(13, 41, 1), png(5, 6, 2)]


TEXT3 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=2048, attention_bias=True,
             rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                              "rope_theta": 10000.0})
VISION3 = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
               temporal_patch_size=TEMPORAL, out_hidden_size=64, num_position_embeddings=16,
               deepstack_visual_indexes=[0, 1])
# Qwen3.5 (hybrid: Gated DeltaNet layers beside gated attention, half of each head rotary)
TEXT35 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=2048, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5, "mrope_section": [2, 3, 3],
                               "mrope_interleaved": True, "rope_theta": 10000.0})
VISION35 = {k: v for k, v in VISION3.items() if k != "deepstack_visual_indexes"}
KINDS = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", TEXT, VISION),
         "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", TEXT3, VISION3),
         "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", TEXT35, VISION35)}
DENSE = ["qwen2_5_vl", "qwen3_vl"]  # on_ridge_weights unfuses a dense decoder's layers


def vocab() -> list[str]:
    return tiny_vocab()[0] + SPECIALS


def build(seed: int = 0, kind: str = "qwen2_5_vl", **over):
    v = vocab()
    config_cls, model_cls, text, vision = KINDS[kind]
    cfg = getattr(transformers, config_cls)(
        text_config={**text, "vocab_size": len(v) + 3, "bos_token_id": None, "eos_token_id": v.index("<|im_end|>"),
                     **over.pop("text", {})},
        vision_config={**vision, **over.pop("vision", {})}, image_token_id=v.index(PAD),
        video_token_id=v.index(VIDEO), vision_start_token_id=v.index(START), vision_end_token_id=v.index(END), **over)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name or "ln_q" in name
            p.normal_(1.0 if norm else 0.0, 0.3 if norm else 0.15)
            if kind == "qwen3_5" and name.endswith("norm.weight") and "visual" not in name and "linear_attn" not in name:
                p.normal_(0.0, 0.1)  # Qwen3_5RMSNorm multiplies by 1 + w: checkpoints hold w near 0
    model.config._attn_implementation = "eager"
    return model.eval()


def write(path, seed: int = 0, kind: str = "qwen2_5_vl", **over):
    build(seed, kind, **over).save_pretrained(str(path))
    write_vlm_tokenizer(path, SPECIALS, "<|im_start|>", "<|im_end|>", CHAT_TEMPLATE)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


def load_hf(path):
    return transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                                    attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    models = {}

    def get(kind: str):
        if kind not in models:
            path = write(tmp_path_factory.mktemp(kind), list(KINDS).index(kind), kind)
            models[kind] = path, load_hf(path)
        return models[kind]
    return get


@pytest.fixture(scope="module", params=list(KINDS))
def qvl(request, built):
    return built(request.param)


@pytest.fixture(scope="module", params=DENSE)
def dense(request, built):
    return built(request.param)


def image_features(hf, pixels, grids) -> torch.Tensor:
    """transformers' rows for the images: the merger's, and Qwen3-VL's deepstack mergers' beside them."""
    out = hf.model.get_image_features(pixels, grids)
    deep = getattr(out, "deepstack_features", None) or []
    return torch.cat([torch.cat(out.pooler_output), *(torch.cat(f) for f in deep)], dim=-1)


def hf_pixels(images: list[bytes]):
    ip = transformers.Qwen2VLImageProcessorPil(**{k: v for k, v in PREPROCESSOR.items()
                                                  if k not in ("image_processor_type", "processor_class")})
    out = ip([Image.open(io.BytesIO(d)).convert("RGB") for d in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def hf_batch(path, images: list[bytes], question: str = "what is it?", between: str = "") -> dict:
    """The processor's input to the model: the chat rendered (text between the images), each
    <|image_pad|> repeated once per merged token, tokenized; mm_token_type_ids 1 on the images."""
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    content = []
    for i in range(len(images)):
        content += [{"type": "image"}] + ([{"type": "text", "text": between}] if between and i == 0 else [])
    content.append({"type": "text", "text": question})
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    pixels, grids = hf_pixels(images)
    pieces = text.split(PAD)
    assert len(pieces) == len(images) + 1
    text = pieces[0] + "".join(PAD * (int(g.prod()) // MERGE ** 2) + p for g, p in zip(grids, pieces[1:]))
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grids,
            "mm_token_type_ids": (ids == vocab().index(PAD)).int()}


def ridge_inputs(path, images: list[bytes], ids: list[int]):
    rules = read_prompt_rules(path)
    return place(ids, [rules.expand(decode_image(d)) for d in images], rules.image_token_id)


def test_the_prompt_rules_are_the_processors(qvl):
    """The marker is what the template writes, its expansion the processor's text for transformers'
    grid, the pixels transformers', one input per image with its grids."""
    path, _ = qvl
    rules = read_prompt_rules(path)
    assert (rules.marker, rules.image_token_id) == (START + PAD + END, vocab().index(PAD))
    pixels, grids = hf_pixels(IMAGES)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    done = 0
    for data, (t, h, w) in zip(IMAGES, grids.tolist()):
        e = rules.expand(decode_image(data))
        n = t * h * w // MERGE ** 2
        assert e.text == START + PAD * n + END
        (inp,) = e.inputs
        assert inp.length == n and inp.meta == {"grid": (t, h, w), "mrope_grid": (t, h // MERGE, w // MERGE)}
        np.testing.assert_array_equal(inp.pixel_values, pixels[done:done + t * h * w].numpy())
        done += t * h * w
        width, height = Image.open(io.BytesIO(data)).size
        assert rules.num_image_tokens(height, width) == len(tok(e.text, add_special_tokens=False)["input_ids"])
    assert [g.tolist() for g in grids] == [[1, 6, 12], [1, 10, 4], [1, 6, 4]]


def test_position_table_is_get_rope_index(qvl):
    """Two images with text between: ridge's table (and the delta past the prompt) equals
    transformers' get_rope_index on the processor's input."""
    path, hf = qvl
    batch = hf_batch(path, IMAGES[:2], between="and then")
    ids = batch["input_ids"][0].tolist()
    table = position_table(len(ids), ridge_inputs(path, IMAGES[:2], ids))
    ref, delta = hf.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"])
    np.testing.assert_array_equal(table.pos, ref[:, 0].numpy())
    assert table.delta == int(delta) < 0


@pytest.mark.parametrize("interleaved, section, half", [(False, [2, 3, 3], 8), (False, [16, 24, 24], 64),
                                                        (True, [24, 20, 20], 64), (True, [1, 1, 0], 4),
                                                        (True, [11, 11, 10], 32), (True, [2, 3, 3], 8)])
def test_axis_map_is_transformers_recomposition(interleaved, section, half):
    """Which of (t, h, w) turns each column of the [cos | sin] table: transformers' recomposition
    of a table whose axis a holds the value a."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from ridge.models.layers.mrope import axis_map
    rotary = object.__new__(Qwen3VLTextRotaryEmbedding if interleaved else Qwen2_5_VLRotaryEmbedding)
    rotary.mrope_section = section
    freq = torch.arange(3.0)[:, None, None].expand(3, 1, half).clone()
    assert axis_map(section, interleaved, 2 * half).tolist() == rotary.recomposition_frequencies(freq)[0].long().tolist()


def test_encode_matches_get_image_features(qvl):
    """Three images (windows cut by the edges) against transformers' tower and merger, fp32."""
    path, hf = qvl
    vision = load_vision(path, "cpu", torch.float32)
    ids = hf_batch(path, IMAGES)["input_ids"][0].tolist()
    inputs = ridge_inputs(path, IMAGES, ids)
    got = vision.encode(list(inputs))
    deep = len(getattr(hf.config.vision_config, "deepstack_visual_indexes", ()))
    assert [tuple(g.shape) for g in got] == [(i.length, 64 * (1 + deep)) for i in inputs]
    pixels, grids = hf_pixels(IMAGES)
    with torch.no_grad():
        ref = image_features(hf, pixels, grids)
    assert_close(torch.cat(got), ref)
    with pytest.raises(ValueError, match="placeholder tokens"):
        vision.encode([dataclasses.replace(inputs[0], length=7)])


def test_the_tower_in_bf16(qvl):
    """Loaded in bf16, the encoder computes in bf16 and stays near fp32's (bf16 rounding)."""
    path, _ = qvl
    inputs = list(ridge_inputs(path, IMAGES[:2], hf_batch(path, IMAGES[:2])["input_ids"][0].tolist()))
    ref = torch.cat(load_vision(path, "cpu", torch.float32).encode(inputs))
    got = torch.cat(load_vision(path, "cpu", torch.bfloat16).encode(inputs))
    assert got.dtype == torch.bfloat16
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 0.05


def logits_with_images(model, ids: list[int], inputs, vision) -> torch.Tensor:
    """The prompt's logits in one pass, positions and image rows as the runner gives them."""
    n, bs = len(ids), 16
    nb = math.ceil(n / bs)
    cache = KVCache(model.cfg, nb, bs, "fp32", torch.device("cpu"))
    meta = AttentionMetadata.build([n], [n], [list(range(nb))], list(range(n)), torch.device("cpu"))
    positions = torch.arange(n)
    embeds = None
    if inputs:
        shift, meta.mrope = step_positions([(position_table(n, inputs), 0, 0, n)], "cpu")
        positions = positions + shift
        rows = torch.cat([torch.arange(i.offset, i.end) for i in inputs])
        embeds = (rows, torch.cat(vision.encode(list(inputs))))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), positions, meta, cache.layers, embeds=embeds))


def test_logits_with_two_images_match_transformers(qvl):
    path, hf = qvl
    batch = hf_batch(path, IMAGES[:2], between="and then")
    ids = batch["input_ids"][0].tolist()
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    assert lm.config.arch == hf.config.text_config.model_type and lm.config.extra["mrope_section"] == [2, 3, 3]
    got = logits_with_images(lm.model, ids, ridge_inputs(path, IMAGES[:2], ids), lm.vision)
    with torch.no_grad():
        ref = hf(**batch).logits[0]
    assert_logits(got, ref)


def test_text_only_logits_match_transformers(qvl):
    """No image: the plain 1-D path (three equal positions), as transformers' text-only forward."""
    path, hf = qvl
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    ids = tok("the rain in spain stays mainly in the plain, they say", add_special_tokens=False)["input_ids"]
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    got = logits_with_images(lm.model, ids, (), None)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    assert_logits(got, ref)


def run_request(eng, rid: str, path, images, ids: list[int]) -> tuple[list[int], int]:
    """One greedy request through the engine, its images by ridge's rules -> (tokens, prefix-cache hit)."""
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    eng.add_request(rid, Admitted(ids, params, ridge_inputs(path, images, ids)))
    got, cached = [], None
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
            cached = o.num_cached_tokens if o.finished else cached
    return got, cached


def engine_greedy(loaded, path, batch: dict, images, chunk: int, **kw) -> list[int]:
    eng = make_engine(loaded, prefill_chunk=chunk, **kw)
    return run_request(eng, "a", path, images, batch["input_ids"][0].tolist())[0]


@pytest.mark.parametrize("chunk", [512, 7])
def test_greedy_through_the_engine_equals_generate(qvl, chunk):
    """Two images with text between, in one prefill and in chunks of 7 that cut the images anywhere;
    decode past them at the shifted positions."""
    path, hf = qvl
    batch = hf_batch(path, IMAGES[:2], between="and then")
    loaded = load_model(path, device="cpu", weights="fp32", use_cache=False)
    assert engine_greedy(loaded, path, batch, IMAGES[:2], chunk, enable_prefix_caching=False) == greedy_hf(hf, batch)


@pytest.mark.parametrize("spec", ["ngram", "self:1"])
def test_greedy_under_speculation_equals_generate(dense, spec):
    """Drafted tokens past the images are verified at their shifted positions (a self-draft's own
    pass drafts at plain ones: only what it proposes differs, never the answer). Dense models: a
    hybrid's recurrent state takes no drafts (engine/hybrid.py)."""
    path, hf = dense
    batch = hf_batch(path, IMAGES[:2], between="and then")
    again = batch["input_ids"][:, -12:-4]  # the prompt ends repeating its own text: prompt lookup drafts
    assert vocab().index(PAD) not in again
    batch = {**batch, "input_ids": torch.cat([batch["input_ids"], again], 1),
             "mm_token_type_ids": torch.cat([batch["mm_token_type_ids"], torch.zeros_like(again).int()], 1)}
    loaded = load_model(path, device="cpu", weights="fp32", use_cache=False)
    eng = make_engine(loaded, prefill_chunk=64, speculative=spec, max_num_seqs=2)
    assert run_request(eng, "a", path, IMAGES[:2], batch["input_ids"][0].tolist())[0] == greedy_hf(hf, batch)
    assert eng.stats()["speculative"]["total"]["drafted"] > 0


def test_the_same_image_again_hits_the_caches_and_another_never_does(qvl):
    """The same image and question again: a prefix hit past the image and no encoder run, the same
    answer (its positions from the table, not from the hit); another image of the same size: its own
    answer (transformers')."""
    path, hf = qvl
    loaded = load_model(path, device="cpu", weights="fp32", use_cache=False)
    eng = make_engine(loaded, prefill_chunk=64)
    one, two = png(40, 24, 5), png(40, 24, 6)
    b1, b2 = hf_batch(path, [one]), hf_batch(path, [two])
    ids1, ids2 = b1["input_ids"][0].tolist(), b2["input_ids"][0].tolist()
    assert ids1 == ids2
    first, _ = run_request(eng, "first", path, [one], ids1)
    misses = eng.runner.encoder.cache.misses
    again, cached = run_request(eng, "again", path, [one], ids1)
    assert again == first == greedy_hf(hf, b1)
    pad, block = vocab().index(PAD), eng.config.block_size
    last = max(i for i, t in enumerate(ids1) if t == pad)
    assert cached >= (last + 1) // block * block > 0
    assert eng.runner.encoder.cache.misses == misses
    other, cached = run_request(eng, "other", path, [two], ids2)
    assert cached <= min(i for i, t in enumerate(ids2) if t == pad) // block * block
    assert other == greedy_hf(hf, b2)


def test_encode_in_fp8_matches_get_image_features_on_ridges_weights(qvl):
    path, hf = qvl
    vision = load_vision(path, "cpu", torch.float32, weights="fp8")
    assert_fp8_tower(vision, vision.visual.blocks[0].attn.qkv, hf.model.visual.blocks[0].attn.qkv.weight)
    inputs = ridge_inputs(path, IMAGES, hf_batch(path, IMAGES)["input_ids"][0].tolist())
    got = torch.cat(vision.encode(list(inputs)))
    pixels, grids = hf_pixels(IMAGES)
    with torch.no_grad():
        ref = image_features(on_ridge_weights(hf, vision), pixels, grids)
        plain = image_features(hf, pixels, grids)
    assert_close(got, ref)
    assert not torch.allclose(got, plain, rtol=0, atol=1e-6)


def test_greedy_in_fp8_through_the_engine_equals_transformers_on_ridges_weights(dense):
    path, hf = dense
    batch = hf_batch(path, IMAGES[:2], between="and then")
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False)
    assert lm.vision.visual.blocks[0].attn.qkv.is_fp8
    assert engine_greedy(lm, path, batch, IMAGES[:2], 512) == greedy_hf(on_ridge_weights(hf, lm.vision, lm), batch)


# -- the config: every field read or declared ignored, a value ridge cannot run refused by name

def test_config_fields_are_declared():
    for cls, read, ignored, defaults in (
            (transformers.Qwen2_5_VLConfig, WRAPPER_READ, WRAPPER_IGNORED, WRAPPER_DEFAULTS),
            (transformers.Qwen2_5_VLTextConfig, set(TEXT_DEFAULTS), TEXT_IGNORED, TEXT_DEFAULTS),
            (transformers.Qwen2_5_VLVisionConfig, set(VISION_DEFAULTS), VISION_IGNORED, VISION_DEFAULTS),
            (transformers.Qwen3VLConfig, WRAPPER_READ, WRAPPER_IGNORED, WRAPPER_DEFAULTS),
            (transformers.Qwen3VLTextConfig, set(Q3.TEXT_DEFAULTS), Q3.TEXT_IGNORED, Q3.TEXT_DEFAULTS),
            (transformers.Qwen3VLVisionConfig, set(Q3.VISION_DEFAULTS), Q3.VISION_IGNORED, Q3.VISION_DEFAULTS),
            (transformers.Qwen3_5VisionConfig, set(Q35.VISION_DEFAULTS), Q35.VISION_IGNORED, Q35.VISION_DEFAULTS)):
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        assert not set(fields) - set(read) - ignored - BASE_IGNORED, cls.__name__
        same = {k: (list(fields[k]) if isinstance(fields[k], tuple) else fields[k]) for k in defaults if k in fields}
        assert same == {k: defaults[k] for k in same}, cls.__name__


def test_a_flat_config_reads_as_the_nested_one(tmp_path):
    """Qwen2.5-VL's Hub files put the text fields at the top (rope_scaling's type mrope), which
    transformers moves into text_config: the same model as the nested file."""
    path = tmp_path / "nested"
    _write_config(path)
    nested = json.loads((path / "config.json").read_text())
    tmp_path = tmp_path / "flat"
    tmp_path.mkdir()
    text = nested.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**nested, **{k: v for k, v in text.items() if k != "model_type"},
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}, "rope_theta": rope["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert read_hf_config(tmp_path) == dataclasses.replace(read_hf_config(path), name=tmp_path.name)


def _write_config(tmp_path, text: dict | None = None, vision: dict | None = None, kind: str = "qwen2_5_vl",
                  **top) -> None:
    tmp_path.mkdir(exist_ok=True)
    c = build(0, kind).config.to_dict()
    c["text_config"].update(text or {})
    c["vision_config"].update(vision or {})
    c.update(top)
    (tmp_path / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("text, vision, top, named", [
    ({"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 4]}}, {}, {},
     "rope_parameters.mrope_section=[2, 3, 4]"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "mrope_section": [2, 3, 3]}}, {}, {},
     "rope_parameters.rope_type='yarn'"),
    ({"hidden_act": "relu"}, {}, {}, "text_config.hidden_act='relu'"),
    ({}, {"hidden_act": "relu"}, {}, "vision_config.hidden_act='relu'"),
    ({}, {"num_heads": 16}, {}, "vision_config.num_heads=16"),  # heads of 2: no quarter to turn by row
    ({}, {"rope_parameters": {"rope_type": "yarn"}}, {}, "vision_config.rope_parameters="),
    ({}, {"window_size": 4}, {}, "vision_config.window_size=4"),
    ({}, {"fullatt_block_indexes": "all"}, {}, "vision_config.fullatt_block_indexes='all'"),
    ({}, {"out_hidden_size": 32}, {}, "vision_config.out_hidden_size=32"),
    ({}, {}, {"image_token_id": 999}, "image_token_id=999"),
    ({}, {}, {"text_config": [1]}, "text_config=[1]"),
])
def test_refusals_name_the_field(tmp_path, text, vision, top, named):
    _write_config(tmp_path, text, vision, **top)
    with pytest.raises(ModelLoadError) as e:
        read_hf_config(tmp_path)
    assert named in str(e.value)


@pytest.mark.parametrize("text, vision, top, named", [
    ({"rope_parameters": {"rope_type": "default", "mrope_section": [3, 3]}}, {}, {},
     "rope_parameters.mrope_section=[3, 3]"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "mrope_section": [2, 3, 3]}}, {}, {},
     "rope_parameters.rope_type='linear'"),
    ({}, {"deepstack_visual_indexes": [0, 3]}, {}, "vision_config.deepstack_visual_indexes=[0, 3]"),
    ({}, {"deepstack_visual_indexes": [1, 0]}, {}, "vision_config.deepstack_visual_indexes=[1, 0]"),
    ({}, {"hidden_act": "relu"}, {}, "vision_config.hidden_act='relu'"),
    ({}, {"out_hidden_size": 32}, {}, "vision_config.out_hidden_size=32"),
    ({}, {}, {"image_token_id": -1}, "image_token_id=-1"),
])
def test_qwen3_vl_refusals_name_the_field(tmp_path, text, vision, top, named):
    _write_config(tmp_path, text, vision, kind="qwen3_vl", **top)
    with pytest.raises(ModelLoadError) as e:
        read_hf_config(tmp_path)
    assert named in str(e.value)


# -- through the daemon's validator: the chat template's marker and a raw prompt's

def test_the_validator_admits_the_processors_prompt(qvl):
    """A chat with two images (text between) and a raw prompt with RAW_MARKER: the admitted ids are
    the processor's, each image one input at its run of <|image_pad|> with its grids; the engine's
    answer to the admitted request is transformers'."""
    from test_image_input import chat, gen

    from ridge.daemon.cli.config import defaults
    from ridge.daemon.cli.serve import limits
    from ridge.daemon.frontend.images import rules_for
    from ridge.daemon.frontend.validate import Validator
    from ridge.tokenizer import Tokenizer
    from ridge.vision.prompt import RAW_MARKER

    path, hf = qvl
    tok = Tokenizer.from_hf_dir(path)
    v = Validator(tok, tok.vocab_size, 2048, 16, 512, limits(defaults(), 2048), image_rules=rules_for(path))
    batch = hf_batch(path, IMAGES[:2], between="and then")
    messages = chat({"type": "image", "image": 0}, {"type": "text", "text": "and then"}, {"type": "image", "image": 1},
                    {"type": "text", "text": "what is it?"})
    req = v.generate(gen({"messages": messages, "images": 2}, IMAGES[:2]))
    ids = batch["input_ids"][0].tolist()
    assert req.prompt_token_ids == ids
    grids = [tuple(g) for g in batch["image_grid_thw"].tolist()]
    assert [im.meta["grid"] for im in req.admitted.images] == grids
    assert [(im.offset, im.length) for im in req.admitted.images] == \
        [(i.offset, i.length) for i in ridge_inputs(path, IMAGES[:2], ids)]
    raw = v.generate(gen({"prompt": f"look {RAW_MARKER} here", "images": 1}, IMAGES[:1]))
    (im,) = raw.admitted.images
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    want = ref(f"look {START}{PAD * im.length}{END} here", add_special_tokens=False)["input_ids"]
    assert raw.prompt_token_ids == want and im.length == grids[0][1] * grids[0][2] // MERGE ** 2
    eng = make_engine(load_model(path, device="cpu", weights="fp32", use_cache=False), prefill_chunk=64)
    eng.add_request("a", req.admitted)
    got = []
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
    assert got[:NEW] == greedy_hf(hf, batch)
