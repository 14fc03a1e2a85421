"""gpt-oss's harmony format (daemon/harmony.py): ridge's renderer against the gpt-oss template
rendered by transformers, the channel reader at every split of its text, and a tiny random
gpt-oss served over HTTP and spoken to with the `openai` package: the analysis channel in
reasoning_content, the final one in content, a forced call whose arguments validate against
its tool's schema, and its result sent back."""
from __future__ import annotations

import json
from datetime import datetime

import jsonschema
import openai
import pytest
import transformers

from chat_models import make_harmony_model
from ridge.daemon.frontend import harmony
from ridge.daemon.frontend.tools import template_messages
from test_daemon_harness import Daemon
from test_gateway import free_port, wait_http
from test_gateway_tools import ASK, SCHEMAS, TOOLS, streamed, valid_calls

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "unit": "C"}'}}
CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "Hi"}], None, {}),
    "developer-tools-effort": ([{"role": "system", "content": "Be brief."}] + ASK, TOOLS,
                               {"reasoning_effort": "high"}),
    "call-result-answer": (ASK + [{"role": "assistant", "content": "Look it up.", "tool_calls": [CALL]},
                                  {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
                                  {"role": "assistant", "content": "It is sunny."},
                                  {"role": "user", "content": "And tomorrow?"}], TOOLS, {"reasoning_effort": "low"}),
    "call-pending": (ASK + [{"role": "assistant", "content": "Look it up.", "tool_calls": [CALL]},
                            {"role": "tool", "tool_call_id": "call_1", "content": 'Sunny "18"'}], TOOLS, {}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_harmony_model(tmp_path_factory.mktemp("gpt-oss"))


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_the_renderer_is_the_gpt_oss_template(model_dir, name):
    messages, tools, kw = CONVERSATIONS[name]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    theirs = tok.apply_chat_template(template_messages(messages), tools=tools, add_generation_prompt=True,
                                     tokenize=False, **kw)  # the arguments as maps, as HF templates read them
    ours = harmony.render(template_messages(messages), tools, kw, today=datetime.now().strftime("%Y-%m-%d"))
    assert ours == theirs


OUTPUT = ("<|channel|>analysis<|message|>Think <|en about it.<|end|><|start|>assistant<|channel|>commentary "
          'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome", "unit": "F"}<|call|>')


@pytest.mark.parametrize("reads_calls", [True, False])
def test_the_reader_at_every_split(reads_calls):
    want = None
    for cut in range(len(OUTPUT) + 1):
        p = harmony.HarmonySpec(reads_calls).parser()
        parts = [p.feed(OUTPUT[:cut]), p.feed(OUTPUT[cut:]), p.feed("", final=True)]
        got = ("".join(x.reasoning for x in parts), "".join(x.content for x in parts), p.tool_calls())
        assert got[0] == "Think <|en about it."
        if reads_calls:
            assert got[1] == "" and [(c["name"], c["arguments"]) for c in got[2]] == \
                [("get_weather", '{"city": "Rome", "unit": "F"}')]
        else:
            assert got[1] == '{"city": "Rome", "unit": "F"}' and got[2] == []
    plain = harmony.HarmonySpec(False).parser()  # not harmony's framing: content as written
    assert plain.feed("hello <|end|>", final=True).content == "hello <|end|>"


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    port = free_port()
    d = Daemon(tmp_path_factory.mktemp("d"), str(model_dir), "--num-kv-blocks", 512, "--max-num-seqs", 8,
               "--http", f"127.0.0.1:{port}", "--served-model-name", "gpt-oss")
    d.url = f"http://127.0.0.1:{port}"
    wait_http(d.url)
    yield d, openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    d.stop()


def test_analysis_is_reasoning_and_final_is_content(served):
    _, oai = served
    kw = dict(model="gpt-oss", messages=ASK, max_tokens=40, seed=4, temperature=1.0,
              extra_body={"max_reasoning_tokens": 6})
    r = oai.chat.completions.create(**kw)
    ch = r.choices[0]
    thought, content = ch.message.reasoning_content or "", ch.message.content or ""
    assert 1 <= r.usage.completion_tokens_details.reasoning_tokens <= 7
    assert "<|" not in thought + content and ch.finish_reason in ("stop", "length")
    (s_content, s_reasoning, calls, _), = streamed(oai.chat.completions.create(**kw, stream=True)).values()
    assert (s_content, s_reasoning, calls) == (content, thought, [])  # the same seed, streamed
    off = oai.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=8, seed=4, reasoning_effort="none")
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_round_trip(served, stream):
    d, oai = served
    kw = dict(model="gpt-oss", messages=ASK, tools=TOOLS, tool_choice="required", seed=5, temperature=1.0,
              max_tokens=300, extra_body={"max_reasoning_tokens": 4})
    if stream:
        (content, _, calls, finish), = streamed(oai.chat.completions.create(**kw, stream=True)).values()
        assert content == "" and finish == "tool_calls" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0][2]), SCHEMAS[calls[0][1]])
        return
    first = oai.chat.completions.create(**kw)
    ch = first.choices[0]
    valid_calls(ch.message.tool_calls, ch.finish_reason)
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    history = ASK + [ch.message.model_dump(exclude_none=True, exclude={"refusal"}),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 18 degrees"}]
    second = oai.chat.completions.create(model="gpt-oss", messages=history, tools=TOOLS, max_tokens=16, seed=5)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the model was shown the call in harmony's framing, then the result
    from ridge.daemon.client import Client
    with Client(d.endpoint) as c:
        shown = c.call("tokenize", messages=[{k: v for k, v in m.items() if k not in ("refusal", "reasoning")}
                                             for m in history], tools=TOOLS)
        text = c.call("detokenize", token_ids=shown["token_ids"], skip_special_tokens=False)["text"]
    assert f"<|start|>assistant to=functions.{call.function.name}<|channel|>commentary json<|message|>" in text
    assert '"Sunny, 18 degrees"<|end|>' in text and second.usage.prompt_tokens == shown["count"]


def test_auto_answers_text_or_one_valid_call(served):
    _, oai = served
    r = oai.chat.completions.create(model="gpt-oss", messages=ASK, tools=TOOLS, seed=1, temperature=1.0, n=2,
                                    max_tokens=200, extra_body={"max_reasoning_tokens": 4})
    for ch in r.choices:
        if ch.message.tool_calls:
            valid_calls(ch.message.tool_calls, ch.finish_reason)
            assert len(ch.message.tool_calls) == 1
        else:
            assert ch.finish_reason in ("stop", "length") and "<|" not in (ch.message.content or "")


def test_the_final_channel_holds_the_response_format(served):
    _, oai = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = oai.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=200, seed=2,
                                    extra_body={"max_reasoning_tokens": 3}, response_format={
                                        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
