"""Gemma 4 with images (ridge/models/gemma4/vision.py): a tiny random Gemma4ForConditionalGeneration
built by transformers 5.25 (a 2-layer tower of 4-pixel patches pooled 2 x 2, with clipped linears
and the standardizing bias and scale; the per-layer-input, KV-shared text model of test_gemma4.py
whose sliding window of 16 is shorter than any image's run), saved as an HF directory with its
tokenizer and image processor files. The oracles are transformers': Gemma4ImageProcessor for the
patches, get_image_features for the tower and embedder, the wrapper's logits and generate on the
same prompt (its mm_token_type_ids make an image's tokens attend each other both ways on the
sliding layers, under use_bidirectional_attention "vision"), in fp64 where the tiny model's
sharpness puts transformers' fp32 itself near the budget (test_gemma4.py's _exact_logits)."""
from __future__ import annotations

import copy
import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from engine_utils import make_engine
from test_engine_images import greedy_hf, params, run
from test_families import BASE, V
from test_gemma3_images import png
from test_gemma4 import VARIANTS, _fields, draw_text_model
from test_idefics3 import assert_fp8_tower, on_ridge_weights
from ridge.cache.kv_cache import KVCache
from ridge.engine.admit import Admitted
from ridge.kernels.metadata import AttentionMetadata
from ridge.models.gemma4.vision import load_vision
from ridge.models.loader import load_model
from ridge.quant.errors import ModelLoadError
from ridge.vision import decode_image
from ridge.vision.prompt import Gemma4Prompt, place, read_prompt_rules

transformers = pytest.importorskip("transformers")

IMAGE_ID, BOI_ID, EOI_ID = V, V + 1, V + 2  # past the tiny vocabulary: tokens of their own
VOCAB = V + 5  # and the video and audio placeholders
BOI, IMAGE, EOI = "<|image>", "<|image|>", "<image|>"
PATCH, POOL, BUDGET = 4, 2, 70  # 280 patches at most: 70 soft tokens
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, patch_size=PATCH, pooling_kernel_size=POOL, position_embedding_size=40, standardize=True,
              use_clipped_linears=True)
PREPROCESSOR = {"image_processor_type": "Gemma4ImageProcessor", "processor_class": "Gemma4Processor",
                "patch_size": PATCH, "pooling_kernel_size": POOL, "max_soft_tokens": BUDGET, "do_resize": True,
                "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False, "resample": 3,
                "do_convert_rgb": True}


WIDE, TALL = png(90, 40, 1), png(30, 52, 2)


