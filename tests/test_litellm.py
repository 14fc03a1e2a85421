"""litellm (the real package, pinned in requirements.lock) against `ridge serve --http --ollama` on a
tiny random model, as its users point it at a local server (issue 43): its `ollama/` provider
(Ollama's /api/generate, with the prompt litellm writes from the messages), its `ollama_chat/`
provider (/api/chat), both plain and streamed, which send their JSON with no Content-Type; and its
OpenAI-compatible provider (`openai/` with api_base) on the OpenAI listener. Each answer is checked
against the same request sent by the official `ollama` or `openai` client, greedy, token for token."""
from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches its price list at import

import litellm  # noqa: E402
import ollama  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from litellm.litellm_core_utils.prompt_templates.factory import ollama_pt  # noqa: E402

from test_daemon_harness import Daemon  # noqa: E402
from test_gateway import free_port, wait_http  # noqa: E402
from tiny_models import make_tiny  # noqa: E402

KEY = "litellm-key"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
N = 6


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("litellm")
    model, _, _ = make_tiny(tmp, "llama")
    http, olla = free_port(), free_port()
    d = Daemon(tmp, str(model), "--num-kv-blocks", 128, "--http", f"127.0.0.1:{http}",
               "--ollama", f"127.0.0.1:{olla}", "--served-model-name", "tiny", "--api-key", KEY)
    d.url, d.ollama = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{olla}"
    wait_http(d.url)
    wait_http(d.ollama)
    yield d
    d.stop()


def client(daemon) -> ollama.Client:
    return ollama.Client(host=daemon.ollama, timeout=60, headers={"Authorization": f"Bearer {KEY}"})


GREEDY = {"temperature": 0, "num_predict": N}


def streamed(chunks) -> tuple[str, str | None]:
    text, finish = "", None
    for c in chunks:
        text += c.choices[0].delta.content or ""
        finish = c.choices[0].finish_reason or finish
    return text, finish


def on_ollama(daemon) -> dict:
    """litellm's arguments for the Ollama listener, greedy: its key goes as Authorization: Bearer."""
    return dict(api_base=daemon.ollama, api_key=KEY, temperature=0, max_tokens=N)


def test_ollama_provider_generates(daemon):
    """`ollama/`: the messages become one prompt (litellm's ollama_pt) sent to /api/generate."""
    prompt = ollama_pt(model="tiny", messages=CHAT)
    prompt = prompt["prompt"] if isinstance(prompt, dict) else prompt
    want = client(daemon).generate(model="tiny", prompt=prompt, options=GREEDY)
    got = litellm.completion(model="ollama/tiny", messages=CHAT, **on_ollama(daemon))
    assert want.response and want.eval_count <= N  # a random model's six tokens: some text to compare
    assert got.choices[0].message.content == want.response
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.prompt_eval_count, want.eval_count)
    text, _ = streamed(litellm.completion(model="ollama/tiny", messages=CHAT, stream=True, **on_ollama(daemon)))
    assert text == want.response
    done = litellm.text_completion(model="ollama/tiny", prompt="hello there", **on_ollama(daemon))
    assert done.choices[0].text == client(daemon).generate(model="tiny", prompt="hello there", options=GREEDY).response


def test_ollama_chat_provider_chats(daemon):
    """`ollama_chat/`: the messages as they are, to /api/chat."""
    want = client(daemon).chat(model="tiny", messages=CHAT, options=GREEDY)
    got = litellm.completion(model="ollama_chat/tiny", messages=CHAT, **on_ollama(daemon))
    assert want.message.content and got.choices[0].message.content == want.message.content
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.prompt_eval_count, want.eval_count)
    assert got.choices[0].finish_reason == {"stop": "stop", "length": "length"}[want.done_reason]
    text, finish = streamed(litellm.completion(model="ollama_chat/tiny", messages=CHAT, stream=True,
                                               **on_ollama(daemon)))
    assert (text, finish) == (want.message.content, got.choices[0].finish_reason)


def test_openai_compatible_provider(daemon):
    """`openai/` with api_base: ridge's OpenAI listener, its API key in the Authorization header."""
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    want = oai.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=N)
    kw = dict(model="openai/tiny", messages=CHAT, api_base=daemon.url + "/v1", api_key=KEY, temperature=0,
              max_tokens=N)
    got = litellm.completion(**kw)
    assert want.choices[0].message.content and got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage.completion_tokens == want.usage.completion_tokens
    assert streamed(litellm.completion(**kw, stream=True)) == (want.choices[0].message.content,
                                                               want.choices[0].finish_reason)
    with pytest.raises(litellm.AuthenticationError):
        litellm.completion(**{**kw, "api_key": "wrong"}, num_retries=0)
