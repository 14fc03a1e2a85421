"""The gateway's other APIs, end to end: Anthropic's /v1/messages through the
`anthropic` package, OpenAI's /v1/responses through the `openai` package, and
/openapi.json, read by schemathesis, which sends what the schemas allow and
checks every answer against them. A real `ridge serve --http` on a tiny GGUF
model; no mocks.

Both APIs are the one internal chat request: at temperature 0 they answer
what /v1/chat/completions answers for the same conversation."""
from __future__ import annotations

import json

import http.client
import time

import anthropic
import jsonschema
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from ridge.daemon.gateway.openapi import OPERATIONS
from ridge.daemon.gateway.responses_api import MAX_STORED, ResponseStore
from ridge.daemon.gateway.run import GatewayThread, listen
from ridge.daemon.gateway.settings import gateway_settings
from chat_models import make_chat_model
from test_daemon_harness import Daemon, Raw, stats
from test_gateway import free_port, post, wait_http
from tiny_models import make_tiny

BLOCKS = 48  # a small device pool, so that other requests evict a conversation's blocks to the host tier
FILLERS = 5  # prompts of about 200 tokens: more than BLOCKS blocks together
EXAMPLES = 12  # schemathesis' cases per operation: a bounded run, seeded (derandomize) so that it repeats
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
SYSTEM, USER = "Be brief.", "hello there"
GREEDY = {"temperature": 0}  # the anthropic package no longer names temperature; the API still takes it


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("apis")
    model, _, _ = make_tiny(tmp, "llama")
    port = free_port()
    d = Daemon(tmp, str(model), "--num-kv-blocks", BLOCKS, "--kv-host-gib", "0.05", "--no-kv-disk",
               "--http", f"127.0.0.1:{port}", "--served-model-name", "tiny")
    d.url = f"http://127.0.0.1:{port}"
    wait_http(d.url)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oai(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(daemon):
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=60)


def chat_text(oai, messages: list[dict], max_tokens: int, **kw) -> str:
    c = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return c.choices[0].message.content


def filler(i: int) -> str:
    return f"{i} " * 100


def prompt_tokens(daemon, messages: list[dict]) -> int:
    return Raw(daemon.endpoint).call({"type": "tokenize", "id": "t", "messages": messages})["count"]


# -- /v1/messages ---------------------------------------------------------------------------------------
def test_messages_whole_and_streamed_agree_with_chat(oai, claude, daemon):
    want = chat_text(oai, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], 12)
    kw = dict(model="tiny", system=SYSTEM, max_tokens=12, extra_body=GREEDY,
              messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}])
    m = claude.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny" and m.id.startswith("msg_")
    assert "".join(b.text for b in m.content) == want
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    count = prompt_tokens(daemon, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count and m.usage.output_tokens <= 12
    events = []
    with claude.messages.stream(**kw) as s:
        for e in s:
            events.append(e.type)
        final = s.get_final_message()
    assert "".join(b.text for b in final.content) == want and final.stop_reason == m.stop_reason
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count
    assert final.usage.output_tokens == m.usage.output_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    if want:
        assert events.count("content_block_start") == events.count("content_block_stop") == 1
        assert "text" in events  # the SDK's event for each text_delta


def test_messages_stop_sequences(claude):
    kw = dict(model="tiny", max_tokens=30, extra_body=GREEDY, messages=[{"role": "user", "content": "hello"}])
    full = "".join(b.text for b in claude.messages.create(**kw).content)
    cut = next(k for k, c in enumerate(full) if k and c.isascii() and c.isalnum())  # the random model's first letter
    stop = full[cut]
    m = claude.messages.create(**kw, stop_sequences=["never-there", stop])
    assert ("".join(b.text for b in m.content), m.stop_reason, m.stop_sequence) == (full[:cut], "stop_sequence", stop)
    with claude.messages.stream(**kw, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    m = claude.messages.create(**kw, stop_sequences=["never-there"])
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None


def test_count_tokens(claude, daemon):
    messages = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                {"role": "user", "content": [{"type": "text", "text": "three"}]}]
    n = claude.messages.count_tokens(model="tiny", system="sys", messages=messages).input_tokens
    assert n == prompt_tokens(daemon, [{"role": "system", "content": "sys"}, *messages[:2],
                                       {"role": "user", "content": "three"}])


def test_messages_errors_have_anthropics_shape(claude, daemon):
    with pytest.raises(anthropic.BadRequestError) as e:
        # 0: 10**6 is a ceiling (test_clients.py)
        claude.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    resp = post(daemon.url, "/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    body = json.loads(resp.read())
    assert resp.status == 400 and body["type"] == "error" and "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"},
                                                                     {"role": "assistant", "content": "y"}])
    resp = post(daemon.url, "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert resp.status == 400 and "image" in json.loads(resp.read())["error"]["message"]


def test_anthropic_clients_send_the_key_as_x_api_key(daemon):
    settings = gateway_settings({"http": f"127.0.0.1:{free_port()}", "api_key": "s3cret"})
    gateway = GatewayThread(settings, daemon.endpoint, listen(settings))
    gateway.start()
    try:
        wait_http(settings.url)
        ok = anthropic.Anthropic(base_url=settings.url, api_key="s3cret", max_retries=0)
        assert ok.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "x"}]).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=settings.url, api_key="wrong", max_retries=0).messages.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        resp = post(settings.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                    {"x-api-key": "s3cret"})  # OpenAI's routes take the Bearer form only
        assert resp.status == 401
    finally:
        gateway.stop()


