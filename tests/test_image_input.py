"""Images by every route (issue 42): the prompt's placeholders against transformers' processor,
the validator's refusals and its Admitted.images, the protocol's image frames, and each HTTP
dialect's image parts down to the daemon's refusal.

The model: a SmolVLM-shaped directory (config.json, preprocessor_config.json,
processor_config.json, a byte-level tokenizer with SmolVLM's special tokens and its chat
template), small tiles so that a test image makes several. The oracle for the token ids and
pixel values is transformers' Idefics3Processor, built from the same files. No network."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ridge.daemon import protocol as P
from ridge.errors import InvalidRequest
from ridge.request import MAX_IMAGES
from ridge.vision.prompt import RAW_MARKER, read_prompt_rules

SMOLVLM_TEMPLATE = (  # SmolVLMProcessor's DEFAULT_CHAT_TEMPLATE
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
IMAGE_SPECIALS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                  + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
SEQ_LEN = 4  # image tokens per tile
PREPROCESSOR = {"do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True,
                "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "image_processor_type": "SmolVLMImageProcessor", "max_image_size": {"longest_edge": 32},
                "processor_class": "SmolVLMProcessor", "resample": 1, "rescale_factor": 1 / 255,
                "size": {"longest_edge": 96}}


def write_prompt_model(d: Path) -> Path:
    """The files a SmolVLM directory holds for its prompts (no weights: the validator needs none)."""
    from tiny_models import SPECIALS, tiny_vocab
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    tokens, _, merges = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS + IMAGE_SPECIALS)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": SMOLVLM_TEMPLATE, "bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>",
        "add_bos_token": False}))
    image_id = tok.token_to_id("<image>")
    (d / "config.json").write_text(json.dumps({"model_type": "smolvlm", "image_token_id": image_id}))
    (d / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (d / "processor_config.json").write_text(json.dumps({"image_seq_len": SEQ_LEN,
                                                         "processor_class": "SmolVLMProcessor"}))
    return d


def png(w: int, h: int, seed: int = 0) -> bytes:
    px = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_prompt_model(tmp_path_factory.mktemp("smolvlm"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from ridge.tokenizer import Tokenizer
    return Tokenizer.from_hf_dir(model_dir)


@pytest.fixture(scope="module")
def hf_processor(model_dir):
    import transformers as T
    ip = T.Idefics3ImageProcessorPil(**{k: v for k, v in PREPROCESSOR.items()
                                        if k not in ("image_processor_type", "processor_class")})
    tok = T.PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return T.Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=SEQ_LEN)


# -- the prompt's placeholders (ridge/vision/prompt.py) ------------------------------------------------------
@pytest.mark.parametrize("sizes", [[(100, 70)], [(20, 30)], [(100, 70), (31, 90)]])
def test_placeholders_equal_transformers_processor(model_dir, tokenizer, hf_processor, sizes):
    from ridge.vision.prompt import place
    rules = read_prompt_rules(model_dir)
    datas = [png(w, h, i) for i, (w, h) in enumerate(sizes)]
    pics = [Image.open(io.BytesIO(b)).convert("RGB") for b in datas]
    text = "look " + " then ".join("<image>" for _ in pics) + " now"
    ref = hf_processor(text=text, images=[pics])
    expanded = [rules.expand(im) for im in pics]
    pieces = text.split("<image>")
    ours_text = pieces[0] + "".join(e.text + p for e, p in zip(expanded, pieces[1:]))
    ids = tokenizer.encode(ours_text, add_special_tokens=True)
    assert ids == list(ref["input_ids"][0])
    placed = place(ids, expanded, rules.image_token_id)
    k = 0
    for i, e in enumerate(expanded):
        one = hf_processor.image_processor(pics[i])["pixel_values"][0]
        assert len(e.inputs) == len(one)
        for j, inp in enumerate(placed[k:k + len(e.inputs)]):
            np.testing.assert_array_equal(inp.pixel_values, one[j])
            assert inp.length == SEQ_LEN and set(ids[inp.offset:inp.end]) == {rules.image_token_id}
            assert ids[inp.offset - 1] != rules.image_token_id and ids[inp.end] != rules.image_token_id
        k += len(e.inputs)
    assert [p.offset for p in placed] == sorted(p.offset for p in placed)
    assert len({p.content for p in placed}) == len(placed)  # each tile its own encoder input


def test_a_text_model_directory_has_no_image_rules(tmp_path):
    assert read_prompt_rules(tmp_path) is None
    assert read_prompt_rules(None) is None


def test_text_spelling_the_image_token_is_refused(model_dir, tokenizer):
    from ridge.vision.prompt import place
    rules = read_prompt_rules(model_dir)
    e = rules.expand(Image.new("RGB", (20, 20), (1, 2, 3)))
    ids = tokenizer.encode("<image> spelled " + e.text)
    with pytest.raises(InvalidRequest, match="must not spell the image token"):
        place(ids, [e], rules.image_token_id)


# -- the validator ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def validator(model_dir, tokenizer):
    from ridge.daemon.cli.config import defaults
    from ridge.daemon.cli.serve import limits
    from ridge.daemon.frontend.images import rules_for
    from ridge.daemon.frontend.validate import Validator
    return Validator(tokenizer, tokenizer.vocab_size, 2048, 16, 512, limits(defaults(), 2048),
                     image_rules=rules_for(model_dir))


def gen(body: dict, frames=(), v: int = P.VERSION) -> P.Envelope:
    return P.envelope({"v": v, "type": "generate", "id": "g", **body}, list(frames))


def refusal(validator, body, frames=()) -> P.ProtocolError:
    with pytest.raises(P.ProtocolError) as e:
        validator.generate(gen(body, frames))
    return e.value


def chat(*parts, role="user") -> list[dict]:
    return [{"role": role, "content": list(parts)}]


def test_a_chat_image_part_fills_admitted_images(validator, tokenizer, model_dir, hf_processor):
    data = png(100, 70, 3)
    messages = chat({"type": "text", "text": "what is "}, {"type": "image", "image": 0},
                    {"type": "text", "text": " here?"})
    req = validator.generate(gen({"messages": messages, "images": 1}, [data]))
    ids, imgs = req.prompt_token_ids, req.admitted.images
    rules = read_prompt_rules(model_dir)
    # the oracle: the template rendered by transformers, expanded by its processor
    hf_messages = [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "image"},
                                               {"type": "text", "text": " here?"}]}]
    text = hf_processor.tokenizer.apply_chat_template(hf_messages, chat_template=SMOLVLM_TEMPLATE, tokenize=False,
                                                      add_generation_prompt=True)
    ref = hf_processor(text=text, images=[[Image.open(io.BytesIO(data)).convert("RGB")]], add_special_tokens=False)
    assert ids == list(ref["input_ids"][0])
    assert len(imgs) == len(ref["pixel_values"][0]) > 1
    runs = [i for i in range(len(ids)) if ids[i] == rules.image_token_id and ids[i - 1] != rules.image_token_id]
    assert [im.offset for im in imgs] == runs and all(im.length == SEQ_LEN for im in imgs)
    for im, px in zip(imgs, ref["pixel_values"][0]):
        np.testing.assert_array_equal(im.pixel_values, px)


def test_two_images_in_two_messages_and_a_raw_prompt(validator):
    a, b = png(20, 30, 1), png(100, 40, 2)
    messages = (chat({"type": "image", "image": 1}, {"type": "text", "text": "first"})
                + [{"role": "assistant", "content": "a cat"}]
                + chat({"type": "text", "text": "and"}, {"type": "image", "image": 0}))
    req = validator.generate(gen({"messages": messages, "images": 2}, [a, b]))
    one_a = validator.generate(gen({"prompt": f"x {RAW_MARKER} y", "images": 1}, [a])).admitted.images
    one_b = validator.generate(gen({"prompt": f"x {RAW_MARKER} y", "images": 1}, [b])).admitted.images
    # in the prompt's order: image 1 (b) first, then image 0 (a)
    assert [i.content for i in req.admitted.images] == [i.content for i in one_b + one_a]
    offsets = [i.offset for i in req.admitted.images]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)


def test_image_tokens_count_against_the_context(model_dir, tokenizer):
    from ridge.daemon.cli.config import defaults
    from ridge.daemon.cli.serve import limits
    from ridge.daemon.frontend.images import rules_for
    from ridge.daemon.frontend.validate import Validator
    small = Validator(tokenizer, tokenizer.vocab_size, 40, 16, 64, limits(defaults(), 40),
                      image_rules=rules_for(model_dir))
    e = refusal(small, {"prompt": f"{RAW_MARKER}", "images": 1}, [png(100, 70)])  # 7 tiles of 4 tokens, and more
    assert e.code == P.INVALID_REQUEST and "tokens" in e.message and "context" in e.message


def _bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (30_000, 30_000)).save(buf, "PNG")  # 30,000^2 declared in a small file
    return buf.getvalue()


def _huge() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buf, "PNG")
    return buf.getvalue()


BAD_IMAGES = {  # name -> (bytes, what the refusal names)
    "bomb": (_bomb, "pixels"),
    "truncated": (lambda: png(64, 64)[:300], "truncated"),
    "unknown format": (lambda: b"%PDF-1.4 not an image at all" * 4, "accepted format"),
    "1x1": (lambda: png(1, 1), "at least 4 pixels"),
    "20000x20000": (_huge, "50000000 pixels"),  # refused by its header, before a pixel is decoded
}


@pytest.mark.parametrize("name", sorted(BAD_IMAGES))
def test_bad_images_are_refused_by_their_bound(validator, name):
    make, words = BAD_IMAGES[name]
    e = refusal(validator, {"prompt": RAW_MARKER, "images": 1}, [make()])
    assert e.code == P.INVALID_REQUEST and e.message.startswith("images[0]: ") and words in e.message, e.message


def test_image_fields_that_do_not_fit_are_refused(validator):
    a = png(20, 20)
    cases = [
        ({"prompt": "no marker", "images": 1}, [a], RAW_MARKER),
        ({"prompt": f"{RAW_MARKER}{RAW_MARKER}", "images": 1}, [a], "2 image marker"),
        ({"prompt": "x <image> " + RAW_MARKER, "images": 1}, [a], "must not spell the image token"),
        ({"prompt_token_ids": [1, 2], "images": 1}, [a], "not prompt_token_ids"),
        ({"messages": chat({"type": "text", "text": "hi"}), "images": 1}, [a], "image 0 is named by none"),
        ({"messages": chat({"type": "image", "image": 1}), "images": 1}, [a], "indexing the request's 1 image"),
        ({"messages": chat({"type": "image", "image": 0}, role="assistant"), "images": 1}, [a], "user messages"),
        ({"messages": chat({"type": "text", "text": "<image>"}, {"type": "image", "image": 0}), "images": 1}, [a],
         "must not spell the marker"),
    ]
    for body, frames, words in cases:
        e = refusal(validator, body, frames)
        assert words in e.message, (body, e.message)
    # a text-only part array is a chat message like any other
    assert validator.generate(gen({"messages": chat({"type": "text", "text": "hi"})})).admitted.images == ()


def test_a_text_model_refuses_images_by_name(tmp_path):
    from tiny_models import write_tokenizer_files

    from ridge.daemon.cli.config import defaults
    from ridge.daemon.cli.serve import limits
    from ridge.daemon.frontend.images import rules_for
    from ridge.daemon.frontend.validate import Validator
    from ridge.tokenizer import Tokenizer
    write_tokenizer_files(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    v = Validator(tok, tok.vocab_size, 64, 16, 8, limits(defaults(), 64), image_rules=rules_for(tmp_path))
    e = refusal(v, {"prompt": RAW_MARKER, "images": 1}, [png(20, 20)])
    assert (e.code, e.message) == (P.INVALID_REQUEST, "images: this model takes no image input")


# -- the protocol's image frames ------------------------------------------------------------------------------
def test_image_frames_are_checked_against_the_message():
    a = png(20, 20)
    env = gen({"prompt": RAW_MARKER, "images": 1}, [a])
    assert env.frames == [a] and env.body["images"] == 1
    cases = [
        (lambda: gen({"prompt": "x", "images": 2}, [a]), P.BAD_FRAME, "says 2"),
        (lambda: gen({"prompt": "x"}, [a]), P.BAD_FRAME, "says None"),
        (lambda: gen({"prompt": "x", "images": 1}, [a], v=4), P.BAD_FRAME, "from version 5"),
        (lambda: P.envelope({"v": 5, "type": "tokenize", "id": "t", "text": "x"}, [a]), P.BAD_FRAME, "tokenize"),
        (lambda: gen({"prompt": "x", "images": MAX_IMAGES + 1}, [a] * (MAX_IMAGES + 1)), P.INVALID_FIELD, "at most"),
        (lambda: gen({"prompt": "x", "images": 1}, [b"x" * (P.MAX_IMAGE_FRAME_BYTES + 1)]), P.TOO_LARGE, "limit"),
    ]
    for make, code, words in cases:
        with pytest.raises(P.ProtocolError) as e:
            make()
        assert e.value.code == code and words in e.value.message, e.value.message


def test_the_frame_bound_is_the_decoders():
    from ridge.vision.decode import ImageLimits
    assert P.MAX_IMAGE_FRAME_BYTES == ImageLimits().max_bytes


def test_the_clients_send_images_as_frames():
    from ridge.daemon.client import generate_message, message_frames
    a, b = png(20, 20, 1), png(30, 20, 2)
    msg = generate_message("g", prompt=f"{RAW_MARKER}{RAW_MARKER}", stream=False, params={"images": [a, b],
                                                                                      "max_tokens": 3})
    frames = message_frames(msg)
    assert frames[1:] == [a, b]
    body = P.unpack(frames[0], 1 << 20)
    P.check_plain(body)  # no binary inside the map
    env = P.envelope(body, frames[1:])
    assert env.body["images"] == 2 and env.frames == [a, b] and env.body["params"] == {"max_tokens": 3}


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


# -- through a running daemon and its gateway ------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A tiny text model whose directory also holds SmolVLM's image files: its validator takes images
    (decoded, bounded, refused), its engine never sees one, since every image here is refused."""
    from tiny_models import make_tiny
    from tokenizers import Tokenizer

    tmp = tmp_path_factory.mktemp("image-routes")
    model, _, _ = make_tiny(tmp, "llama", fmt="hf")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.add_special_tokens(IMAGE_SPECIALS)
    tok.save(str(model / "tokenizer.json"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "image_token_id": tok.token_to_id("<image>")}))
    (model / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (model / "processor_config.json").write_text(json.dumps({"image_seq_len": SEQ_LEN}))
    d = serve_both(tmp, model, 64)
    yield d
    d.stop()


def serve_both(tmp: Path, model: Path, blocks: int):
    """`ridge serve` of `model` with the OpenAI and Anthropic APIs (d.url) and Ollama's (d.ollama)."""
    from test_daemon_harness import Daemon
    from test_gateway import free_port, wait_http

    http, ollama = free_port(), free_port()
    d = Daemon(tmp, str(model), "--num-kv-blocks", blocks, "--kv-host-gib", "0.05", "--no-kv-disk",
               "--http", f"127.0.0.1:{http}", "--ollama", f"127.0.0.1:{ollama}", "--served-model-name", "tiny")
    d.url, d.ollama = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{ollama}"
    wait_http(d.url)
    wait_http(d.ollama)
    return d


def still_serving(d) -> None:
    from ridge.daemon.client import Client
    with Client(d.endpoint, timeout=60) as c:
        assert c.generate("the", max_tokens=2, temperature=0).token_ids


@pytest.mark.parametrize("name", sorted(BAD_IMAGES))
def test_the_protocol_client_is_told_the_bound_and_the_daemon_serves_on(daemon, name):
    from ridge.daemon.client import Client, RidgeError
    make, words = BAD_IMAGES[name]
    with Client(daemon.endpoint, timeout=60) as c:
        with pytest.raises(RidgeError) as e:
            c.generate(f"see {RAW_MARKER}", images=[make()], max_tokens=2)
    assert e.value.code == P.INVALID_REQUEST and words in e.value.message, e.value.message
    still_serving(daemon)


def api_cases(bad_url: str) -> dict:
    """Each API's body with one image, given as `bad_url` (a URL) or its base64 (Anthropic, Ollama)."""
    b64 = bad_url.split(",", 1)[1] if bad_url.startswith("data:") else bad_url
    text = {"type": "text", "text": "what is this?"}
    source = ({"type": "base64", "media_type": "image/png", "data": b64} if bad_url.startswith("data:")
              else {"type": "url", "url": bad_url})
    return {
        "openai": ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": bad_url}}]}]}),
        "anthropic": ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image", "source": source}, text]}]}),
        "responses": ("/v1/responses", {"model": "tiny", "max_output_tokens": 2, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "what?"},
                                         {"type": "input_image", "image_url": bad_url}]}]}),
        "ollama-chat": ("/api/chat", {"model": "tiny", "stream": False, "options": {"num_predict": 2}, "messages": [
            {"role": "user", "content": "what?", "images": [b64]}]}),
        "ollama-generate": ("/api/generate", {"model": "tiny", "stream": False, "options": {"num_predict": 2},
                                              "prompt": "what?", "images": [b64]}),
    }


