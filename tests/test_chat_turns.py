"""A chat turn's tools and reasoning without a daemon (docs/protocol.md §3.2.3):
each family's template read into its format and markers, the messages and
tools rendered, the version-2 fields checked (and refused in version 1), and
the turn's grammar run in llguidance over the tiny tokenizers: what it admits
and what it refuses, lazy for auto, forced for required, one call without
parallel calls, the thinking's budget."""
from __future__ import annotations

import json

import pytest

from chat_models import make_chat_model
from ridge.daemon import protocol as P
from ridge.daemon.frontend.chat_format import HERMES, LLAMA3_JSON, MISTRAL, TOOLS_PROMPT
from ridge.daemon.cli.config import defaults
from ridge.daemon.cli.serve import limits
from ridge.daemon.frontend.validate import Validator
from ridge.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def validators(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    out = {}
    for family in ("hermes", "llama3", "mistral"):
        tok = Tokenizer.from_hf_dir(make_chat_model(tmp, family))
        out[family] = Validator(tok, tok.vocab_size, 2048, 16, 256, limits(defaults(), 2048))
    return out


def gen(v: int = 2, **body):
    return P.Envelope("generate", "g", body, v)


def code_of(fn, *a):
    with pytest.raises(P.ProtocolError) as e:
        fn(*a)
    return e.value.code, e.value.message


def test_each_family_is_read_from_its_template(validators):
    h, l3, m = (validators[f].chat for f in ("hermes", "llama3", "mistral"))
    assert (h.tool_format, h.tools_in_template, h.reasoning) == (HERMES, True, True)
    assert not h.markers["call_open"].special and h.markers["call_open"].token_id is not None
    assert (l3.tool_format, l3.reasoning) == (LLAMA3_JSON, False) and l3.markers["python_tag"].special
    assert (m.tool_format, m.reasoning) == (MISTRAL, False) and m.markers["tool_calls"].special
    assert m.keep_ids() == (m.markers["tool_calls"].token_id,)


def test_tools_and_history_go_through_the_template(validators):
    v = validators["mistral"]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "18 C"}]
    req = v.generate(gen(messages=history, tools=[WEATHER]))
    text = v.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False)
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]' in text
    assert '[TOOL_RESULTS]{"content": "18 C", "call_id": "abcDEF123"}[/TOOL_RESULTS]' in text
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in text
    # Mistral's template refuses any id but 9 letters and digits, as the real ones do
    history[1]["tool_calls"][0]["id"] = "call_1"
    assert code_of(v.generate, gen(messages=history, tools=[WEATHER]))[0] == P.INVALID_REQUEST
    # tool_choice none: the model is not shown the tools
    none = v.generate(gen(messages=ASK, tools=[WEATHER], tool_choice="none"))
    assert none.prompt_token_ids == v.generate(gen(messages=ASK)).prompt_token_ids and none.output is None


def test_a_template_without_tools_gets_ridges_prompt(tmp_path):
    from tiny_models import write_tokenizer_files

    write_tokenizer_files(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    v = Validator(tok, tok.vocab_size, 2048, 16, 256, limits(defaults(), 2048))
    assert (v.chat.tool_format, v.chat.tools_in_template) == (HERMES, False)
    history = [{"role": "system", "content": "Be brief."}] + ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                             "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    req = v.generate(gen(messages=history, tools=[WEATHER, CLOCK], tool_choice="required"))
    text = tok.decode(req.prompt_token_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + TOOLS_PROMPT.split("{tools}")[0])
    assert json.dumps(WEATHER) in text and '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nnoon\n</tool_response><|im_end|>" in text
    assert req.params.chat_grammar is not None and req.output.tool_format == HERMES
    # no <tool_call> token here: the trigger is text, and the call's lexeme is lazy
    auto = v.generate(gen(messages=ASK, tools=[WEATHER]))
    assert v.chat.markers["call_open"].token_id is None
    assert accepts(v, auto, "No call.") and accepts(v, auto, "I will look. " + CALL["hermes"])
    assert refuses_from(v, auto, "I will look. " + BAD["hermes"])


@pytest.mark.parametrize("body,field", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"params": {"max_reasoning_tokens": -1}}, "params.max_reasoning_tokens"),
])
def test_bad_fields_are_refused_by_name(validators, body, field):
    code, message = code_of(validators["hermes"].generate, gen(messages=ASK, **body))
    assert code == P.INVALID_FIELD and message.startswith(field), message


