"""Images in the engine (issue 42): the encoder runs as part of a request's prefill, its rows
replace the placeholders, its output is cached by content, and the prefix cache names an image's
blocks by the image. Oracle: transformers' SmolVLM (Idefics3) on the processor's own input, greedy."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from engine_utils import make_engine
from ridge.engine.admit import Admitted
from ridge.engine.sampling_params import SamplingParams
from ridge.errors import InvalidRequest
from ridge.models.loader import load_model
from ridge.vision import Idefics3Images, decode_image
from ridge.vision.inputs import ImageInput, image_hash
from vlm_models import IMAGE, IMAGE_SEQ_LEN, vlm_vocab, write_tiny_smolvlm

NEW = 12


def png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    px = rng.integers(0, 256, (h, w, 3)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px, "RGB").save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = write_tiny_smolvlm(tmp_path_factory.mktemp("vlm"), "smolvlm", seed=3)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    proc = transformers.AutoProcessor.from_pretrained(str(path))
    loaded = load_model(path, device="cpu", weights="fp32", use_cache=False)
    return path, hf, proc, loaded


def prompt(proc, images: list[bytes], question: str = "What is in the picture?"):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return proc(text=text, images=[[Image.open(io.BytesIO(d)) for d in images]], return_tensors="pt")


def admitted(path, proc, images: list[bytes], ids: list[int], params) -> Admitted:
    """The request as the daemon's input processing hands it over: one ImageInput per tile, at its
    run of <image> tokens (the processor's prompt), pixels by ridge's own preprocessing."""
    cfg = proc.image_processor.to_dict()
    pre = Idefics3Images.from_config({k: v for k, v in cfg.items() if k in _preprocessor_keys(path)},
                                     image_seq_len=IMAGE_SEQ_LEN)
    tiles = [t for d in images for t in pre.preprocess(decode_image(d)).pixel_values]
    image_id = vlm_vocab().index(IMAGE)
    starts = [i for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != image_id)]
    assert len(starts) == len(tiles)
    inputs = tuple(ImageInput(image_hash(t, "idefics3"), t, s, IMAGE_SEQ_LEN) for s, t in zip(starts, tiles))
    return Admitted(ids, params, inputs)


def _preprocessor_keys(path) -> set:
    import json
    return set(json.loads((path / "preprocessor_config.json").read_text()))


def greedy_hf(hf, batch) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**batch, max_new_tokens=NEW, do_sample=False)
    return out[0, batch["input_ids"].shape[1]:].tolist()


def run(engine, requests: dict) -> dict:
    for rid, adm in requests.items():
        engine.add_request(rid, adm)
    got = {rid: [] for rid in requests}
    cached = {}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                cached[o.request_id] = o.num_cached_tokens
    return got, cached


def params() -> SamplingParams:
    return SamplingParams(max_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("chunk", [512, 13])
def test_greedy_with_images_equals_transformers(vlm, chunk):
    """Two images in one prompt (22 tiles, each its own run of placeholders), in one prefill and in
    chunks of 13 that cut the runs anywhere."""
    path, hf, proc, loaded = vlm
    images = [png(100, 70, 0), png(30, 61, 1)]
    batch = prompt(proc, images)
    ids = batch["input_ids"][0].tolist()
    want = greedy_hf(hf, batch)
    eng = make_engine(loaded, prefill_chunk=chunk, enable_prefix_caching=False)
    got, _ = run(eng, {"a": admitted(path, proc, images, ids, params())})
    assert got["a"] == want


def test_the_same_image_again_hits_the_caches_and_another_never_does(vlm):
    """The same image and question again: a prefix hit past the image's blocks and no encoder
    run; a different image of the same size (equal placeholder tokens): its blocks never hit
    past the text before it, and its answer is its own (transformers')."""
    path, hf, proc, loaded = vlm
    eng = make_engine(loaded, prefill_chunk=64)
    one, two = png(64, 64, 5), png(64, 64, 6)
    b1, b2 = prompt(proc, [one]), prompt(proc, [two])
    ids1, ids2 = b1["input_ids"][0].tolist(), b2["input_ids"][0].tolist()
    assert ids1 == ids2  # the placeholders alone cannot tell the images apart
    first, _ = run(eng, {"first": admitted(path, proc, [one], ids1, params())})
    enc = eng.runner.encoder.cache
    misses = enc.misses
    again, cached = run(eng, {"again": admitted(path, proc, [one], ids1, params())})
    assert again["again"] == first["first"] == greedy_hf(hf, b1)
    block = eng.config.block_size
    image_id = vlm_vocab().index(IMAGE)
    last_image = max(i for i, t in enumerate(ids1) if t == image_id)
    assert cached["again"] >= (last_image + 1) // block * block > 0
    assert enc.misses == misses  # every tile whose rows the step still needed came from the cache
    other, cached = run(eng, {"other": admitted(path, proc, [two], ids2, params())})
    first_image = min(i for i, t in enumerate(ids2) if t == image_id)
    assert cached["other"] <= first_image // block * block
    assert other["other"] == greedy_hf(hf, b2)


def test_an_image_on_a_text_model_is_refused(tmp_path_factory):
    from engine_utils import load_tiny
    eng = make_engine(load_tiny(tmp_path_factory, "text-only"))
    tile = np.zeros((3, 32, 32), np.float32)
    with pytest.raises(InvalidRequest, match="images: this model takes no image input"):
        eng.add_request("x", Admitted([5] * 20, params(), (ImageInput(image_hash(tile), tile, 2, 16),)))