def _status(daemon, api: str, path: str, body: dict) -> tuple[int, str]:
    from test_gateway import post
    resp = post(daemon.ollama if api.startswith("ollama") else daemon.url, path, body)
    out = json.loads(resp.read())
    resp.close(), resp.conn.close()
    err = out.get("error")
    return resp.status, err if isinstance(err, str) else (err or {}).get("message", json.dumps(out))


BAD_URLS = {  # the image given -> what the 400 says
    "remote": ("https://example.com/cat.png", "remote image URLs are refused"),
    "bomb": (data_url(_bomb()), "pixels"),
    "truncated": (data_url(png(64, 64)[:300]), "truncated"),
    "not base64": ("data:image/png;base64,@@@@", "malformed"),
    "1x1": (data_url(png(1, 1)), "at least 4 pixels"),
}


@pytest.mark.parametrize("case", sorted(BAD_URLS))
@pytest.mark.parametrize("api", ["openai", "anthropic", "responses", "ollama-chat", "ollama-generate"])
def test_every_api_refuses_a_bad_image_with_the_reason(daemon, api, case):
    url, words = BAD_URLS[case]
    if case == "remote" and api.startswith("ollama"):
        words = "malformed"  # Ollama's images are base64 only: a URL is not
    path, body = api_cases(url)[api]
    status, message = _status(daemon, api, path, body)
    assert status == 400 and words in message, (status, message)