def test_version_one_has_none_of_it(validators):
    v = validators["hermes"]
    assert code_of(v.generate, gen(1, messages=ASK, tools=[WEATHER])) == (P.INVALID_FIELD,
                                                                           "tools needs protocol version 2")
    assert code_of(v.generate, gen(1, messages=ASK, params={"max_reasoning_tokens": 3}))[0] == P.INVALID_FIELD
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    assert code_of(v.generate, gen(1, messages=ASK, **thinking))[0] == P.INVALID_FIELD
    assert v.generate(gen(1, messages=ASK)).output is None  # version 1: the text as the model wrote it
    assert v.generate(gen(2, messages=ASK, **thinking)).output.start == "think"
    assert v.generate(gen(2, messages=ASK)).output is None  # thinking off: the prompt closed it
    assert code_of(v.generate, gen(2, prompt="x", tools=[WEATHER]))[0] == P.INVALID_FIELD


# -- the grammar, run in llguidance --------------------------------------------------------------------
def matcher(v: Validator, req):
    return v.grammars.compile(req.params.constraint()).matcher().ll


def accepts(v: Validator, req, text: str) -> bool:
    """Whether the grammar takes text whole and may end there."""
    m = matcher(v, req)
    ids = v.tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def refuses_from(v: Validator, req, text: str) -> bool:
    m = matcher(v, req)
    ids = v.tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) < len(ids)


CALL = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
        "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]'}
BAD = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": 7',
       "llama3": '{"name": "get_weather", "parameters": {"town"',
       "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "K'}
TWO = {"hermes": CALL["hermes"] + "\n" + CALL["hermes"], "llama3": CALL["llama3"] + "; " + CALL["llama3"],
       "mistral": CALL["mistral"][:-1] + ", " + CALL["mistral"][len("[TOOL_CALLS]["):]}


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_forced_calls(validators, family):
    v = validators[family]
    req = v.generate(gen(messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required"))
    assert accepts(v, req, CALL[family]) and accepts(v, req, TWO[family])
    assert refuses_from(v, req, BAD[family]) and refuses_from(v, req, "Sure")  # a call from the first token
    named = v.generate(gen(messages=ASK, tools=[WEATHER, CLOCK], tool_choice={"type": "function",
                                                                                "function": {"name": "now"}}))
    assert refuses_from(v, named, CALL[family])
    one = v.generate(gen(messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert accepts(v, one, CALL[family]) and refuses_from(v, one, TWO[family]) and one.output.max_calls == 1


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_auto_is_free_until_the_trigger(validators, family):
    v = validators[family]
    req = v.generate(gen(messages=ASK, tools=[WEATHER]))
    assert accepts(v, req, "It is sunny in Paris.")
    assert accepts(v, req, CALL[family]) and refuses_from(v, req, BAD[family])
    if family != "llama3":  # Llama 3's call is the whole answer
        assert accepts(v, req, "Let me look. " + CALL[family])
        assert refuses_from(v, req, "Let me look. " + BAD[family])


def test_the_thinking_budget_forces_the_close_tag(validators):
    v = validators["hermes"]
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    req = v.generate(gen(messages=ASK, params={"max_reasoning_tokens": 4}, **think))
    assert req.params.speculative is False and req.output.start == "think"
    m = matcher(v, req)
    close = v.chat.markers["think_close"].token_id
    thought = v.tokenizer.encode("the plan is", add_special_tokens=False)[:4]
    assert len(thought) == 4 and m.consume_tokens(thought[:3]) and m.compute_ff_tokens() == []
    assert m.consume_tokens(thought[3:]) and m.compute_ff_tokens()[:1] == [close]  # spent: </think> is forced
    # structured output and tools apply from the end of thinking
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}}}}
    js = v.generate(gen(messages=ASK, params=fmt, **think))
    assert accepts(v, js, 'I think {"a": "x"} is wrong.</think>\n\n{"a": 1}')
    assert refuses_from(v, js, 'ok</think>\n\n{"a": "x"}')
    calls = v.generate(gen(messages=ASK, tools=[WEATHER], tool_choice="required", **think))
    assert accepts(v, calls, "hm</think>\n\n" + CALL["hermes"]) and refuses_from(v, calls, "hm</think>\n\nSure")


def test_a_tools_objects_admit_only_their_keys():
    from ridge.daemon.frontend.chat_grammar import closed

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}},
                                               "e": {"type": "object", "additionalProperties": {"type": "string"}},
                                               "f": {"allOf": [{"properties": {"g": {}}}, {"properties": {"h": {}}}]}},
              "$defs": {"X": {"type": "object"}}}
    got = closed(schema)
    assert got["additionalProperties"] is False and got["properties"]["a"]["additionalProperties"] is False
    assert got["properties"]["c"]["items"]["additionalProperties"] is False and got["$defs"]["X"]["additionalProperties"] is False
    assert got["properties"]["e"]["additionalProperties"] == {"type": "string"}  # said what else it admits
    assert "additionalProperties" not in got["properties"]["f"]["allOf"][0]  # allOf's members stay open
    assert "additionalProperties" not in schema  # the tool's own schema is not touched