# -- /v1/responses --------------------------------------------------------------------------------------
def test_responses_whole_and_streamed_agree_with_chat(oai):
    want = chat_text(oai, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], 12)
    r = oai.responses.create(model="tiny", instructions=SYSTEM, input=USER, max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == want
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 12
    items = [{"role": "developer", "content": SYSTEM},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}]}]
    assert oai.responses.create(model="tiny", input=items, max_output_tokens=12, temperature=0).output_text == want
    events = list(oai.responses.create(model="tiny", instructions=SYSTEM, input=USER, max_output_tokens=12,
                                       temperature=0, stream=True))
    types, final = [e.type for e in events], events[-1].response  # the SDK's helper wants only completed ones
    assert final.output_text == want and final.status == r.status
    assert final.usage.input_tokens == r.usage.input_tokens
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.completed" if r.status == "completed" else "response.incomplete")
    if want:
        assert "response.output_text.delta" in types and "response.output_text.done" in types


def test_previous_response_id_continues_and_hits_the_cache(oai, daemon):
    """A follow-up's prompt is the stored conversation and its own input; its prefix is a hit,
    found in the host tier after other requests took the whole device pool."""
    kw = dict(model="tiny", instructions=SYSTEM, temperature=0)
    first = oai.responses.create(**kw, input=USER, max_output_tokens=8)
    block = stats(daemon.endpoint)["stats"]["kv_block_size"]
    hits_before = stats(daemon.endpoint)["stats"]["kv_tiers"]["host"]["hits"]
    for i in range(FILLERS):  # prompts that together need more than the pool: the first's blocks are evicted
        oai.completions.create(model="tiny", prompt=filler(i), max_tokens=1)
    follow = oai.responses.create(**kw, previous_response_id=first.id, input="and then?", max_output_tokens=4)
    conversation = [{"role": "user", "content": USER}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "and then?"}]
    assert follow.usage.input_tokens == prompt_tokens(daemon, [{"role": "system", "content": SYSTEM}, *conversation])
    assert follow.previous_response_id == first.id
    before = prompt_tokens(daemon, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
    assert follow.usage.input_tokens_details.cached_tokens >= before // block * block > 0, follow.usage
    deadline = time.monotonic() + 5  # the stats are a snapshot, at most stats_interval old
    while stats(daemon.endpoint)["stats"]["kv_tiers"]["host"]["hits"] == hits_before:  # from host RAM
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # instructions are not carried over: a follow-up without them has none
    bare = oai.responses.create(model="tiny", previous_response_id=first.id, input="and then?", max_output_tokens=1)
    assert bare.usage.input_tokens == prompt_tokens(daemon, conversation)
    got = oai.responses.retrieve(first.id)
    assert (got.id, got.output_text) == (first.id, first.output_text)
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="tiny", previous_response_id=first.id, input="x", max_output_tokens=2)
    unstored = oai.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_the_store_keeps_each_response_for_its_ttl():
    now = [0.0]
    store = ResponseStore(10.0, clock=lambda: now[0])
    store.put("a", [{"role": "user", "content": "x"}], {"id": "a"})
    now[0] = 5.0
    store.put("b", [], {"id": "b"})
    assert store.get("a").response == {"id": "a"}
    now[0] = 10.0
    with pytest.raises(Exception, match="responses_ttl"):
        store.get("a")
    assert store.get("b").chat == []
    for i in range(MAX_STORED + 1):
        store.put(str(i), [], {})
    assert len(store.items) == MAX_STORED and "b" not in store.items
    off = ResponseStore(0.0)
    off.put("a", [], {})
    assert not off.items


