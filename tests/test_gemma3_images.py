"""Gemma 3 with images (ridge/models/gemma3/vision.py, bidirectional image attention): a tiny
random Gemma3ForConditionalGeneration built by transformers 5.25 (a 2-layer SigLIP on 64-pixel
pictures of 8-pixel patches pooled to 16 tokens, a 4-layer Gemma 3 text model whose sliding
window of 8 is shorter than any image run plus its prompt), saved as an HF directory with its
tokenizer and processor files. The oracles are transformers' own: get_image_features for the
tower and projector, the wrapper's logits and generate on Gemma3Processor's input (its
token_type_ids make each image's tokens attend each other both ways), pan-and-scan off and on."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from engine_utils import make_engine
from test_engine_images import greedy_hf, params, run
from test_idefics3 import assert_fp8_tower, on_ridge_weights
from ridge.bench.vision import png
from ridge.cache.kv_cache import KVCache
from ridge.engine.admit import Admitted
from ridge.kernels.metadata import AttentionMetadata
from ridge.models.gemma3.vision import load_vision
from ridge.models.loader import load_model
from ridge.quant.errors import ModelLoadError
from ridge.vision import decode_image
from ridge.vision.gemma3 import Gemma3Images
from ridge.vision.inputs import ImageInput, image_hash
from tiny_models import SPECIALS, tiny_vocab

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
SIDE, PATCH, TOKENS = 64, 8, 16  # 8 x 8 patches pooled 2 x 2: 16 image tokens a picture
VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=2, image_size=SIDE, patch_size=PATCH, vision_use_head=False)
TEXT = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, sliding_window_pattern=2,
            max_position_embeddings=1024, rope_local_base_freq=100.0, query_pre_attn_scalar=16)
PREPROCESSOR = {
    "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor", "do_convert_rgb": None,
    "do_normalize": True, "do_rescale": True, "do_resize": True, "rescale_factor": 1 / 255, "resample": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "size": {"height": SIDE, "width": SIDE},
    # null, as the Hub's files: Gemma3Processor's values (min crop 256, at most 4 crops, ratio 1.2)
    "image_seq_length": TOKENS, "do_pan_and_scan": None, "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
}


def vocab() -> list[str]:
    return tiny_vocab()[0] + [BOI, IMAGE, EOI]


def write_tokenizer(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, _, merges = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS + [BOI, IMAGE, EOI]])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "add_bos_token": False, "model_max_length": 1024,
        "extra_special_tokens": {"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}}))


def write_tiny_gemma3(path: Path, seed: int = 0, text: dict = TEXT) -> Path:
    v = vocab()
    cfg = transformers.Gemma3Config(text_config={**text, "vocab_size": len(v) + 5}, vision_config=VISION,
                                    mm_tokens_per_image=TOKENS, image_token_index=v.index(IMAGE),
                                    boi_token_index=v.index(BOI), eoi_token_index=v.index(EOI))
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.15)
    model.save_pretrained(str(path))
    write_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                            "image_seq_length": TOKENS}))
    return path


WIDE = png(700, 300, 1)  # pan-and-scan: 2 crops of 350 x 300 (each side at least the minimum 256)
SQUARE = png(70, 64, 2)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = write_tiny_gemma3(tmp_path_factory.mktemp("gemma3-vlm"), seed=4)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    proc = transformers.AutoProcessor.from_pretrained(str(path))
    loaded = load_model(path, device="cpu", weights="fp32", use_cache=False)
    return path, hf, proc, loaded


def processor_inputs(proc, images: list[bytes], pan_and_scan: bool, question: str = " What is it?", before: str = ""):
    text = "<|im_start|>user\n" + before + "".join(BOI for _ in images) + question + "<|im_end|>\n"
    return proc(text=text, images=[[Image.open(io.BytesIO(d)) for d in images]], return_tensors="pt",
                do_pan_and_scan=pan_and_scan)


def image_inputs(images: list[bytes], ids: list[int], pan_and_scan: bool) -> list[ImageInput]:
    """ridge's preprocessing of each image (whole, then its crops), one ImageInput per picture at
    its run of image tokens in ids, in order."""
    pre = Gemma3Images.from_config(PREPROCESSOR, pan_and_scan=pan_and_scan)
    pictures = [p for d in images for p in pre.preprocess(decode_image(d)).pixel_values]
    image_id = vocab().index(IMAGE)
    starts = [i for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != image_id)]
    assert len(starts) == len(pictures)
    return [ImageInput(image_hash(p, f"gemma3|{pan_and_scan}"), p, s, TOKENS) for s, p in zip(starts, pictures)]


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_the_processor_agrees_with_ridges_preprocessing(gemma3, pan_and_scan):
    _, _, proc, _ = gemma3
    batch = processor_inputs(proc, [WIDE, SQUARE], pan_and_scan)
    ids = batch["input_ids"][0].tolist()
    inputs = image_inputs([WIDE, SQUARE], ids, pan_and_scan)
    assert len(inputs) == (4 if pan_and_scan else 2)  # the square is never cropped
    np.testing.assert_allclose(batch["pixel_values"].numpy(), np.stack([i.pixel_values for i in inputs]),
                               rtol=0, atol=1e-6)
    # token_type_ids mark exactly the image runs
    types = batch["token_type_ids"][0].tolist()
    assert [i for i, t in enumerate(types) if t] == [p for i in inputs for p in range(i.offset, i.end)]


def test_encode_matches_get_image_features(gemma3):
    """Every picture (two images, pan-and-scan on: 4 pictures, one forward) against transformers'
    tower and projector on the same pixels, in fp32; one alone gives the rows it gives in a batch."""
    path, hf, proc, _ = gemma3
    batch = processor_inputs(proc, [WIDE, SQUARE], True)
    inputs = image_inputs([WIDE, SQUARE], batch["input_ids"][0].tolist(), True)
    vision = load_vision(path, "cpu", torch.float32)
    got = vision.encode(inputs)
    assert [tuple(g.shape) for g in got] == [(TOKENS, TEXT["hidden_size"])] * 4
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.from_numpy(np.stack([i.pixel_values for i in inputs])))
    assert_close(torch.stack(got), ref.pooler_output)
    assert_close(vision.encode(inputs[2:3])[0], got[2])
    with pytest.raises(ValueError, match="15 placeholder tokens for a picture worth 16"):
        vision.encode([ImageInput("x", inputs[0].pixel_values, 0, 15)])


def test_the_tower_in_bf16(gemma3):
    """Weights and activations in bf16 (the GPU's dtype): the fp32 rows to bf16's precision."""
    path, _, proc, loaded = gemma3
    batch = processor_inputs(proc, [SQUARE], False)
    inputs = image_inputs([SQUARE], batch["input_ids"][0].tolist(), False)
    got = load_vision(path, "cpu", torch.bfloat16).encode(inputs)[0]
    ref = loaded.vision.encode(inputs)[0]
    assert got.dtype == torch.bfloat16
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_encode_in_fp8_matches_get_image_features_on_ridges_weights(gemma3):
    """weights "fp8": the tower's Linears and the projector's product are e4m3 (per-output-channel
    scales); the rows equal transformers' on a copy holding those dequantized weights."""
    path, hf, proc, _ = gemma3
    vision = load_vision(path, "cpu", torch.float32, weights="fp8")
    proj = vision.multi_modal_projector.proj
    assert_fp8_tower(vision, proj, hf.model.multi_modal_projector.mm_input_projection_weight.T)
    batch = processor_inputs(proc, [WIDE, SQUARE], True)
    inputs = image_inputs([WIDE, SQUARE], batch["input_ids"][0].tolist(), True)
    pixels = torch.from_numpy(np.stack([i.pixel_values for i in inputs]))
    got = torch.stack(vision.encode(inputs))
    with torch.no_grad():
        ref = on_ridge_weights(hf, vision).model.get_image_features(pixels).pooler_output
        plain = hf.model.get_image_features(pixels).pooler_output
    assert_close(got, ref)
    assert not torch.allclose(got, plain, rtol=0, atol=1e-6)
    assert vision.weight_bytes() < load_vision(path, "cpu", torch.float32).weight_bytes()


def test_greedy_in_fp8_through_the_engine_equals_transformers_on_ridges_weights(gemma3):
    """load_model(weights="fp8"): tower, projector and decoder in e4m3; two images (pan-and-scan:
    4 pictures) in one prefill, greedy against transformers' generate on ridge's dequantized weights."""
    path, hf, proc, _ = gemma3
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False)
    assert lm.vision.multi_modal_projector.proj.is_fp8
    batch = processor_inputs(proc, [WIDE, SQUARE], True)
    ids = batch["input_ids"][0].tolist()
    eng = make_engine(lm, prefill_chunk=512, enable_prefix_caching=False)
    got, _ = run(eng, {"a": Admitted(ids, params(), tuple(image_inputs([WIDE, SQUARE], ids, True)))})
    assert got["a"] == greedy_hf(on_ridge_weights(hf, lm.vision, lm), batch)


