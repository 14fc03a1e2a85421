"""Tool calls and reasoning through /v1/chat/completions, end to end: a real
`ridge serve --http` on tiny random models whose chat templates are each
family's (tests/chat_models.py: Qwen-style Hermes with <think>, Llama 3 JSON,
Mistral), spoken to with the official `openai` package and an
`openai-agents` Agent. A random model writes nonsense, so what is checked is
what the grammar and the reader guarantee: every forced call parses and
validates against its tool's schema (jsonschema), streamed pieces join into
the same calls, `parallel_tool_calls: false` gives one call, the thinking
never reaches the content and its budget ends it. One daemon per family,
started when a test first needs it."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
from chat_models import make_chat_model
from ridge.daemon.client import Client
from test_daemon_harness import Daemon
from test_gateway import free_port, wait_http

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {  # no additional properties: a random
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],  # model writes them
    "additionalProperties": False}}}  # on and on
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FAMILIES = ("hermes", "llama3", "mistral")
THINK = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """family -> (daemon, openai client), each daemon started on first use."""
    running: dict = {}

    def get(family: str):
        if family not in running:
            tmp = tmp_path_factory.mktemp(family)
            port = free_port()
            d = Daemon(tmp, str(make_chat_model(tmp, family)), "--num-kv-blocks", 512, "--max-num-seqs", 8,
                       "--http", f"127.0.0.1:{port}", "--served-model-name", family)
            d.url = f"http://127.0.0.1:{port}"
            wait_http(d.url)
            running[family] = d, openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return running[family]

    yield get
    for d, _ in running.values():
        d.stop()


def valid_calls(calls, finish_reason: str, names=tuple(SCHEMAS), stream: bool = False) -> None:
    """Every call names a tool and its arguments validate. A call cut by max_tokens is dropped from a
    whole answer (which may then hold none); a stream has sent its pieces, and ends in it."""
    assert finish_reason in ("tool_calls", "length") and (calls or finish_reason == "length"), (finish_reason, calls)
    calls = calls or []
    whole = calls[:-1] if stream and finish_reason == "length" else calls
    for c in whole:
        assert c.type == "function" and c.id and c.function.name in names, c
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def streamed(chunks) -> dict:
    """Chunks -> choice index -> (content, reasoning, calls as [id, name, arguments], finish_reason)."""
    out: dict = {}
    for chunk in chunks:
        for c in chunk.choices:
            content, reasoning, calls, finish = out.get(c.index, ("", "", [], None))
            d = c.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for piece in d.tool_calls or ():
                if piece.id is not None:  # a call's first piece names it
                    assert piece.index == len(calls) and piece.function.name and piece.type == "function"
                    calls.append([piece.id, piece.function.name, piece.function.arguments or ""])
                else:
                    assert piece.index == len(calls) - 1 and piece.function.name is None
                    calls[-1][2] += piece.function.arguments
            out[c.index] = content, reasoning, calls, c.finish_reason or finish
    return out


class Call:  # a streamed call, shaped as a whole response's
    def __init__(self, id_, name, arguments):
        self.id, self.type = id_, "function"
        self.function = type("F", (), {"name": name, "arguments": arguments})()


CHOICES = [("required", True, False), ("required", False, True), ({"type": "function", "function": {"name": "now"}},
                                                                 True, True)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("choice,parallel,stream", CHOICES, ids=["required-parallel", "required-one-streamed",
                                                                  "named-streamed"])
def test_forced_calls_parse_and_validate(served, family, choice, parallel, stream):
    _, oai = served(family)
    names = ("now",) if isinstance(choice, dict) else tuple(SCHEMAS)
    kw = dict(model=family, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, n=2, seed=3,
              temperature=1.0, max_tokens=160)
    if not stream:
        r = oai.chat.completions.create(**kw)
        for ch in r.choices:
            valid_calls(ch.message.tool_calls, ch.finish_reason, names)
            assert not ch.message.content  # a call cut by max_tokens, even before its name, is no text
            if not parallel:
                assert len(ch.message.tool_calls) == 1 and ch.finish_reason == "tool_calls"
        return
    got = streamed(oai.chat.completions.create(**kw, stream=True))
    assert sorted(got) == [0, 1]
    for content, reasoning, calls, finish in got.values():
        assert (content == "" or finish == "length") and reasoning == ""
        valid_calls([Call(*c) for c in calls], finish, names, stream=True)
        if not parallel:
            assert len(calls) == 1 and finish == "tool_calls"


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_answers_text_or_valid_calls(served, family):
    _, oai = served(family)
    for seed in (1, 2):
        r = oai.chat.completions.create(model=family, messages=ASK, tools=TOOLS, seed=seed, max_tokens=60, n=2)
        for ch in r.choices:
            if ch.message.tool_calls:
                valid_calls(ch.message.tool_calls, ch.finish_reason)
            else:
                assert ch.finish_reason in ("stop", "length") and ch.message.content is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_result_sent_back(served, family):
    """The call a first request made, with its result, goes back through the model's own template."""
    d, oai = served(family)
    first = oai.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, seed=5, max_tokens=400)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 18 degrees"}]
    second = oai.chat.completions.create(model=family, messages=history, tools=TOOLS, max_tokens=16, seed=5)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # what the model was shown: the call's arguments as the template writes them, then the result
    with Client(d.endpoint) as c:
        shown = c.call("tokenize", messages=[{k: v for k, v in m.items() if k != "refusal"} for m in history],
                       tools=TOOLS)
        text = c.call("detokenize", token_ids=shown["token_ids"], skip_special_tokens=False)["text"]
    assert "Sunny, 18 degrees" in text and json.dumps(json.loads(call.function.arguments), ensure_ascii=False) in text
    assert second.usage.prompt_tokens == shown["count"]


