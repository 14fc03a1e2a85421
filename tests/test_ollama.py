"""Ollama's API (`ridge serve --ollama`), end to end through the real `ollama`
package: a tiny chat model with a Hermes template (tools, thinking) on a
live daemon with its Ollama listener. At temperature 0 every answer is what
the daemon's own `generate` gives for the same chat, so the translation is
checked, not only the shapes. /api/embed is tested in test_embeddings.py, on
its embedding daemon's Ollama listener, against transformers.

The same daemon holds a reranker (test_rerank.py's tiny qwen3, a config.toml
entry with pooling = "rank"), loaded on request: the daemon's `rerank` and
/v1/rerank (on the listener's OpenAI routes) against transformers' score."""
from __future__ import annotations

import json
import time

import ollama
import pytest

from chat_models import make_chat_model
from ridge.daemon.client import Client
from ridge.daemon.gateway.ollama_api import PINNED, keep_alive
from ridge.daemon.frontend.registry import config_entries
from ridge.daemon.gateway.openai_api import ApiError
from ridge.durations import wire_duration
from test_daemon_harness import Daemon, Raw
from test_gateway import ask, free_port, wait_http
from test_rerank import DOCS, QUERY, ranker, reference  # noqa: F401  ranker: the fixture, built here too

GREEDY = {"temperature": 0, "num_predict": 12}
# Ollama's own defaults, which its route applies when a request leaves them out (a Modelfile's).
OLLAMA_PENALTY = {"repetition_penalty": 1.1, "repeat_last_n": 64}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]


def ollama_daemon(tmp, model: str, name: str, *flags) -> Daemon:
    port = free_port()
    d = Daemon(tmp, model, *flags, "--ollama", f"127.0.0.1:{port}", "--served-model-name", name)
    d.url = f"http://127.0.0.1:{port}"
    wait_http(d.url)
    return d


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, ranker):
    """The chat model as the default, "tiny"; the same files as "other" in the models directory; the
    reranker as "ranker", an entry of config.toml."""
    tmp = tmp_path_factory.mktemp("ollama")
    model = make_chat_model(tmp, "hermes")
    (tmp / "models").mkdir()
    (tmp / "xdg-config" / "ridge").mkdir(parents=True)
    # "other" by config.toml: a link in the models directory that leads out of it is not served
    (tmp / "xdg-config" / "ridge" / "config.toml").write_text(
        f'[models.other]\npath = "{model}"\n\n'
        f'[models.ranker]\npath = "{ranker[1]}"\npooling = "rank"\nweights = "fp32"\nkv_dtype = "fp32"\n'
        'num_kv_blocks = 128\n')
    d = ollama_daemon(tmp, str(model), "tiny", "--num-kv-blocks", 256, "--max-num-seqs", 8,
                      "--models-dir", tmp / "models")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=daemon.url, timeout=60)


@pytest.fixture(scope="module")
def ridge(daemon):
    c = Client(daemon.endpoint, timeout=60)
    yield c
    c.close()


def direct(ridge, messages, **params):
    """The daemon's own answer, greedy, to the same chat, with Ollama's default repeat penalty."""
    return ridge.generate(messages=messages, **{"max_tokens": 12, "temperature": 0, **OLLAMA_PENALTY, **params})


