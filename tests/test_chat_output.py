"""The output reader (daemon/chat_output.py): thinking, content and tool calls
of each family's format, the same whether the text comes whole or a character
at a time; held-back marker prefixes; calls cut short; text that only looks
like a call."""
from __future__ import annotations

import json
import re

import pytest

from ridge.daemon.frontend.chat_format import HERMES, LLAMA3_JSON, MARKER_TEXT, MISTRAL, read_format
from ridge.daemon.frontend.chat_output import OutputSpec
from ridge.daemon.client import merge_pieces

MARKERS = {HERMES: ("call_open", "call_close"), LLAMA3_JSON: ("python_tag",), MISTRAL: ("tool_calls",), None: ()}


def spec(fmt=HERMES, start="content", max_calls=128):
    roles = MARKERS[fmt] + (("think_open", "think_close") if start != "content" else ())
    return OutputSpec(start, fmt, max_calls, {r: MARKER_TEXT[r] for r in roles})


def read(s: OutputSpec, text: str, step: int):
    """Feed text in pieces of `step` characters -> (content, reasoning, calls from the pieces, parser)."""
    p = s.parser()
    content, reasoning, pieces = "", "", []
    chunks = [text[i:i + step] for i in range(0, len(text), step)] + [""]
    for i, chunk in enumerate(chunks):
        got = p.feed(chunk, final=i == len(chunks) - 1)
        content, reasoning = content + got.content, reasoning + got.reasoning
        merge_pieces(pieces, got.pieces)
    return content, reasoning, pieces, p


def every_split(s: OutputSpec, text: str):
    """The reading, checked to be the same at every piece size; -> (content, reasoning, calls)."""
    results = []
    for step in (1, 2, 3, 7, len(text) or 1):
        content, reasoning, pieces, p = read(s, text, step)
        assert pieces == p.tool_calls(), "the pieces join into the calls the parser holds"
        results.append((content, reasoning, [(c["name"], c["arguments"]) for c in pieces]))
    assert all(r == results[0] for r in results), results
    return results[0]


def test_hermes_text_then_calls():
    text = ('Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"x": "}"}]}}'
            '\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    content, reasoning, calls = every_split(spec(), text)
    assert content == "Let me look." and reasoning == ""
    assert calls == [("get_weather", '{"city": "Paris", "n": [1, {"x": "}"}]}'), ("now", "{}")]
    assert json.loads(calls[0][1]) == {"city": "Paris", "n": [1, {"x": "}"}]}


def test_hermes_one_call_when_parallel_is_off_and_text_around():
    block = '<tool_call>\n{"name": "f", "arguments": {"q": "a\\"b"}}\n</tool_call>'
    content, _, calls = every_split(spec(max_calls=1), block + "\nthen " + block)
    assert calls == [("f", '{"q": "a\\"b"}')] and content == "then " + block


def test_marker_prefixes_are_held_back_until_known():
    p = spec().parser()
    assert p.feed("I use <tool").content == "I use"  # the space too: it may precede a call
    assert p.feed("box> here").content == " <toolbox> here"
    assert p.feed("", final=True).content == ""


def test_trailing_whitespace_is_kept_when_no_call_follows():
    assert every_split(spec(), "answer \n") == ("answer \n", "", [])


def test_thinking_opened_by_the_prompt():
    content, reasoning, calls = every_split(spec(start="think"), "\nplan: a < b </think\n</think>\n\nThe answer.")
    assert reasoning == "\nplan: a < b </think\n" and content == "The answer." and calls == []


def test_thinking_the_model_opens_or_not():
    assert every_split(spec(start="maybe"), "  <think>hm</think>ok") == ("ok", "hm", [])
    assert every_split(spec(start="maybe"), "<thinking is free") == ("<thinking is free", "", [])
    assert every_split(spec(start="maybe"), "no thinking") == ("no thinking", "", [])
    # never closed: it is all thinking, and the content is empty
    assert every_split(spec(start="think"), "still thinking <") == ("", "still thinking <", [])


def test_a_call_after_thinking():
    text = 'a<tool_call> in thought</think>\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert every_split(spec(start="think"), text) == ("", "a<tool_call> in thought", [("f", '{"a": 1}')])


def test_llama3_json_calls():
    one = '{"name": "f", "parameters": {"a": 1}}'
    assert every_split(spec(LLAMA3_JSON), one) == ("", "", [("f", '{"a": 1}')])
    two = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "; {"}}'
    assert every_split(spec(LLAMA3_JSON), two)[2] == [("f", '{"a": 1}'), ("g", '{"b": "; {"}')]
    assert every_split(spec(LLAMA3_JSON), 'Use {"name": "f"}') == ('Use {"name": "f"}', "", [])


def test_mistral_array():
    text = '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, 2]}}, {"name": "g", "arguments": {"s": "]"}}]'
    assert every_split(spec(MISTRAL), "Sure. " + text) == ("Sure.", "", [("f", '{"a": [1, 2]}'), ("g", '{"s": "]"}')])


def test_a_call_cut_short_stays_a_call_and_one_without_a_name_is_content():
    content, _, calls = every_split(spec(), 'x <tool_call>\n{"name": "f", "arguments": {"a": "par')
    assert (content, calls) == ("x", [("f", '{"a": "par')])
    cut = 'x <tool_call>\n{"na'
    assert every_split(spec(), cut) == (cut, "", [])


def test_an_unreadable_block_is_content():
    text = "<tool_call>\nnot json</tool_call> after"
    assert every_split(spec(), text) == (text, "", [])


def test_names_come_first_and_arguments_in_pieces():
    p = spec().parser()
    first = p.feed('<tool_call>\n{"name": "f", "arguments": {"a"')
    assert first.pieces == [{"index": 0, "id": p.calls[0]["id"], "name": "f", "arguments": '{"a"'}]
    assert p.feed(': 2}}\n</tool_call>', final=True).pieces == [{"index": 0, "arguments": ": 2}"}]


def test_call_ids():
    assert re.fullmatch(r"call_[0-9a-f]{24}", spec().new_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", spec(MISTRAL).new_id())


@pytest.mark.parametrize("template,expected", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", (HERMES, False)),  # renders no tools: ridge's prompt
    ("{{ tools | tojson }}<tool_call>", (HERMES, True)),
    ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", (MISTRAL, True)),
    ("<|start_header_id|>{{ tools }}", (LLAMA3_JSON, True)),
    ("{{ tools }}<|tool_call|>", (None, True)),  # Granite's and Phi-4's own format: refused
])
def test_the_format_is_read_from_the_template(template, expected):
    assert read_format(template) == expected