def write_tokenizer(path, vocab_size: int) -> None:
    """The tiny byte-level vocabulary with the three image tokens at their ids (test_families' V
    leaves them free), as tokenizer.json and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from tiny_models import SPECIALS, tiny_vocab

    tokens, _, merges = tiny_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split()) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    data = json.loads(tok.to_str())
    for text, i in ((IMAGE, IMAGE_ID), (BOI, BOI_ID), (EOI, EOI_ID)):
        assert len(tokens) <= i < vocab_size
        data["added_tokens"].append({"id": i, "content": text, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(data))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "extra_special_tokens": {"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI}}))


def build(path, bidirectional: str | None):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    fields = {**BASE, **_fields(VARIANTS["ple-kv-shared-window16"]), "vocab_size": VOCAB,
              "vocab_size_per_layer_input": VOCAB, "use_bidirectional_attention": bidirectional}
    text = transformers.AutoConfig.for_model("gemma4_text", **fields)
    config = Gemma4Config(text_config=text.to_dict(), vision_config=VISION, image_token_id=IMAGE_ID,
                          boi_token_id=BOI_ID, eoi_token_id=EOI_ID, video_token_id=V + 3, audio_token_id=V + 4)
    torch.manual_seed(3)
    model = Gemma4ForConditionalGeneration(config).eval()
    draw_text_model(model)
    with torch.no_grad():
        tower = model.model.vision_tower
        for name, p in tower.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.15)
        model.model.embed_vision.embedding_projection.weight.normal_(0.0, 0.15)
        tower.std_bias.normal_(0.0, 0.1)
        tower.std_scale.uniform_(0.5, 1.5)
        for m in tower.modules():  # bounds that bite: the activations run past 2 here
            if hasattr(m, "input_min"):
                m.input_min.fill_(-2.0)
                m.input_max.fill_(2.0)
                m.output_min.fill_(-1.5)
                m.output_max.fill_(1.5)
    model.save_pretrained(str(path))
    write_tokenizer(path, VOCAB)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return model


@pytest.fixture(scope="module", params=["vision", None], ids=["bidirectional", "causal"])
def gemma4(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4-vlm")
    hf = build(path, request.param)
    loaded = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    return path, hf, loaded


def prompt(path, images: list[bytes], question: str = " What is it?", before: str = "<|im_start|>user\n"):
    """The prompt as the chat template writes it (the image token per image), expanded by ridge's
    rule: -> (ids, the encoder inputs at their runs, transformers' inputs for the same prompt)."""
    from tokenizers import Tokenizer

    rules = read_prompt_rules(path)
    assert isinstance(rules, Gemma4Prompt)
    expanded = [rules.expand(decode_image(d)) for d in images]
    text = before + "".join(e.text for e in expanded) + question
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    inputs = place(ids, expanded, rules.image_token_id)
    return ids, list(inputs), hf_inputs(ids, images)


def hf_inputs(ids: list[int], images: list[bytes]) -> dict:
    """transformers' own image processor on the same images (padded to the budget, positions -1
    past each image's patches), and the processor's mm_token_type_ids."""
    ip = transformers.Gemma4ImageProcessor(**{k: v for k, v in PREPROCESSOR.items()
                                                if k not in ("image_processor_type", "processor_class")})
    out = ip([Image.open(io.BytesIO(d)).convert("RGB") for d in images], return_tensors="pt")
    t = torch.tensor([ids])
    return {"input_ids": t, "attention_mask": torch.ones_like(t), "pixel_values": out["pixel_values"],
            "image_position_ids": out["image_position_ids"], "mm_token_type_ids": (t == IMAGE_ID).long()}


def exact(hf) -> torch.nn.Module:
    return copy.deepcopy(hf).double()


def assert_close(got: torch.Tensor, ref: torch.Tensor, bound: float = 1e-5) -> None:
    err = ((got.double() - ref.double()).abs().max() / ref.abs().max()).item()
    assert err <= bound, f"relative error {err:.2e}"


def test_the_prompt_rule_and_patches_agree_with_transformers(gemma4):
    """Each image: <|image> + one image token per pooled cell + <image|>; its patches are
    Gemma4ImageProcessor's without the padding, its grid where the processor's positions say."""
    path, _, _ = gemma4
    ids, inputs, batch = prompt(path, [WIDE, TALL])
    assert len(inputs) == 2
    pos = batch["image_position_ids"]
    for k, inp in enumerate(inputs):
        rows, cols = inp.meta["grid"]
        mine = (pos[k] >= 0).all(-1)
        assert inp.length == rows * cols // POOL ** 2 == int(mine.sum()) // POOL ** 2
        np.testing.assert_allclose(inp.pixel_values, batch["pixel_values"][k][mine].numpy(), rtol=0, atol=1e-6)
        assert ids[inp.offset - 1] == BOI_ID and ids[inp.end] == EOI_ID
        assert set(ids[inp.offset:inp.end]) == {IMAGE_ID}
    assert sum(i == IMAGE_ID for i in ids) == sum(i.length for i in inputs)


@pytest.mark.parametrize("weights", ["fp32", "fp8"])
def test_encode_matches_get_image_features(gemma4, weights):
    """Two images of different grids against transformers' tower and embedder (padded to the
    budget there): fp32, and FP8 against transformers holding ridge's dequantized products."""
    path, hf, _ = gemma4
    _, inputs, batch = prompt(path, [WIDE, TALL])
    vision = load_vision(path, "cpu", torch.float32, weights=weights)
    got = torch.cat(vision.encode(inputs))
    ref_model = hf
    if weights == "fp8":
        q = vision.vision_tower.encoder.layers[0].self_attn.q_proj.linear
        assert_fp8_tower(vision, q, hf.model.vision_tower.encoder.layers[0].self_attn.q_proj.linear.weight)
        ref_model = on_ridge_weights(hf, vision)
    with torch.no_grad():
        ref = torch.cat(ref_model.model.get_image_features(batch["pixel_values"],
                                                          batch["image_position_ids"]).pooler_output)
    assert got.shape == ref.shape == (sum(i.length for i in inputs), BASE["hidden_size"])
    assert_close(got, ref)
    if weights == "fp8":
        with torch.no_grad():
            plain = torch.cat(hf.model.get_image_features(batch["pixel_values"],
                                                          batch["image_position_ids"]).pooler_output)
        assert not torch.allclose(got, plain, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="placeholder tokens for an image worth"):
        vision.encode([type(inputs[0])("x", inputs[0].pixel_values, 0, inputs[0].length - 1, inputs[0].meta)])


def logits_with_images(lm, ids: list[int], inputs) -> torch.Tensor:
    """ridge's text model over the prompt in one step, the encoder's rows in place of the
    placeholders; each image's run bidirectional on the sliding layers where the model says so."""
    model, n, bs = lm.model, len(ids), 16
    nb = math.ceil(n / bs)
    cache = KVCache(model.cfg, nb, bs, "fp32", torch.device("cpu"))
    spans = [[(i.offset, i.end) for i in inputs]]
    meta = AttentionMetadata.build([n], [n], [list(range(nb))], list(range(n)), torch.device("cpu"))
    meta.groups = tuple(AttentionMetadata.build([n], [n], [list(range(nb))], list(range(n)), torch.device("cpu"))
                        for _ in range(cache.num_groups - 1))
    windows = [g.window for g in model.cfg.kv_groups()]
    bidir = model.cfg.image_attention_bidirectional
    for g, m in enumerate((meta, *meta.groups)):
        m.spans = spans if bidir is True or (bidir and windows[g] is not None) else None
    rows = torch.cat([torch.arange(i.offset, i.end) for i in inputs])
    embeds = (rows, torch.cat(lm.vision.encode(inputs)))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, cache.layers, embeds=embeds))