def test_vision_refusals_name_the_field(gemma3, tmp_path):
    import shutil

    path, _, _, _ = gemma3
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    for key, value, named in [("vision_config", {**cfg["vision_config"], "hidden_act": "relu"},
                               "vision_config.hidden_act='relu'"),
                              ("vision_config", {**cfg["vision_config"], "patch_size": 7},
                               "vision_config.patch_size=7"),
                              ("mm_tokens_per_image", 9, "mm_tokens_per_image=9")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ModelLoadError, match=named.replace("[", r"\[")):
            load_vision(tmp_path, "cpu", torch.float32)


def logits_with_images(model, ids: list[int], inputs: list[ImageInput], vision) -> torch.Tensor:
    """ridge's text model over the prompt in one step, the encoder's rows in place of the
    placeholders, each image's run bidirectional (AttentionMetadata.spans)."""
    n, bs = len(ids), 16
    nb = math.ceil(n / bs)
    cache = KVCache(model.cfg, nb, bs, "fp32", torch.device("cpu"))
    meta = AttentionMetadata.build([n], [n], [list(range(nb))], list(range(n)), torch.device("cpu"),
                                   spans=[[(i.offset, i.end) for i in inputs]])
    rows = torch.cat([torch.arange(i.offset, i.end) for i in inputs])
    embeds = (rows, torch.cat(vision.encode(inputs)))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, cache.layers, embeds=embeds))


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_logits_with_images_match_transformers(gemma3, pan_and_scan):
    """Two images (pan-and-scan on: the wide one as itself and 2 crops), runs of 16 tokens under a
    sliding window of 8: every position's logits against the wrapper's on the processor's input."""
    path, hf, proc, loaded = gemma3
    assert loaded.config.image_attention_bidirectional and loaded.vision is not None
    batch = processor_inputs(proc, [WIDE, SQUARE], pan_and_scan)
    ids = batch["input_ids"][0].tolist()
    got = logits_with_images(loaded.model, ids, image_inputs([WIDE, SQUARE], ids, pan_and_scan), loaded.vision)
    with torch.no_grad():
        ref = hf(**batch).logits[0]
    assert_close(got, ref)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() == 1.0