def test_tool_choice_none_shows_no_tools(served):
    _, oai = served("hermes")
    plain = oai.chat.completions.create(model="hermes", messages=ASK, max_tokens=4, seed=1)
    none = oai.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4,
                                       seed=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens and not none.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="tool_choice.function.name"):
        oai.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS, max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "missing"}})


# -- reasoning ---------------------------------------------------------------------------------------
def test_thinking_is_split_from_the_content_and_its_budget_ends_it(served):
    _, oai = served("hermes")
    for budget in (0, 6):
        kw = dict(model="hermes", messages=ASK, max_tokens=24, seed=4, temperature=1.0,
                  extra_body={**THINK, "max_reasoning_tokens": budget})
        r = oai.chat.completions.create(**kw)
        msg, used = r.choices[0].message, r.usage.completion_tokens_details.reasoning_tokens
        thought = getattr(msg, "reasoning_content", None) or ""
        assert 1 <= used <= budget + 1  # the budget's tokens, and the close tag the grammar forces
        assert "</think>" not in thought and "<think>" not in (msg.content or "")
        assert not thought or thought not in (msg.content or "")
        (content, reasoning, calls, finish), = streamed(oai.chat.completions.create(**kw, stream=True)).values()
        assert (content, reasoning) == (msg.content or "", thought) and calls == []  # the same seed, streamed


def test_without_a_budget_thinking_runs_until_the_model_closes_it(served):
    _, oai = served("hermes")
    r = oai.chat.completions.create(model="hermes", messages=ASK, max_tokens=12, seed=4,
                                    extra_body={**THINK, "ignore_eos": True})
    msg = r.choices[0].message
    assert r.usage.completion_tokens_details.reasoning_tokens == 12 or "</think>" not in msg.content
    off = oai.chat.completions.create(model="hermes", messages=ASK, max_tokens=6, seed=4, reasoning_effort="none")
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.completion_tokens_details is None  # thinking off: the prompt closed it


def test_structured_output_and_forced_calls_begin_after_thinking(served):
    _, oai = served("hermes")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = oai.chat.completions.create(model="hermes", messages=ASK, max_tokens=300, seed=2, extra_body={
        **THINK, "max_reasoning_tokens": 5}, response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema}})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.reasoning_content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    calls = oai.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS, tool_choice="required",
                                        max_tokens=120, seed=2, extra_body={**THINK, "max_reasoning_tokens": 5})
    ch = calls.choices[0]
    valid_calls(ch.message.tool_calls, ch.finish_reason)
    assert calls.usage.completion_tokens_details.reasoning_tokens <= 6


# -- an agent ------------------------------------------------------------------------------------------
def test_an_agent_calls_a_function_tool_and_answers_from_its_result(served):
    d, _ = served("hermes")
    seen = []

    # Called once: then the tool is withdrawn (is_enabled), so that the next turn answers, as a
    # random model would otherwise call on in `auto` (its triggers are as likely as any token).
    @function_tool(is_enabled=lambda ctx, agent: not seen)
    def get_weather(city: Literal["Paris", "Rome"]) -> str:  # a random model would write a string on and on
        """The weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the tool's result.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model="hermes", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                               temperature=1.0, extra_body={"seed": 7}))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    kinds = [item.type for item in result.new_items]
    assert seen and kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert result.new_items[1].output == f"Sunny in {seen[0]}"
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)