def test_logits_with_images_match_transformers(gemma4):
    """Two images (runs of some 60 tokens under a window of 16) and text around them: every
    position's logits against the wrapper's, run in fp64."""
    path, hf, loaded = gemma4
    want = "sliding" if hf.config.text_config.use_bidirectional_attention == "vision" else False
    assert loaded.config.image_attention_bidirectional == want and loaded.vision is not None
    ids, inputs, batch = prompt(path, [WIDE, TALL])
    got = logits_with_images(loaded, ids, inputs)
    with torch.no_grad():
        ref = exact(hf)(**{k: v.double() if v.is_floating_point() else v for k, v in batch.items()}).logits[0]
    assert_close(got, ref)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() == 1.0


@pytest.mark.parametrize("chunk", [512, 80])
def test_greedy_through_the_engine_equals_transformers(gemma4, chunk):
    """In one prefill, and in chunks of 80 that would cut the second image's run: the scheduler
    keeps each image whole where the runs are bidirectional."""
    path, hf, loaded = gemma4
    ids, inputs, batch = prompt(path, [WIDE, TALL])
    eng = make_engine(loaded, prefill_chunk=chunk, enable_prefix_caching=False)
    got, _ = run(eng, {"a": Admitted(ids, params(), tuple(inputs))})
    assert got["a"] == greedy_hf(exact(hf), {k: v.double() if v.is_floating_point() else v for k, v in batch.items()})


def test_the_same_image_again_skips_the_encoder_and_hits_the_prefix(gemma4):
    path, hf, loaded = gemma4
    ids, inputs, _ = prompt(path, [TALL])
    eng = make_engine(loaded, prefill_chunk=512, block_size=16)
    first, _ = run(eng, {"first": Admitted(ids, params(), tuple(inputs))})
    enc = eng.runner.encoder.cache
    misses = enc.misses
    again, cached = run(eng, {"again": Admitted(ids, params(), tuple(inputs))})
    assert again["again"] == first["first"]
    assert cached["again"] >= inputs[-1].end // 16 * 16 > 0
    assert enc.misses == misses


def test_vision_refusals_name_the_field(gemma4, tmp_path):
    import shutil

    path, _, _ = gemma4
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    v = cfg["vision_config"]
    for key, value, named in [("hidden_activation", "relu", "vision_config.hidden_activation='relu'"),
                              ("num_key_value_heads", 3, "vision_config.num_key_value_heads=3"),
                              ("rope_parameters", {"rope_type": "default", "rope_theta": 100.0},
                               "vision_config.rope_parameters"),
                              ("head_dim", 6, "vision_config.head_dim=6")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "vision_config": {**v, key: value}}))
        with pytest.raises(ModelLoadError, match=named.replace("[", r"\[")):
            load_vision(tmp_path, "cpu", torch.float32)