@pytest.mark.parametrize("pan_and_scan", [False, True])
@pytest.mark.parametrize("chunk", [512, 10])
def test_greedy_equals_transformers(gemma3, pan_and_scan, chunk):
    """In one prefill, and in chunks of 10 that would cut every run of 16: the scheduler keeps
    each image whole (a chunk ends before a run, or takes all of it)."""
    path, hf, proc, loaded = gemma3
    batch = processor_inputs(proc, [WIDE, SQUARE], pan_and_scan)
    ids = batch["input_ids"][0].tolist()
    eng = make_engine(loaded, prefill_chunk=chunk, enable_prefix_caching=False)
    got, _ = run(eng, {"a": Admitted(ids, params(), tuple(image_inputs([WIDE, SQUARE], ids, pan_and_scan)))})
    assert got["a"] == greedy_hf(hf, batch)


def test_the_same_image_again_hits_the_prefix_cache(gemma3):
    """The same image and question again: a prefix hit past the image; the same image with
    another question: the hit ends inside the image's last block, and is cut back to the block
    where its run starts; both answers are transformers'."""
    path, hf, proc, loaded = gemma3
    bs = 16
    eng = make_engine(loaded, prefill_chunk=24, block_size=bs)
    b1 = processor_inputs(proc, [SQUARE], True, before="Look at this:")
    b2 = processor_inputs(proc, [SQUARE], True, " Say more.", before="Look at this:")
    ids1, ids2 = b1["input_ids"][0].tolist(), b2["input_ids"][0].tolist()
    in1, in2 = image_inputs([SQUARE], ids1, True), image_inputs([SQUARE], ids2, True)
    first, _ = run(eng, {"first": Admitted(ids1, params(), tuple(in1))})
    again, cached = run(eng, {"again": Admitted(ids1, params(), tuple(in1))})
    assert again["again"] == first["first"] == greedy_hf(hf, b1)
    assert cached["again"] >= in1[-1].end // bs * bs > 0
    # the image's last block also holds text the new question changes: the hit ends inside the run
    a, b = in2[0].offset, in2[0].end
    differs = next(i for i, (x, y) in enumerate(zip(ids1, ids2)) if x != y)
    assert a // bs < b // bs and b % bs and differs < (b // bs + 1) * bs and a >= bs
    other, cached = run(eng, {"other": Admitted(ids2, params(), tuple(in2))})
    assert cached["other"] == a // bs * bs
    assert other["other"] == greedy_hf(hf, b2)


