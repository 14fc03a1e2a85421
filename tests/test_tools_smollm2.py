"""Forced tool calls on the embedded SmolLM2, whose chat template renders no
tools (so ridge writes their prompt, Hermes blocks): every call of 3 seeds x
n = 2, for `required` with parallel calls and for a named tool without, is
read from the output and its arguments validate against the tool's schema.
The requests go through the daemon's own validator and stream reader, on an
engine in this process; one engine run holds them all."""
from __future__ import annotations

import json

import jsonschema
import pytest

from ridge.daemon import protocol as P
from ridge.daemon.cli.config import defaults
from ridge.daemon.cli.serve import limits
from ridge.daemon.frontend.streams import InFlight
from ridge.daemon.frontend.validate import Validator
from test_structured_smollm2 import engine  # noqa: F401  (its fixture: SmolLM2 in fp32, one thread)

pytestmark = pytest.mark.slow
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                         "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SEEDS = (1, 2, 3)


def test_every_forced_call_validates(engine):
    info = engine.model_info()
    v = Validator(engine.tokenizer, info["vocab_size"], info["max_model_len"], info["block_size"],
                  info["num_kv_blocks"], limits(defaults(), info["max_model_len"]), engine.grammars)
    assert v.chat.info() == {"tool_format": "hermes", "tool_prompt": "ridge", "reasoning": False}
    kinds = {"required": ("required", True), "named": ({"type": "function", "function": {"name": "get_weather"}}, False)}
    flights = {}
    for kind, (choice, parallel) in kinds.items():
        for seed in SEEDS:
            rid = f"{kind}-{seed}"
            req = v.generate(P.Envelope("generate", rid, {
                "messages": [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}],
                "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel, "stream": False,
                "params": {"n": 2, "seed": seed, "temperature": 1.0, "max_tokens": 100}}))
            engine.add_request(rid, req.prompt_token_ids, req.params)
            flights[rid] = InFlight(None, rid, rid, False, 2, False, req.output)
    while engine.has_unfinished():
        for o in engine.step():
            flights[o.request_id].add(o)
    for rid, inf in flights.items():
        for ch in inf.final()["choices"]:
            calls, reason = ch["tool_calls"], ch["finish_reason"]
            assert reason in ("tool_calls", "length") and (calls or reason == "length"), (rid, ch)
            for c in calls:  # a call cut by max_tokens is dropped: those returned are whole
                jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
            if rid.startswith("named"):
                assert [c["name"] for c in calls] == ["get_weather"] and reason == "tool_calls", ch