def test_the_daemon_serves_on_after_the_refusals(daemon):
    still_serving(daemon)
    from test_gateway import post
    resp = post(daemon.url, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "the"}]}]})
    assert resp.status == 200 and json.loads(resp.read())["choices"][0]["finish_reason"] == "length"


def test_openapi_describes_the_image_parts(daemon):
    import urllib.request
    with urllib.request.urlopen(daemon.url + "/openapi.json", timeout=30) as r:
        spec = json.loads(r.read())
    names = set(spec["components"]["schemas"])
    assert {"ImageUrlPart", "ImageBlock", "InputImage"} <= names, sorted(names)


# -- the tiny SmolVLM checkpoint (tests/vlm_models.py) --------------------------------------------------------
@pytest.mark.parametrize("kind", ["smolvlm", "idefics3"])
def test_the_tiny_checkpoints_prompt_equals_transformers(tmp_path, kind):
    """A data URL as the gateway passes it on, validated against the tiny checkpoint's own files:
    the ids and Admitted.images' offsets, lengths and pixels equal Idefics3Processor's."""
    import transformers as T
    from vlm_models import IMAGE_SEQ_LEN, PREPROCESSOR as VLM_PREPROCESSOR, write_tiny_smolvlm

    from ridge.daemon.cli.config import defaults
    from ridge.daemon.cli.serve import limits
    from ridge.daemon.frontend.images import rules_for
    from ridge.daemon.frontend.validate import Validator
    from ridge.tokenizer import Tokenizer
    from ridge.vision.decode import parse_data_url

    d = write_tiny_smolvlm(tmp_path / kind, kind)
    tok = Tokenizer.from_hf_dir(d)
    v = Validator(tok, tok.vocab_size, 2048, 16, 512, limits(defaults(), 2048), image_rules=rules_for(d))
    data = parse_data_url(data_url(png(150, 90, 7)))
    messages = chat({"type": "image", "image": 0}, {"type": "text", "text": "what is it?"})
    req = v.generate(gen({"messages": messages, "images": 1}, [data]))
    hf = T.Idefics3Processor(image_processor=T.Idefics3ImageProcessorPil(**VLM_PREPROCESSOR),
                             tokenizer=T.PreTrainedTokenizerFast.from_pretrained(str(d)), image_seq_len=IMAGE_SEQ_LEN)
    text = hf.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": "what is it?"}]}], chat_template=(d / "chat_template.jinja").read_text(),
        tokenize=False, add_generation_prompt=True)
    ref = hf(text=text, images=[[Image.open(io.BytesIO(data)).convert("RGB")]], add_special_tokens=False)
    ids, token = req.prompt_token_ids, json.loads((d / "config.json").read_text())["image_token_id"]
    assert ids == list(ref["input_ids"][0])
    starts = [i for i, t in enumerate(ids) if t == token and ids[i - 1] != token]
    imgs = req.admitted.images
    assert [im.offset for im in imgs] == starts and {im.length for im in imgs} == {IMAGE_SEQ_LEN}
    assert len(imgs) == len(ref["pixel_values"][0]) > 1
    for im, px in zip(imgs, ref["pixel_values"][0]):
        np.testing.assert_array_equal(im.pixel_values, px)