def test_the_step_grows_to_hold_an_image(gemma3):
    """Steps of 6 tokens (chunks of 4, 2 sequences) under images of 16 that go into one step whole:
    the engine sizes its step for the image (Gemma 3's image_seq_length), and answers as
    transformers does."""
    path, hf, proc, loaded = gemma3
    eng = make_engine(loaded, prefill_chunk=4, max_num_seqs=2, enable_prefix_caching=False)
    assert eng.scheduler.config.max_num_batched_tokens == TOKENS
    batch = processor_inputs(proc, [SQUARE], False)
    ids = batch["input_ids"][0].tolist()
    got, _ = run(eng, {"x": Admitted(ids, params(), tuple(image_inputs([SQUARE], ids, False)))})
    assert got["x"] == greedy_hf(hf, batch)


def test_the_scheduler_keeps_each_image_run_whole():
    """Chunks of 10 under a 40-token step over a 60-token prompt whose image inputs lie at [5, 21),
    [21, 37) (side by side: one run, as transformers numbers them) and [40, 56): each chunk that
    would end inside a run ends before it, or takes the whole run where the run starts it."""
    from ridge.cache.manager import KVCacheManager
    from ridge.engine.request import Request
    from ridge.engine.scheduler import Scheduler, SchedulerConfig

    px = np.zeros((3, 2, 2), np.float32)
    images = (ImageInput("a", px, 5, 16), ImageInput("b", px, 21, 16), ImageInput("c", px, 40, 16))
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=40, long_prefill_token_threshold=10, block_size=8,
                          max_model_len=256, whole_image_runs=True)
    sched = Scheduler(cfg, KVCacheManager(64, 8))
    assert sched.refuse_images(images) is None
    sched.add_request(Request("r", list(range(3, 63)), params(), (2,), images=images))
    chunks = []
    for _ in range(5):
        (s,) = sched.schedule().scheduled
        chunks.append((s.start, s.num_scheduled_tokens))
    assert chunks == [(0, 5), (5, 32), (37, 3), (40, 16), (56, 4)]
    small = Scheduler(SchedulerConfig(2, 20, 10, 8, 256, whole_image_runs=True), KVCacheManager(64, 8))
    assert "an image of 32 tokens, more than the 20 tokens of one step" in small.refuse_images(images)


def test_config_fields_are_declared():
    """Every field of Gemma3Config and of SiglipVisionConfig read (with transformers' default) or
    declared ignored."""
    import dataclasses

    from ridge.models.gemma3.config import WRAPPER_DEFAULTS, WRAPPER_IGNORED, WRAPPER_READ
    from ridge.models.gemma3.vision import VISION_DEFAULTS, VISION_IGNORED
    from ridge.quant.hf_config import BASE_IGNORED

    fields = {f.name: f.default for f in dataclasses.fields(transformers.Gemma3Config)}
    assert not set(fields) - WRAPPER_READ - WRAPPER_IGNORED - BASE_IGNORED
    assert {k: fields[k] for k in WRAPPER_DEFAULTS} == WRAPPER_DEFAULTS
    vfields = {f.name: f.default for f in dataclasses.fields(transformers.SiglipVisionConfig)}
    assert not set(vfields) - set(VISION_DEFAULTS) - VISION_IGNORED - BASE_IGNORED
    assert {k: vfields[k] for k in VISION_DEFAULTS} == VISION_DEFAULTS


