"""An image through each client package: the `openai`, `anthropic` and `ollama` packages send
one image and a question to `ridge serve --http --ollama` on the tiny SmolVLM
(tests/vlm_models.py), and get the answer the daemon gives its own protocol client for the same
image and words, greedy. Needs the engine's encoder step (ridge/engine/encoder.py) and the
SmolVLM family (ridge/models/idefics3/)."""
from __future__ import annotations

import base64

import anthropic
import ollama
import openai
import pytest

from ridge.daemon.client import Client
from test_image_input import png, serve_both
from vlm_models import write_tiny_smolvlm

QUESTION, MAX_TOKENS = "what is it?", 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("image-answers")
    d = serve_both(tmp, write_tiny_smolvlm(tmp / "smolvlm"), 256)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def image() -> bytes:
    return png(150, 90, 11)


@pytest.fixture(scope="module")
def own(daemon, image) -> str:
    """The daemon's own greedy answer: the protocol client, the image as a frame."""
    with Client(daemon.endpoint, timeout=120) as c:
        f = c.generate(messages=[{"role": "user", "content": [{"type": "image", "image": 0},
                                                               {"type": "text", "text": QUESTION}]}],
                       images=[image], max_tokens=MAX_TOKENS, temperature=0)
    assert f.text
    return f.text


def test_the_image_reaches_the_model(daemon, image, own):
    """Another picture, the same words: another answer (the encoder's rows, not the placeholders',
    are what the model reads)."""
    with Client(daemon.endpoint, timeout=120) as c:
        other = c.generate(messages=[{"role": "user", "content": [{"type": "image", "image": 0},
                                                                   {"type": "text", "text": QUESTION}]}],
                           images=[png(150, 90, 12)], max_tokens=MAX_TOKENS, temperature=0)
    assert other.text != own


def test_openai_package(daemon, image, own):
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    c = oai.chat.completions.create(model="tiny", max_tokens=MAX_TOKENS, temperature=0,
                                    messages=[{"role": "user", "content": [
                                        {"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": QUESTION}]}])
    assert c.choices[0].message.content == own


def test_anthropic_package(daemon, image, own):
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)
    m = claude.messages.create(model="tiny", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": [
                                   {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                "data": base64.b64encode(image).decode()}},
                                   {"type": "text", "text": QUESTION}]}])
    assert "".join(b.text for b in m.content if b.type == "text") == own


def test_ollama_package(daemon, image, own):
    out = ollama.Client(host=daemon.ollama, timeout=120).chat(
        model="tiny", messages=[{"role": "user", "content": QUESTION, "images": [image]}],
        options={"temperature": 0, "num_predict": MAX_TOKENS, "repeat_penalty": 1.0, "top_k": 0, "top_p": 1.0})
    assert out.message.content == own


def test_anthropic_streamed_with_an_image(daemon, image, own):
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)
    with claude.messages.stream(model="tiny", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": [
                                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                 "data": base64.b64encode(image).decode()}},
                                    {"type": "text", "text": QUESTION}]}]) as s:
        assert "".join(s.text_stream) == own