# -- the CLI --------------------------------------------------------------------------------------------------
def ridge(daemon, *args, stdin: str | None = None):
    import subprocess
    import sys
    from test_daemon_harness import ROOT
    return subprocess.run([sys.executable, "-P", "-m", "ridge.cli", *args, "--endpoint", daemon.endpoint],
                          input=stdin, capture_output=True, text=True, env=daemon.env, cwd=ROOT, timeout=120)


def test_ridge_generate_sends_each_image(daemon, tmp_path):
    (tmp_path / "a.png").write_bytes(png(20, 20))
    (tmp_path / "tiny.png").write_bytes(png(1, 1))
    out = ridge(daemon, "generate", "what?", "--image", str(tmp_path / "a.png"), "--image", str(tmp_path / "tiny.png"))
    assert out.returncode == 1 and "images[1]: image is 1x1" in out.stderr, out.stderr
    out = ridge(daemon, "generate", "what?", "--raw", "--image", str(tmp_path / "a.png"))
    assert out.returncode == 1 and f"mark each image's place with {RAW_MARKER}" in out.stderr, out.stderr
    out = ridge(daemon, "generate", "what?", "--image", str(tmp_path / "missing.png"))
    assert out.returncode == 2 and "missing.png" in out.stderr
    still_serving(daemon)