# The daemon's side: Gemma 3's prompt rules (ridge/vision/prompt.py) against Gemma3Processor.
CHAT_TEMPLATE = (  # Gemma 3's: one <start_of_image> per image part, in this vocabulary's turns
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def variant(path: Path, dest: Path, pre: dict | None = None, **config) -> Path:
    """The fixture's model in `dest` (links) with the chat template, and preprocessor_config.json
    or config.json changed."""
    dest.mkdir()
    for f in path.iterdir():
        if f.name not in ("preprocessor_config.json", "config.json"):
            (dest / f.name).symlink_to(f)
    (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (dest / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, **(pre or {})}))
    (dest / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), **config}))
    return dest


@pytest.fixture(scope="module")
def rules(gemma3, tmp_path_factory):
    """pan_and_scan -> (the prompt rules ridge reads from the directory, its Gemma3Processor).
    The rules take do_pan_and_scan from preprocessor_config.json, as Gemma3ImageProcessor does;
    Gemma3Processor puts its own default (off) over the file's, so the oracle is told per call."""
    from ridge.vision.prompt import read_prompt_rules

    path = gemma3[0]
    out = {}
    for pan in (False, True):
        d = variant(path, tmp_path_factory.mktemp("rules") / "model", {"do_pan_and_scan": pan})
        out[pan] = read_prompt_rules(d), transformers.AutoProcessor.from_pretrained(str(d))
    return out


@pytest.mark.parametrize("pan_and_scan", [False, True])
@pytest.mark.parametrize("images", [[WIDE], [WIDE, SQUARE]])
def test_the_prompt_rules_expand_as_gemma3_processor(rules, images, pan_and_scan):
    """The chat's markers expanded by ridge (the daemon's expand_markers), tokenized: the
    processor's ids; place() puts one input per picture (the image, then its crops) at each run of
    image tokens, with the processor's pixels and a content hash of them."""
    from ridge.daemon.frontend.images import expand_markers
    from ridge.vision.prompt import Gemma3Prompt, place

    ours, proc = rules[pan_and_scan]
    assert isinstance(ours, Gemma3Prompt) and ours.image_token_id == vocab().index(IMAGE)
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look:"}]
             + [{"type": "image"} for _ in images] + [{"type": "text", "text": " What is it?"}]}]
    text = proc.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.count(BOI) == len(images)
    pictures = [Image.open(io.BytesIO(d)) for d in images]
    want = proc(text=text, images=[pictures], return_tensors="pt", do_pan_and_scan=pan_and_scan)
    expanded = [ours.expand(decode_image(d)) for d in images]
    ids = proc.tokenizer(expand_markers(text, ours.marker, expanded, False, None))["input_ids"]
    assert ids == want["input_ids"][0].tolist()
    placed = place(ids, expanded, ours.image_token_id)
    assert len(placed) == len(want["pixel_values"]) == len(images) + (2 if pan_and_scan else 0)  # WIDE: 2 crops
    types = want["token_type_ids"][0].tolist()
    runs = [i for i, t in enumerate(types) if t and (i == 0 or not types[i - 1])]
    assert [p.offset for p in placed] == runs and all(p.length == TOKENS for p in placed)
    assert [i for i, t in enumerate(types) if t] == [k for p in placed for k in range(p.offset, p.end)]
    np.testing.assert_allclose(np.stack([p.pixel_values for p in placed]), want["pixel_values"].numpy(),
                               rtol=0, atol=1e-6)
    assert [p.content for p in placed] == [image_hash(p.pixel_values, ours.how) for p in placed]
    assert len({p.content for p in placed}) == len(placed)


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_num_image_tokens_is_the_processors_count(rules, pan_and_scan):
    """From the size alone: the image tokens Gemma3Processor writes for a picture of that size
    (crops: 2 across, 2 down, 4 at most, none under the ratio or the minimum crop)."""
    ours, proc = rules[pan_and_scan]
    image_id = vocab().index(IMAGE)
    counts = []
    for w, h in [(700, 300), (300, 700), (1400, 300), (300, 280), (400, 300), (70, 64)]:
        ids = proc(text=f"x{BOI}", images=[[Image.new("RGB", (w, h), (9, 99, 199))]],
                   do_pan_and_scan=pan_and_scan)["input_ids"][0]
        counts.append(ours.num_image_tokens(h, w))
        assert counts[-1] == sum(t == image_id for t in ids), (w, h)
    assert counts == ([3 * TOKENS, 3 * TOKENS, 5 * TOKENS] if pan_and_scan else [TOKENS] * 3) + [TOKENS] * 3
    if not pan_and_scan:
        assert counts[0] == proc._get_num_multimodal_tokens(image_sizes=[[300, 700]]).num_image_tokens[0]