def test_chat_whole_and_streamed_are_the_daemons_answer(client, ridge):
    want = direct(ridge, CHAT)
    whole = client.chat(model="tiny", messages=CHAT, options=GREEDY)
    assert whole.message.role == "assistant" and whole.done and whole.done_reason == want.finish_reason
    assert whole.message.content == want.text and (whole.message.thinking or "") == want.reasoning
    assert whole.eval_count == want.usage["completion_tokens"] and whole.prompt_eval_count == want.usage[
        "prompt_tokens"]
    assert whole.total_duration > 0 and whole.model == "tiny"
    parts = list(client.chat(model="tiny:latest", messages=CHAT, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == want.text
    assert parts[-1].eval_count == want.usage["completion_tokens"] and parts[-1].done_reason == whole.done_reason


def test_generate_renders_the_template_unless_raw(client, ridge):
    want = direct(ridge, CHAT)
    got = client.generate(model="tiny", prompt="hello there", system="Be brief.", options=GREEDY)
    assert got.response == want.text and got.done
    raw = ridge.generate("Once upon", max_tokens=12, temperature=0, **OLLAMA_PENALTY)
    assert client.generate(model="tiny", prompt="Once upon", raw=True, options=GREEDY).response == raw.text
    streamed = list(client.generate(model="tiny", prompt="Once upon", raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == raw.text and streamed[-1].done
    loaded = client.generate(model="tiny", prompt="")  # an empty prompt only loads the model
    assert loaded.done and loaded.done_reason == "load"


def test_options_stop_seed_and_think(client, ridge):
    want = direct(ridge, CHAT, stop=["e"], seed=3)
    got = client.chat(model="tiny", messages=CHAT, options={**GREEDY, "stop": ["e"], "seed": 3})
    assert got.message.content == want.text
    sampled = direct(ridge, CHAT, temperature=0.8, top_k=40, top_p=0.9, seed=7)  # Ollama's defaults
    assert client.chat(model="tiny", messages=CHAT, options={"num_predict": 12, "seed": 7}).message.content == \
        sampled.text
    off = direct(ridge, CHAT, chat_template_kwargs={"enable_thinking": False})
    got = client.chat(model="tiny", messages=CHAT, options=GREEDY, think=False)
    assert got.message.content == off.text and (got.message.thinking or "") == off.reasoning


def test_format_constrains_the_output_to_the_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    got = client.chat(model="tiny", messages=CHAT, format=schema, options={"temperature": 0, "num_predict": 40})
    assert isinstance(json.loads(got.message.content)["ok"], bool)
    any_json = client.generate(model="tiny", prompt="hi", format="json", options={"temperature": 0, "num_predict": 40})
    assert isinstance(json.loads(any_json.response), dict)


def test_tool_history_renders_as_the_openai_chat_does(client, ridge):
    tools = [{"type": "function", "function": {"name": "weather", "description": "the weather",
                                               "parameters": {"type": "object", "properties": {"city": {
                                                   "type": "string"}}}}}]
    history = [{"role": "user", "content": "weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather",
                                                                                 "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "content": "sunny", "tool_name": "weather"}]
    openai_shape = [history[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1_0", "name": "weather"}]
    want = direct(ridge, openai_shape, tools=tools)
    got = client.chat(model="tiny", messages=history, tools=tools, options=GREEDY)
    assert got.message.content == want.text
    assert [c.function.name for c in got.message.tool_calls or []] == [c["name"] for c in want.tool_calls]


def test_models_tags_ps_show_and_version(client, daemon):
    tags = client.list()
    assert [m.model for m in tags.models] == ["tiny", "other", "ranker"] and tags.models[0].details.family == "llama"
    # where the files are, their sizes and times are the daemon owner's to see, not an HTTP client's
    assert tags.models[1].size == tags.models[0].size == 0 and tags.models[0].digest != tags.models[1].digest
    running = client.ps()
    assert [m.model for m in running.models] == ["tiny"] and running.models[0].size > 0
    shown = client.show("tiny")
    assert set(shown.capabilities) == {"completion", "tools", "thinking"}
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] > 0
    assert client.show("other").capabilities == ["completion"]  # its template is read when it loads
    assert client.show("other").modelfile == "FROM other\n"
    status, body = ask(daemon.url, "GET", "/api/version")
    assert status == 200 and body["version"].count(".") == 2
    status, body = ask(daemon.url, "GET", "/v1/models")  # the OpenAI routes beside, as Ollama serves them
    assert status == 200 and body["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("call, status, words", [
    (lambda c: c.chat(model="nope", messages=CHAT), 404, "model 'nope' not found"),
    (lambda c: c.show("nope"), 404, "not found"),
    (lambda c: c.chat(model="tiny", messages=CHAT, options={"num_ctx": 1 << 30}), 400, "num_ctx"),
    (lambda c: c.chat(model="tiny", messages=CHAT, options={"mirostat": 3}), 400, "mirostat"),
    (lambda c: c.chat(model="tiny", messages=CHAT, keep_alive="soon"), 400, "keep_alive"),
    (lambda c: c.chat(model="tiny", messages=CHAT, options={"num_predict": 0}), 400, "num_predict"),
    (lambda c: c.embed(model="tiny", input="x"), 400, "embedding"),
])
def test_refusals_are_ollamas_error_shape(client, call, status, words):
    with pytest.raises(ollama.ResponseError) as e:
        call(client)
    assert e.value.status_code == status and words in e.value.error


def test_an_empty_prompt_loads_and_keep_alive_0_unloads(client):
    """Ollama's preload (an empty prompt) and `ollama stop` (keep_alive 0), on the daemon's registry."""
    assert client.generate(model="other", prompt="", keep_alive="1m").done_reason == "load"
    held = {m.model: m for m in client.ps().models}
    assert "other" in held and 30 < (held["other"].expires_at.timestamp() - time.time()) <= 60
    assert set(client.show("other").capabilities) == {"completion", "tools", "thinking"}  # loaded: its template
    assert client.chat(model="other", messages=[], keep_alive=0).done_reason == "unload"
    deadline = time.monotonic() + 20
    while "other" in [m.model for m in client.ps().models]:
        assert time.monotonic() < deadline, "keep_alive 0 did not unload the model"
        time.sleep(0.1)


def test_keep_alive_reads_gos_durations():
    assert keep_alive("5m") == 300 and keep_alive("1h30m") == 5400 and keep_alive("1.5s") == 1.5
    assert keep_alive(0) == 0 and keep_alive("0") == 0 and keep_alive(-1) == PINNED and keep_alive("-1m") == PINNED
    assert keep_alive(None) is None and keep_alive(120) == 120
    for bad in ("", "m", "5 d", "1h x", True):
        with pytest.raises(ApiError):
            keep_alive(bad)


# config.toml's keep_alive and this API's read by one parser (ridge/durations.py, issue 40): "1d"
# was a 400 here while config.toml took it, and a number in a string ("90") the other way round.
SAME_DURATIONS = ["1d", "90s", "5m", "1h30m", "90", 120, 2.5, "-1", -1, "-5m"]


def test_keep_alive_means_the_same_in_config_and_over_ollamas_api(daemon, ridge, tmp_path):
    """Each value as a [models.NAME] keep_alive (config_entries, as `ridge serve` reads config.toml)
    and as the keep_alive of a POST /api/generate: the daemon's `models` then lists the same
    seconds (-1: kept) for the model."""
    table = {f"m{i}": {"path": "x.gguf", "keep_alive": v} for i, v in enumerate(SAME_DURATIONS)}
    configured = config_entries(table, "config.toml", tmp_path)
    for i, value in enumerate(SAME_DURATIONS):
        status, body = ask(daemon.url, "POST", "/api/generate", {"Content-Type": "application/json"},
                           {"model": "other", "prompt": "", "keep_alive": value})
        assert status == 200 and body["done_reason"] == "load", (value, body)
        held = {m["name"]: m for m in ridge.models()["models"]}["other"]
        assert held["keep_alive"] == wire_duration(configured[f"m{i}"].keep), value
    status, body = ask(daemon.url, "POST", "/api/generate", {"Content-Type": "application/json"},
                       {"model": "other", "prompt": "", "keep_alive": 0})
    assert status == 200 and body["done_reason"] == "unload"


# -- reranking, on the same daemon ---------------------------------------------------------------------
def test_rerank_over_http_against_transformers(ranker, daemon):
    model, path, vocab, _ = ranker
    want = reference(model, path, vocab, QUERY, DOCS)
    body = {"model": "ranker", "query": QUERY, "documents": [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]], "top_n": 3}
    status, got = ask(daemon.url, "POST", "/v1/rerank", {"Content-Type": "application/json"}, body)
    assert status == 200, got
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in got["results"]] == order
    assert max(abs(r["relevance_score"] - want[r["index"]]) for r in got["results"]) < 1e-5
    assert [r["document"]["text"] for r in got["results"]] == [DOCS[i] for i in order]
    assert got["model"] == "ranker" and got["usage"]["prompt_tokens"] > 0
    status, bare = ask(daemon.url, "POST", "/v2/rerank", {"Content-Type": "application/json"},
                       {"model": "ranker", "query": QUERY, "documents": DOCS, "return_documents": False})
    assert status == 200 and len(bare["results"]) == len(DOCS) and "document" not in bare["results"][0]


@pytest.mark.parametrize("body, words", [
    ({"model": "ranker", "query": QUERY, "documents": []}, "documents"),
    ({"model": "ranker", "query": "", "documents": ["a"]}, "query"),
    ({"model": "ranker", "query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
    ({"model": "ranker", "documents": ["a"]}, "query"),
    ({"query": QUERY, "documents": ["a"]}, "not a reranker"),
])
def test_bad_rerank_requests_are_400(daemon, body, words):
    status, reply = ask(daemon.url, "POST", "/v1/rerank", {"Content-Type": "application/json"}, body)
    assert status == 400 and words in reply["error"]["message"], reply


def test_the_protocol_refuses_rerank_before_version_4_and_embed_on_a_ranker(daemon):
    raw = Raw(daemon.endpoint)
    old = raw.call({"v": 3, "type": "rerank", "id": "a", "model": "ranker", "query": "q", "documents": ["d"]}, 30)
    assert old["type"] == "error" and old["code"] == "unknown_type"
    embed = raw.call({"v": 4, "type": "embed", "id": "b", "model": "ranker", "input": ["d"]}, timeout=30)
    assert embed["type"] == "error" and "reranker" in embed["message"]
    with Client(daemon.endpoint, timeout=30) as c:
        ok = c.rerank("q", ["d", "e"], top_n=1, model="ranker")
    assert len(ok["results"]) == 1 and ok["finish_reason"] == "stop" and ok["usage"]["prompt_tokens"] > 0