def test_ridge_chat_attaches_an_image_to_the_next_message(daemon, tmp_path):
    (tmp_path / "tiny.png").write_bytes(png(2, 2))
    out = ridge(daemon, "chat", "--max-tokens", "4", stdin=f"/image {tmp_path / 'tiny.png'}\nwhat is it?\nthe\n/exit\n")
    assert "attached to your next message" in out.stdout
    assert "images[0]: image is 2x2" in out.stderr, out.stderr  # the refusal of the message it went with
    assert out.returncode == 0 and out.stderr.count("ridge:") == 1  # the next message, without it, is answered


# -- remote image URLs, when the operator allows them -----------------------------------------------------------
@pytest.fixture(scope="module")
def picture_server():
    """A loopback HTTP server of two images: /tiny.png (2x2) and /big.png (over the fetch cap)."""
    import http.server
    import threading

    from ridge.vision.decode import ImageLimits
    files = {"/tiny.png": png(2, 2), "/big.png": b"\x89PNG" + b"\0" * ImageLimits().max_bytes}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_allow_image_urls_fetches_with_a_size_cap(daemon, picture_server):
    from test_gateway import free_port, post, wait_http

    from ridge.daemon.gateway.run import GatewayThread, listen
    from ridge.daemon.gateway.settings import gateway_settings
    settings = gateway_settings({"http": f"127.0.0.1:{free_port()}", "allow_image_urls": True})
    gateway = GatewayThread(settings, daemon.endpoint, listen(settings))
    gateway.start()
    try:
        wait_http(settings.url)
        for name, status, words in [("tiny.png", 400, "images[0]: image is 2x2"),  # fetched: the daemon's refusal
                                    ("big.png", 400, "the limit"), ("missing.png", 400, "could not be fetched")]:
            path, body = api_cases(f"{picture_server}/{name}")["openai"]
            resp = post(settings.url, path, body)
            out = json.loads(resp.read())
            resp.close(), resp.conn.close()
            assert resp.status == status and words in out["error"]["message"], out
    finally:
        gateway.stop()
    still_serving(daemon)