def test_the_prompt_rules_refuse_a_disagreement_by_name(gemma3, tmp_path):
    """processor_config.json's image_seq_length against config.json's mm_tokens_per_image, the
    image processor's size against the tower's, the tokenizer's ids against config.json's."""
    from ridge.vision.pixels import PreprocessorConfigError
    from ridge.vision.prompt import read_prompt_rules

    path = gemma3[0]
    cases = [(dict(mm_tokens_per_image=9), None, "image_seq_length"),
             ({}, {"image_seq_length": 9}, "image_seq_length"),
             ({}, {"size": {"height": 32, "width": 32}}, "size"),
             (dict(image_token_index=vocab().index(EOI)), None, "image_token_index"),
             (dict(boi_token_index=3), None, "boi_token_index")]
    for i, (config, pre, named) in enumerate(cases):
        d = variant(path, tmp_path / str(i), pre, **config)
        with pytest.raises(PreprocessorConfigError, match=named):
            read_prompt_rules(d)


def test_an_image_through_the_daemon_answers_as_transformers(gemma3, tmp_path):
    """`ridge serve` on the tiny model in fp32, the `openai` package sending a data: URL image
    (pan-and-scan on: the image and 2 crops) and a question: the answer's tokens, and their
    logprobs, are transformers' greedy generate's on Gemma3Processor's input."""
    import base64

    import openai

    from test_daemon_harness import Daemon
    from test_gateway import free_port, wait_http

    path, hf, _, _ = gemma3
    d = variant(path, tmp_path / "model", {"do_pan_and_scan": True})
    proc = transformers.AutoProcessor.from_pretrained(str(d))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is it?"}]}]
    batch = proc(text=proc.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                 images=[[Image.open(io.BytesIO(WIDE))]], return_tensors="pt", do_pan_and_scan=True)
    assert len(batch["pixel_values"]) == 3
    with torch.no_grad():
        out = hf.generate(**batch, max_new_tokens=8, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    want = out.sequences[0, batch["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(x[0], -1)[t].item() for x, t in zip(out.logits, want)]
    want = want[:want.index(proc.tokenizer.eos_token_id)] if proc.tokenizer.eos_token_id in want else want

    port = free_port()
    daemon = Daemon(tmp_path, str(d), "--weights", "fp32", "--kv-dtype", "fp32", "--num-kv-blocks", 64,
                    "--no-kv-disk", "--http", f"127.0.0.1:{port}", "--served-model-name", "tiny")
    try:
        wait_http(f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        url = "data:image/png;base64," + base64.b64encode(WIDE).decode()
        c = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, logprobs=True, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " What is it?"}]}])
    finally:
        daemon.stop()
    got = [e.token for e in c.choices[0].logprobs.content]
    assert got == [proc.tokenizer.decode([t]) for t in want] and len(got) == len(want) > 0
    assert c.choices[0].message.content == proc.tokenizer.decode(want)
    # the image's rows, not only its placeholders, reach the model: each token's logprob is the oracle's
    np.testing.assert_allclose([e.logprob for e in c.choices[0].logprobs.content], logprobs[:len(got)],
                               rtol=0, atol=1e-4)