def test_responses_errors(oai, daemon):
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="tiny", previous_response_id="resp_nope", input="x")
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="tiny", input=[{"type": "item_reference", "id": "x"}])
    assert e.value.param == "input"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="tiny", input="x", max_output_tokens=0)  # 10**6: a ceiling (test_clients.py)
    assert e.value.param == "max_tokens"  # the daemon's refusal, in OpenAI's shape


# -- tool calls and thinking, on a tiny model with a Hermes template (Qwen's: <tool_call>, <think>) -------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SEEDED = {"temperature": 1.0, "seed": 5}  # greedy, a random model can emit JSON's whitespace to the end


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hermes")
    port = free_port()
    d = Daemon(tmp, str(make_chat_model(tmp, "hermes")), "--num-kv-blocks", 512, "--http", f"127.0.0.1:{port}",
               "--served-model-name", "tiny")
    d.url = f"http://127.0.0.1:{port}"
    wait_http(d.url)
    yield d
    d.stop()


def streamed(claude, kw: dict) -> tuple[list[str], object]:
    """-> (each content_block_delta's delta type, the final message), through the SDK's stream."""
    deltas = []
    with claude.messages.stream(**kw) as s:
        for e in s:
            if e.type == "content_block_delta":
                deltas.append(e.delta.type)
        return deltas, s.get_final_message()