def test_an_image_frame_larger_than_a_message_frame_arrives(daemon):
    """A 5 MB image (past 4 x max_frame_bytes, ZeroMQ's frame bound before images) is read and
    refused by its size, not dropped with the connection."""
    from ridge.daemon.client import Client, RidgeError
    data = png(17_000, 100, 5)
    assert len(data) > 4 << 20
    with Client(daemon.endpoint, timeout=60) as c:
        with pytest.raises(RidgeError) as e:
            c.generate(RAW_MARKER, images=[data], max_tokens=2)
    assert "at most 16384 pixels" in e.value.message
    still_serving(daemon)


def test_count_tokens_says_it_does_not_count_images(daemon):
    path, body = api_cases(data_url(png(20, 20)))["anthropic"]
    body = {k: v for k, v in body.items() if k != "max_tokens"}
    status, message = _status(daemon, "anthropic", path + "/count_tokens", body)
    assert status == 400 and "does not count images" in message, message


def test_image_seq_len_is_the_encoders_rows(tmp_path):
    """Without processor_config.json's image_seq_len, the vision config's rows a tile; a value that
    disagrees with them is refused by name (the placeholders would not be the encoder's rows)."""
    from ridge.vision.pixels import PreprocessorConfigError
    d = write_prompt_model(tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "scale_factor": 2,
                                               "vision_config": {"image_size": 32, "patch_size": 4}}))
    (d / "processor_config.json").write_text("{}")
    assert read_prompt_rules(d).images.image_seq_len == 16
    (d / "processor_config.json").write_text(json.dumps({"image_seq_len": SEQ_LEN}))
    with pytest.raises(PreprocessorConfigError, match="image_seq_len=4.*16 rows"):
        read_prompt_rules(d)


def test_a_family_without_prompt_rules_refuses_images_naming_why(tmp_path, tokenizer):
    from ridge.daemon.cli.config import defaults
    from ridge.daemon.cli.serve import limits
    from ridge.daemon.frontend.images import rules_for
    from ridge.daemon.frontend.validate import Validator
    # every image processor ridge reads has prompt rules: one it does not read stands for a family without
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "SiglipImageProcessor"}))
    v = Validator(tokenizer, tokenizer.vocab_size, 64, 16, 8, limits(defaults(), 64), image_rules=rules_for(tmp_path))
    e = refusal(v, {"prompt": RAW_MARKER, "images": 1}, [png(20, 20)])
    assert e.code == P.INVALID_REQUEST and e.message.startswith("images: this model takes no image input: ")
    assert "image_processor_type='SiglipImageProcessor'" in e.message and "Qwen2VLImageProcessor" in e.message
    assert v.generate(gen({"prompt": "the"})).admitted.images == ()  # its text is served
