"""This year's chat formats (issue 41, docs/protocol.md §3.2.3): Qwen3.5's XML
calls (<tool_call><function=NAME><parameter=KEY>, Qwen3-Coder's and
Qwen3-Next's too) and Gemma 4's (<|tool_call>call:NAME{key:<|"|>text<|"|>},
thinking in <|channel>thought ... <channel|>), chosen from the template with no
flag.

The templates are tests/chat_models.py's QWEN35 and GEMMA4, written there in
the real families' syntax and shape (each one's docstring says what it keeps);
Gemma 4's markers are special tokens of the tiny tokenizer, as in the real
one. The oracles: hand-written outputs for the reader (the same reading at
every cut point of the text), transformers' own rendering of the template
(apply_chat_template, with the messages in the shape the real template needs)
for the prompts, llguidance's matcher over the tokenizer for the grammars,
and jsonschema for every call a random model makes through the gateway with
the official openai, anthropic and ollama clients."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import ollama
import openai
import pytest
from transformers import AutoTokenizer

from chat_models import make_chat_model
from ridge.daemon.cli.config import defaults
from ridge.daemon.cli.serve import limits
from ridge.daemon.client import Client, merge_pieces
from ridge.daemon.frontend.chat_format import (FORMAT_MARKERS, GEMMA4, HERMES, QWEN3_XML, gemma_tool_responses,
                                               marker_texts, read_format)
from ridge.daemon.frontend.chat_output import OutputSpec
from ridge.daemon.frontend.validate import Validator
from ridge.tokenizer import Tokenizer
from test_chat_turns import accepts, gen, refuses_from
from test_daemon_harness import Daemon
from test_gateway import free_port, wait_http
from test_gateway_tools import ASK, SCHEMAS, TOOLS, streamed

TEXT_PARAMS = {"get_weather": frozenset({"city", "unit", "note"}), "now": frozenset({"zone"})}
FAMILIES = ("qwen35", "gemma4")
THINK, NO_THINK = {"enable_thinking": True}, {"enable_thinking": False}


# -- the reader: hand-written outputs, cut at every character -------------------------------------------------
def spec(fmt: str, start: str = "content", max_calls: int = 128) -> OutputSpec:
    roles = FORMAT_MARKERS[fmt] + (("think_open", "think_close") if start != "content" else ())
    return OutputSpec(start, fmt, max_calls, marker_texts(fmt, roles), TEXT_PARAMS)


def read(s: OutputSpec, pieces: list[str], cut: bool = False):
    """-> (content, reasoning, [(name, arguments)] joined from the streamed pieces). cut: the end is
    max_tokens'; a stream has then sent the pieces of the call it cut, and the calls are the parser's."""
    p = s.parser()
    content = reasoning = ""
    calls: list = []
    for i, piece in enumerate(pieces + [""]):
        got = p.feed(piece, final=i == len(pieces), cut=cut and i == len(pieces))
        content, reasoning = content + got.content, reasoning + got.reasoning
        merge_pieces(calls, got.pieces)
        for c in calls:  # what a client holds at any moment: a prefix of valid JSON
            assert c["arguments"] == "" or c["arguments"].startswith("{")
    whole = p.tool_calls()
    assert calls[:len(whole)] == whole and len(calls) <= len(whole) + cut
    return content, reasoning, [(c["name"], c["arguments"]) for c in whole]


def every_cut(s: OutputSpec, text: str):
    """The reading is the same whole, a character at a time, and cut in two at every character."""
    want = read(s, [text])
    assert read(s, list(text)) == want
    for i in range(1, len(text)):
        assert read(s, [text[:i], text[i:]]) == want, i
    return want


QWEN_CALLS = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nSaint "Malo"\n2\n</parameter>\n'
              '<parameter=days>\n3\n</parameter>\n<parameter=extra>\n{"a": [1, true]}\n</parameter>\n'
              '<parameter=note>\n42\n</parameter>\n<parameter=free>\nnot json\n</parameter>\n</function>\n'
              '</tool_call>\n<tool_call>\n<function=now>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n'
              '</tool_call>')


def test_qwen35_calls_read_as_json_by_each_parameters_type():
    content, reasoning, calls = every_cut(spec(QWEN3_XML, "think"), "Plan <it>.\n</think>\n\nLet me look.\n\n"
                                          + QWEN_CALLS)
    assert (content, reasoning) == ("Let me look.", "Plan <it>.\n")
    assert [n for n, _ in calls] == ["get_weather", "now"]
    # a string parameter stays text (even "42"), the others are JSON, and what is not JSON is its text
    assert json.loads(calls[0][1]) == {"city": 'Saint "Malo"\n2', "days": 3, "extra": {"a": [1, True]},
                                       "note": "42", "free": "not json"}
    assert json.loads(calls[1][1]) == {"zone": "UTC"}


def test_qwen35_one_call_without_parallel_calls_and_text_that_only_looks_like_one():
    one = '<tool_call>\n<function=now>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>'
    content, _, calls = every_cut(spec(QWEN3_XML, max_calls=1), one + "\n" + one)
    assert calls == [("now", '{"zone": "CET"}')] and content == one
    content, _, calls = every_cut(spec(QWEN3_XML), "a <tool_call>\n<nope> b")
    assert (content, calls) == ("a <tool_call>\n<nope> b", [])


GEMMA_CALLS = ('<|tool_call>call:get_weather{city:<|"|>Pa<ris, "x"\n<|"|>,days:3,extra:{a:[1,<|"|>b<|"|>,{z:null}],'
               'k:-2.5e3},flag:true,raw:foo}<tool_call|><|tool_call>call:now{zone:<|"|>UTC<|"|>}<tool_call|>')


def test_gemma4_calls_and_thinking_read_as_json():
    text = "<|channel>thought\nhm, a <b>\n<channel|>Sure." + GEMMA_CALLS
    content, reasoning, calls = every_cut(spec(GEMMA4, "maybe"), text)
    assert (content, reasoning) == ("Sure.", "hm, a <b>\n")
    assert json.loads(calls[0][1]) == {"city": 'Pa<ris, "x"\n', "days": 3,
                                       "extra": {"a": [1, "b", {"z": None}], "k": -2500.0}, "flag": True, "raw": "foo"}
    assert calls[1] == ("now", '{"zone": "UTC"}')
    # thinking turned off: the prompt closed the channel, and what the model writes is the answer
    assert every_cut(spec(GEMMA4), "No call <|tool") == ("No call <|tool", "", [])


def test_gemma4_a_call_cut_by_max_tokens_is_dropped_at_every_character():
    first, second = (c + "<tool_call|>" for c in GEMMA_CALLS.split("<tool_call|>")[:2])
    whole = read(spec(GEMMA4), [first])[2]
    done = second.index("}<tool_call|>") + 1  # from here on the second call is whole: only its close marker is cut
    for k in range(len(second) + 1):
        content, _, calls = read(spec(GEMMA4), ["Hi " + first + second[:k]], cut=True)
        assert content == "Hi" and calls == whole + ([("now", '{"zone": "UTC"}')] if k >= done else []), k


def test_qwen35_a_call_cut_by_max_tokens_is_dropped_at_every_character():
    call = '<tool_call>\n<function=now>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>'
    done = call.index("</function>") + len("</function>")
    for k in range(1, len(call) + 1):
        content, _, calls = read(spec(QWEN3_XML), ["Hi " + call[:k]], cut=True)
        # no call stands: the whitespace before the cut markup is the answer's, as it is for Hermes
        assert content.rstrip() == "Hi" and calls == ([("now", '{"zone": "UTC"}')] if k >= done else []), k


def test_each_format_is_told_from_its_template():
    from chat_models import GEMMA4 as GEMMA_TEMPLATE, HERMES as HERMES_TEMPLATE, QWEN35

    assert read_format(QWEN35) == (QWEN3_XML, True)
    assert read_format(HERMES_TEMPLATE) == (HERMES, True)  # JSON inside <tool_call>: Qwen2.5's, Qwen3's
    assert read_format(GEMMA_TEMPLATE) == (GEMMA4, True)


# -- the prompt and the grammar, through the validator -----------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("formats")
    return {f: make_chat_model(tmp, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def validators(models):
    out = {}
    for family, d in models.items():
        tok = Tokenizer.from_hf_dir(d)
        out[family] = Validator(tok, tok.vocab_size, 2048, 16, 256, limits(defaults(), 2048))
    return out


def test_markers_and_reasoning(validators):
    q, g = validators["qwen35"].chat, validators["gemma4"].chat
    assert (q.tool_format, q.reasoning, q.tool_responses) == (QWEN3_XML, True, False)
    assert q.markers["think_close"].text == "</think>"
    assert (g.tool_format, g.reasoning, g.tool_responses) == (GEMMA4, True, True)
    assert all(m.special for m in g.markers.values())
    assert (g.markers["think_open"].rest, g.markers["think_close"].text) == ("thought\n", "<channel|>")
    assert validators["qwen35"].generate(gen(messages=ASK, tools=TOOLS)).output.start == "think"
    off = validators["qwen35"].generate(gen(messages=ASK, tools=TOOLS, chat_template_kwargs=NO_THINK))
    assert off.output.start == "content"
    assert validators["gemma4"].generate(gen(messages=ASK, tools=TOOLS)).output.start == "content"
    on = validators["gemma4"].generate(gen(messages=ASK, tools=TOOLS, chat_template_kwargs=THINK))
    assert on.output.start == "maybe" and on.output.markers["think_open"] == "<|channel>thought\n"


HISTORY = ASK + [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_a", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
    {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": {"zone": "UTC"}}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "sunny", "temp": 18}'},
    {"role": "tool", "tool_call_id": "call_b", "content": "12:00"}]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_history_renders_as_the_template_renders_it(validators, models, family):
    """ridge's prompt is transformers' rendering of the same chat, in the shape the template reads."""
    v = validators[family]
    text = v.tokenizer.decode(v.generate(gen(messages=HISTORY, tools=TOOLS)).prompt_token_ids,
                              skip_special_tokens=False)
    calls = [{**c, "function": {"name": c["function"]["name"], "arguments": a}}
             for c, a in zip(HISTORY[1]["tool_calls"], ({"city": "Paris", "unit": "C"}, {"zone": "UTC"}))]
    shaped = ASK + [{"role": "assistant", "content": "", "tool_calls": calls}]
    if family == "gemma4":  # Gemma 4 reads results from the calling message, as {name, response}
        shaped[1]["tool_responses"] = [{"name": "get_weather", "response": {"sky": "sunny", "temp": 18}},
                                       {"name": "now", "response": "12:00"}]
        want_bits = ['<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>C<|"|>}<tool_call|>',
                     '<|tool_response>response:get_weather{sky:<|"|>sunny<|"|>,temp:18}<tool_response|>'
                     '<|tool_response>response:now{value:<|"|>12:00<|"|>}<tool_response|><|channel>thought\n<channel|>']
    else:
        shaped += HISTORY[2:]
        want_bits = ["<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\nC\n</parameter>",
                     '<|im_start|>user\n<tool_response>\n{"sky": "sunny", "temp": 18}\n</tool_response>\n'
                     "<tool_response>\n12:00\n</tool_response><|im_end|>"]
    oracle = AutoTokenizer.from_pretrained(models[family])
    assert text == oracle.apply_chat_template(shaped, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert all(b in text for b in want_bits)
    assert family != "gemma4" or gemma_tool_responses(shaped) == shaped  # no tool message: nothing to move


QWEN_CALL = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nSaint\nMalo\n</parameter>\n<parameter=days>\n'
             '3\n</parameter>\n<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>')
GEMMA_CALL = '<|tool_call>call:get_weather{city:<|"|>Saint\nMalo<|"|>,days:3,unit:<|"|>C<|"|>}<tool_call|>'
CALL = {"qwen35": QWEN_CALL, "gemma4": GEMMA_CALL}
CLOCK_CALL = {"qwen35": "<tool_call>\n<function=now>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
              "gemma4": '<|tool_call>call:now{zone:<|"|>UTC<|"|>}<tool_call|>'}
SEP = {"qwen35": "\n", "gemma4": ""}
BAD = {"qwen35": [QWEN_CALL.replace("\n3\n", "\n9\n"), QWEN_CALL.replace("\nC\n", "\nK\n"),
                  QWEN_CALL.replace("Saint\nMalo", "Saint-Malo-de-la-Lande"),
                  QWEN_CALL.replace("<parameter=city>\nSaint\nMalo\n</parameter>\n", "")],
       "gemma4": [GEMMA_CALL.replace("days:3", "days:9"), GEMMA_CALL.replace('<|"|>C<|"|>', '<|"|>K<|"|>'),
                  GEMMA_CALL.replace("city:", "town:"), GEMMA_CALL.replace("days:3,", "days:3,bogus:1,")]}


@pytest.mark.parametrize("family", FAMILIES)
def test_grammar_writes_the_format_held_to_the_schema(validators, family):
    v = validators[family]
    req = v.generate(gen(messages=ASK, tools=TOOLS, tool_choice="required", chat_template_kwargs=NO_THINK))
    two = CALL[family] + SEP[family] + CLOCK_CALL[family]
    assert accepts(v, req, CALL[family]) and accepts(v, req, two) and accepts(v, req, CLOCK_CALL[family])
    assert all(refuses_from(v, req, b) for b in BAD[family]) and refuses_from(v, req, "Sure")
    one = v.generate(gen(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                         chat_template_kwargs=NO_THINK))
    assert accepts(v, one, CALL[family]) and not accepts(v, one, two)
    auto = v.generate(gen(messages=ASK, tools=TOOLS, chat_template_kwargs=NO_THINK))
    assert accepts(v, auto, "No call.") and accepts(v, auto, "I look. " + CALL[family])
    assert refuses_from(v, auto, "I look. " + BAD[family][0])
    # thinking on: the answer's grammar begins after the thinking, which the model opens or the prompt did
    think = v.generate(gen(messages=ASK, tools=TOOLS, tool_choice="required", chat_template_kwargs=THINK))
    thought = {"qwen35": "a plan\n</think>\n\n", "gemma4": "<|channel>thought\na plan<channel|>"}[family]
    assert accepts(v, think, thought + CALL[family]) and refuses_from(v, think, thought + BAD[family][0])
    # the reader reads what the grammar admits as the call it is
    got = read(think.output, [thought + two])
    assert [json.loads(a) for _, a in got[2]] == [{"city": "Saint\nMalo", "days": 3, "unit": "C"}, {"zone": "UTC"}]
    assert got[:2] == ("", "a plan\n" if family == "qwen35" else "a plan")  # the thinking as written


# -- through the gateway, with the official clients --------------------------------------------------------------
@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    running: dict = {}

    def get(family: str):
        if family not in running:
            tmp = tmp_path_factory.mktemp(f"gw-{family}")
            http, olla = free_port(), free_port()
            d = Daemon(tmp, str(models[family]), "--num-kv-blocks", 512, "--max-num-seqs", 8, "--http",
                       f"127.0.0.1:{http}", "--ollama", f"127.0.0.1:{olla}", "--served-model-name", family)
            d.url, d.ollama = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{olla}"
            wait_http(d.url)
            wait_http(d.ollama)
            running[family] = d
        return running[family]

    yield get
    for d in running.values():
        d.stop()


def oai_of(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def valid(name: str, arguments) -> None:
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMAS[name])


NO_MARKUP = ("<tool_call>", "<function=", "<|tool_call>", "call:get_weather", "<think>", "</think>", "<|channel>",
             "<channel|>")


def clean(text: str | None, markup=NO_MARKUP) -> bool:
    return not any(m in (text or "") for m in markup)


def clean_thought(text: str | None) -> bool:
    """Thinking written freely may hold any text, but never the markers that frame it."""
    return clean(text, NO_MARKUP[-4:])


@pytest.mark.parametrize("family", FAMILIES)
def test_openai_forced_parallel_and_one_call_streamed_and_not(served, family):
    oai = oai_of(served(family))
    kw = dict(model=family, messages=ASK, tools=TOOLS, tool_choice="required", n=2, seed=3, temperature=1.0,
              max_tokens=200, extra_body={"chat_template_kwargs": NO_THINK})
    r = oai.chat.completions.create(**kw)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and not ch.message.content, ch
        for c in ch.message.tool_calls:
            valid(c.function.name, c.function.arguments)
    got = streamed(oai.chat.completions.create(**kw, stream=True))
    assert [([c[1:] for c in calls], finish) for _, _, calls, finish in got.values()] == \
        [([[c.function.name, c.function.arguments] for c in ch.message.tool_calls], ch.finish_reason)
         for ch in r.choices]  # the same seed, streamed: the same calls, ids aside
    one = oai.chat.completions.create(**{**kw, "parallel_tool_calls": False,
                                         "tool_choice": {"type": "function", "function": {"name": "now"}}})
    for ch in one.choices:
        assert ch.finish_reason == "tool_calls" and [c.function.name for c in ch.message.tool_calls] == ["now"]
        valid("now", ch.message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("family", FAMILIES)
def test_openai_auto_answers_text_or_valid_calls(served, family):
    oai = oai_of(served(family))
    for seed in (1, 2):
        r = oai.chat.completions.create(model=family, messages=ASK, tools=TOOLS, seed=seed, max_tokens=60, n=2,
                                        extra_body={"chat_template_kwargs": NO_THINK})
        for ch in r.choices:
            assert clean(ch.message.content)
            for c in ch.message.tool_calls or ():
                valid(c.function.name, c.function.arguments)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_result_goes_back_through_the_template(served, family):
    d = served(family)
    oai = oai_of(d)
    first = oai.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, seed=5, max_tokens=200)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and clean_thought(getattr(msg, "reasoning_content", None))
    call = msg.tool_calls[0]
    said = {k: v for k, v in msg.model_dump(exclude_none=True).items() if k in ("role", "content", "tool_calls")}
    history = ASK + [said,
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 18 degrees"}]
    second = oai.chat.completions.create(model=family, messages=history, tools=TOOLS, max_tokens=16, seed=5)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with Client(d.endpoint) as c:
        shown = c.call("tokenize", messages=history, tools=TOOLS)
        text = c.call("detokenize", token_ids=shown["token_ids"], skip_special_tokens=False)["text"]
    assert second.usage.prompt_tokens == shown["count"]
    if family == "gemma4":
        assert f'<|tool_call>call:{call.function.name}{{' in text
        result = f'<|tool_response>response:{call.function.name}{{value:<|"|>Sunny, 18 degrees<|"|>}}<tool_response|>'
        assert result in text
    else:
        assert f"<function={call.function.name}>" in text
        assert "<|im_start|>user\n<tool_response>\nSunny, 18 degrees\n</tool_response><|im_end|>" in text


@pytest.mark.parametrize("family", FAMILIES)
def test_openai_thinking_is_split_from_the_content(served, family):
    oai = oai_of(served(family))
    kw = dict(model=family, messages=ASK, max_tokens=40, seed=4, temperature=1.0,
              extra_body={"chat_template_kwargs": THINK, "max_reasoning_tokens": 8})
    r = oai.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.reasoning_content and clean_thought(msg.reasoning_content) and clean(msg.content)
    assert 1 <= r.usage.completion_tokens_details.reasoning_tokens <= 8 + 3  # the budget, and the markers
    (content, reasoning, calls, _), = streamed(oai.chat.completions.create(**kw, stream=True)).values()
    assert (content, reasoning, calls) == (msg.content or "", msg.reasoning_content, [])
    calls = oai.chat.completions.create(**{**kw, "max_tokens": 200}, tools=TOOLS, tool_choice="required")
    ch = calls.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.reasoning_content and not ch.message.content
    for c in ch.message.tool_calls:
        valid(c.function.name, c.function.arguments)


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": "", "input_schema": t["function"]["parameters"]}
                   for t in TOOLS]


@pytest.mark.parametrize("family", FAMILIES)
def test_anthropic_tool_use_and_thinking_blocks(served, family):
    d = served(family)
    claude = anthropic.Anthropic(base_url=d.url, api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=family, max_tokens=300, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
              thinking={"type": "enabled", "budget_tokens": 8}, extra_body={"seed": 6, "temperature": 1.0})
    m = claude.messages.create(**kw)
    kinds = [b.type for b in m.content]
    assert m.stop_reason == "tool_use" and kinds[0] == "thinking" and "tool_use" in kinds and "text" not in kinds
    assert clean_thought(m.content[0].thinking)
    for b in m.content[1:]:
        valid(b.name, b.input)
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [(b.type, getattr(b, "input", None))
                                                                             for b in m.content]
    # the call and its result back as Anthropic's blocks, rendered through the template
    use = next(b for b in m.content if b.type == "tool_use")
    back = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}]
    again = claude.messages.create(model=family, max_tokens=8, messages=back, tools=ANTHROPIC_TOOLS)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("family", FAMILIES)
def test_ollama_thinking_calls_and_tool_history(served, family):
    d = served(family)
    client = ollama.Client(host=d.ollama, timeout=120)
    r = client.chat(model=family, messages=ASK, think=True, options={"num_predict": 24, "seed": 4})
    assert clean_thought(r.message.thinking) and clean(r.message.content)
    thinking = content = ""
    for part in client.chat(model=family, messages=ASK, think=True, stream=True,
                            options={"num_predict": 24, "seed": 4}):
        thinking, content = thinking + (part.message.thinking or ""), content + (part.message.content or "")
    assert (thinking, content) == (r.message.thinking or "", r.message.content or "")
    for seed in (1, 2, 3):
        got = client.chat(model=family, messages=ASK, tools=TOOLS, think=False,
                          options={"num_predict": 60, "seed": seed})
        assert clean(got.message.content)
        for c in got.message.tool_calls or ():
            valid(c.function.name, c.function.arguments)
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "now", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "content": "noon", "tool_name": "now"}]
    # Ollama's tool history (results named by tool_name) is the OpenAI chat's: the same greedy answer
    got = client.chat(model=family, messages=history, tools=TOOLS, think=False,
                      options={"num_predict": 12, "temperature": 0})
    openai_shape = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "now", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "content": "noon", "tool_call_id": "call_1_0"}]
    want = oai_of(d).chat.completions.create(model=family, messages=openai_shape, tools=TOOLS, max_tokens=12,
                                             temperature=0, extra_body={"chat_template_kwargs": NO_THINK})
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in want.choices[0].message.tool_calls or ()]
    said = [(c.function.name, dict(c.function.arguments)) for c in got.message.tool_calls or ()]
    assert (got.message.content or "", said) == (want.choices[0].message.content or "", calls)


SHAPES = {"type": "function", "function": {"name": "shape", "parameters": {"type": "object", "properties": {
    "a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"},
    "d": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/pt"}]}, "e": {"enum": [1, "x"]}},
    "required": ["c"], "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}}}
SHAPE_CALLS = {  # (arguments, admitted)
    "gemma4": [("c:true", True), ('a:<|"|>x<|"|>,c:false', True), ("b:2,c:true,d:null,e:1", True),
               ('a:<|"|><|"|>,b:-3,c:true,d:{x:1.5},e:<|"|>x<|"|>', True), ("", False), ('c:true,a:<|"|>x<|"|>', False),
               ("c:true,d:{}", False), ("c:true,e:2", False), ("c:1", False)],
    "qwen35": [("c", "true", True), ("ac", "x\ntrue", True), ("bcde", '2\ntrue\n{"x": 1.5}\n"x"', True),
               ("", "", False), ("c", "1", False), ("cd", 'true\n{"y": 1}', False)]}


@pytest.mark.parametrize("family", FAMILIES)
def test_optional_parameters_unions_and_references(validators, family):
    v = validators[family]
    req = v.generate(gen(messages=ASK, tools=[SHAPES], tool_choice="required", chat_template_kwargs=NO_THINK))
    for case in SHAPE_CALLS[family]:
        if family == "gemma4":
            text, ok = f"<|tool_call>call:shape{{{case[0]}}}<tool_call|>", case[1]
        else:
            keys, values, ok = case
            params = "".join(f"<parameter={k}>\n{x}\n</parameter>\n" for k, x in zip(keys, values.split("\n")))
            text = f"<tool_call>\n<function=shape>\n{params}</function>\n</tool_call>"
        assert accepts(v, req, text) == ok, text