def test_messages_tool_use_round_trip(hermes):
    """A forced call is a tool_use block whose input validates, streamed (input_json_delta) or not;
    the call and its tool_result go back in the history, rendered by the template."""
    claude = anthropic.Anthropic(base_url=hermes.url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
    kw = dict(model="tiny", max_tokens=160, tools=tools, messages=ASK, extra_body=SEEDED,
              tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    m = claude.messages.create(**kw)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    deltas, final = streamed(claude, kw)
    (again,) = [b for b in final.content if b.type == "tool_use"]
    assert (again.name, again.input, final.stop_reason) == ("get_weather", use.input, "tool_use")
    assert "input_json_delta" in deltas

    def back(result: str) -> list[dict]:
        return [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
    answer = claude.messages.create(model="tiny", max_tokens=8, tools=tools, messages=back("18 C"),
                                    extra_body=GREEDY)
    count = claude.messages.count_tokens(model="tiny", tools=tools, messages=back("18 C")).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == count
    longer = claude.messages.count_tokens(model="tiny", tools=tools, messages=back("18 C, sunny")).input_tokens
    assert longer > count  # the result is in the prompt
    assert claude.messages.count_tokens(model="tiny", messages=back("18 C")).input_tokens < count  # so are the tools


def test_messages_thinking_blocks(hermes):
    """Thinking on (the template opens <think>): a thinking block first, ended by its budget, and
    text that never holds the thinking."""
    claude = anthropic.Anthropic(base_url=hermes.url, api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="tiny", max_tokens=24, thinking={"type": "enabled", "budget_tokens": 6}, messages=ASK,
              extra_body=GREEDY)
    m = claude.messages.create(**kw)
    assert m.content[0].type == "thinking" and m.content[0].thinking
    texts = [b.text for b in m.content if b.type == "text"]
    assert not any("<think>" in t or "</think>" in t for t in texts)
    deltas, final = streamed(claude, kw)
    assert final.content[0].type == "thinking" and final.content[0].thinking == m.content[0].thinking
    assert deltas[0] == "thinking_delta"
    off = claude.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert all(b.type != "thinking" for b in off.content)


def test_responses_function_calls(hermes):
    """A required call is a function_call item (whole, and streamed as argument deltas); its output
    goes back as a function_call_output item, after previous_response_id or in the input itself."""
    oai = openai.OpenAI(base_url=hermes.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER}]
    kw = dict(model="tiny", input=ASK[0]["content"], tools=tools, tool_choice="required", max_output_tokens=160,
              temperature=1.0, parallel_tool_calls=False, extra_body={"seed": 5})
    r = oai.responses.create(**kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(oai.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    (streamed,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert streamed.arguments == call.arguments
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    follow = oai.responses.create(model="tiny", previous_response_id=r.id, input=[result], tools=tools,
                                  max_output_tokens=4, temperature=0)
    spelled = oai.responses.create(model="tiny", tools=tools, max_output_tokens=4, temperature=0, input=[
        ASK[0], {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result])
    assert follow.usage.input_tokens == spelled.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, and the call


def test_responses_reasoning_item(hermes):
    oai = openai.OpenAI(base_url=hermes.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = oai.responses.create(model="tiny", input="Think.", reasoning={"effort": "low"}, max_output_tokens=12,
                             temperature=0)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text
    assert "<think>" not in r.output_text and "</think>" not in r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(oai.responses.create(model="tiny", input="Think.", reasoning={"effort": "low"},
                                       max_output_tokens=12, temperature=0, stream=True))
    assert "response.reasoning_text.delta" in [e.type for e in events]
    assert events[-1].response.output[0].content[0].text == r.output[0].content[0].text


def test_bodies_msgpack_cannot_carry_are_400(daemon):
    """A lone UTF-16 surrogate (escaped, or as CESU-8 bytes) and an integer past 64 bits are valid to
    json.loads but not to the daemon's msgpack: a 400, on every route (found by schemathesis' kind of input)."""
    for path, raw in [("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
                      ("/v1/messages", b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", '
                                       b'"content": "\xed\xa0\x80"}]}'),
                      ("/v1/completions", b'{"prompt": "x", "seed": 123456789012345678901234567890}'),
                      ("/v1/responses", b'{"input": "x", "metadata": {"k": "\\udfff"}}')]:
        conn = http.client.HTTPConnection(*daemon.url.removeprefix("http://").split(":"))
        conn.request("POST", path, raw, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 400, (path, resp.read())
        resp.read()
    ok = post(daemon.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "\U0001F600 ok"}],
                                                   "max_tokens": 2})
    assert ok.status == 200  # a pair, escaped by json.dumps, is a character


# -- /openapi.json -----------------------------------------------------------------------------------------
def test_openapi_document(daemon):
    resp = post(daemon.url, "/openapi.json", {})
    assert resp.status == 405
    conn = http.client.HTTPConnection(*daemon.url.removeprefix("http://").split(":"))
    conn.request("GET", "/openapi.json")
    doc = json.loads(conn.getresponse().read())
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                 "/v1/responses", "/v1/models"):
        assert path in doc["paths"], path
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and "max_completion_tokens" in chat["properties"]


# -- schemathesis: what the schemas allow, and answers that match them --------------------------------------
# schemathesis' own pytest plugin reads a pytest internal that pytest 9 removed (request.node._nodeid), so
# its strategies run under hypothesis here, one test per operation.
@pytest.fixture(scope="module")
def api_schema(daemon):
    return schemathesis.openapi.from_url(daemon.url + "/openapi.json")


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_every_answer_matches_the_schema(api_schema, op):
    """No 500, and every answer's status, media type and body are the document's."""
    operation = api_schema[op.path][op.method]

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case):
        case.call_and_validate(checks=CHECKS)

    check()
