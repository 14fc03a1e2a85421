"""A request declared once (ridge/request.py): the msgpack checks, the gateway's dialects, the CLI's
flags and the engine's SamplingParams all come from the one declaration, and admission is one set of
rules (engine/admit.py). End to end, a sampler field reaches /v1/responses and /v1/messages as it
reaches /v1/chat/completions: a real `ridge serve --http` on a tiny model, through the `openai` and
`anthropic` packages."""
from __future__ import annotations

import argparse
from dataclasses import fields

import anthropic
import openai
import pytest

import ridge.daemon.protocol as P
from ridge.daemon.cli.commands import add_sampling_args, sampling_fields
from ridge.daemon.gateway.anthropic_schemas import MessagesRequest
from ridge.daemon.gateway.dialects import ANTHROPIC, OLLAMA, OPENAI
from ridge.daemon.gateway.ollama_schemas import Options
from ridge.daemon.gateway.responses_schemas import ResponsesRequest
from ridge.daemon.gateway.schemas import ChatCompletionRequest
from ridge.engine.admit import Rules
from ridge.engine.sampling_params import SamplingParams
from ridge.errors import InvalidRequest
from ridge.request import SAMPLER_LETTERS, FieldError, Sampling, specs, wire_specs
from test_daemon_harness import Daemon
from test_gateway import free_port, wait_http
from tiny_models import make_tiny


# -- one declaration, everything derived ----------------------------------------------------------------
def test_the_engine_holds_exactly_the_declared_fields():
    declared = [f.name for f in fields(Sampling)]
    assert [f.name for f in fields(SamplingParams) if f.init] == declared
    for name, s in specs().items():
        assert getattr(SamplingParams(), name) == s.default_value, name


@pytest.mark.parametrize("dialect,model", [(OPENAI, ChatCompletionRequest), (OPENAI, ResponsesRequest),
                                           (ANTHROPIC, MessagesRequest), (OLLAMA, Options)])
def test_each_dialect_names_every_field_it_does_not_exclude(dialect, model):
    taken = set(dialect.names())
    assert taken <= set(model.model_fields)
    assert {s.name for s in dialect.names().values()} == set(wire_specs()) - dialect.exclude
    schema = model.model_json_schema()["properties"]
    for api, s in dialect.names().items():
        assert schema[api].get("description"), api  # the declared doc (or the API's note) is the schema's


def test_the_cli_flags_are_the_declared_ones_with_their_defaults():
    p = argparse.ArgumentParser()
    add_sampling_args(p)
    flagged = {n: s for n, s in specs().items() if s.rule.flag}
    args = p.parse_args([])
    for name, s in flagged.items():
        assert getattr(args, name) == s.default_value, name
    assert sampling_fields(args) == {"max_tokens": specs()["max_tokens"].default_value}
    args = p.parse_args(["--min-p", "0.05", "--stop", "a", "--stop", "b", "--dry-multiplier", "0.5"])
    assert sampling_fields(args) == {"max_tokens": 256, "min_p": 0.05, "stop": ["a", "b"], "dry_multiplier": 0.5}
    SamplingParams(**sampling_fields(args))  # what the flags make, the engine takes


def test_llama_servers_letter_string_is_its_sampler_order():
    assert SamplingParams(samplers="dkypmxt")._order == ("dry", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                                         "temperature")
    assert SamplingParams(samplers="edskypmxt")._order == tuple(SAMPLER_LETTERS.values())
    with pytest.raises(FieldError, match="samplers.*'q'"):
        SamplingParams(samplers="kqt")


def test_a_bad_value_names_its_field_with_the_declared_bounds():
    for name, value, words in [("top_p", 0.0, "in (0, 1]"), ("max_tokens", 0, "an integer in [1, 1048576]"),
                               ("seed", -1, "[0, "), ("stop", ["a", ""], "non-empty strings"),
                               ("temperature", float("inf"), "a finite number")]:
        with pytest.raises(FieldError) as e:
            SamplingParams(**{name: value})
        assert e.value.field == name and words in str(e.value), str(e.value)


# -- the msgpack side: the declared wire fields, and what comes next refused by name --------------------------
@pytest.fixture(scope="module")
def validator(tmp_path_factory):
    from tiny_models import write_tokenizer_files

    from ridge.daemon.cli.config import defaults
    from ridge.daemon.cli.serve import limits
    from ridge.daemon.frontend.validate import Validator
    from ridge.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    tok = Tokenizer.from_hf_dir(d)
    return Validator(tok, tok.vocab_size, 64, 16, 8, limits(defaults(), 64))


def refused(validator, body) -> P.ProtocolError:
    with pytest.raises(P.ProtocolError) as e:
        validator.generate(P.Envelope("generate", "g", body))
    return e.value


def test_every_wire_field_is_taken_on_the_wire(validator):
    for name, s in wire_specs().items():
        value = {"logit_bias": {3: 1.0}, "samplers": "kt", "response_format": {"type": "text"}, "max_tokens": 8}.get(
            name, s.default_value)
        if value is None:
            continue
        req = validator.generate(P.Envelope("generate", "g", {"prompt": "x", "params": {name: value}}))
        assert getattr(req.params, name) is not None, name


def test_images_and_an_adapter_are_refused_by_name_until_they_are_served(validator):
    e = refused(validator, {"prompt": "x", "images": 1})  # a text model (tests/test_image_input.py: frames)
    assert (e.code, e.message) == (P.INVALID_REQUEST, "images: this model takes no image input")
    e = refused(validator, {"prompt": "x", "adapter": "sql-lora"})
    assert (e.code, e.message) == (P.INVALID_REQUEST, "adapter: this daemon serves no adapters")
    e = refused(validator, {"prompt": "x", "images": "cat.png"})
    assert e.code == P.INVALID_FIELD and e.message.startswith("images must be an integer")
    assert validator.generate(P.Envelope("generate", "g", {"prompt": "x", "images": 0})).params


# -- admission: one set of rules ------------------------------------------------------------------------------
def test_admission_fits_max_tokens_and_refuses_what_never_fits():
    rules = Rules(vocab_size=100, max_model_len=64, block_size=16, num_blocks=8, max_prompt_tokens=None,
                  max_tokens=64, max_n=4, grammars=None)
    a = rules.admit([1, 2, 3], SamplingParams(max_tokens=50))
    assert a.params.max_tokens == 50 and a.prompt_token_ids == [1, 2, 3]
    assert rules.admit([1] * 60, SamplingParams(max_tokens=50)).params.max_tokens == 4  # the context's end
    with pytest.raises(FieldError, match="^n must be an integer in \\[1, 4\\]"):
        rules.admit([1], SamplingParams(n=5, max_tokens=8))
    with pytest.raises(FieldError, match="^stop_token_ids"):
        rules.admit([1], SamplingParams(stop_token_ids=[100], max_tokens=8))
    for ids in ([], [1] * 64, [100]):
        with pytest.raises(InvalidRequest):
            rules.admit(ids, SamplingParams(max_tokens=8))
    small = Rules(vocab_size=100, max_model_len=64, block_size=16, num_blocks=2, max_prompt_tokens=None,
                  max_tokens=None, max_n=None, grammars=None)
    with pytest.raises(InvalidRequest, match="needs 3 KV blocks and the pool has 2"):
        small.admit([1] * 20, SamplingParams(max_tokens=20))


# -- end to end: the samplers on /v1/responses and /v1/messages -----------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("declared")
    model, _, _ = make_tiny(tmp, "llama")
    port = free_port()
    d = Daemon(tmp, str(model), "--http", f"127.0.0.1:{port}", "--served-model-name", "tiny")
    d.url = f"http://127.0.0.1:{port}"
    wait_http(d.url)
    yield d
    d.stop()


USER = [{"role": "user", "content": "one two one two one two"}]
PENALTY = {"repeat_penalty": 8.0, "repeat_last_n": -1}
TOKENS = 24


def test_a_sampler_field_is_honoured_on_responses_and_messages(daemon):
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=60)

    def chat(extra):
        return oai.chat.completions.create(model="tiny", messages=USER, max_tokens=TOKENS, temperature=0,
                                           extra_body=extra).choices[0].message.content

    plain, penalized = chat({}), chat(PENALTY)
    assert plain != penalized  # greedy on a tiny random model repeats itself; the penalty changes that
    for extra, want in (({}, plain), (PENALTY, penalized)):
        r = oai.responses.create(model="tiny", input=USER, max_output_tokens=TOKENS, temperature=0, extra_body=extra)
        assert r.output_text == want, extra
        m = claude.messages.create(model="tiny", messages=USER, max_tokens=TOKENS,
                                   extra_body={"temperature": 0, **extra})
        assert "".join(b.text for b in m.content) == want, extra


def test_a_bad_sampler_value_is_refused_naming_it_on_each_route(daemon):
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="min_p"):
        oai.responses.create(model="tiny", input=USER, max_output_tokens=4, extra_body={"min_p": 2.0})
    with pytest.raises(anthropic.BadRequestError, match="min_p"):
        claude.messages.create(model="tiny", messages=USER, max_tokens=4, extra_body={"min_p": 2.0})
    with pytest.raises(anthropic.BadRequestError, match="repeat_penalty.*repetition_penalty"):
        claude.messages.create(model="tiny", messages=USER, max_tokens=4,
                               extra_body={"repeat_penalty": 1.1, "repetition_penalty": 1.2})


# -- protocol version gates: one table ------------------------------------------------------------------------
def test_every_version_gate_reads_since():
    """No module compares a protocol version with a number: the version each feature came in is
    written once, in protocol.SINCE, and gates ask protocol.speaks / too_old."""
    import ast
    from pathlib import Path

    names = {"v", "version"}
    root = Path(P.__file__).resolve().parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "protocol.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = any((isinstance(x, ast.Name) and x.id in names) or
                        (isinstance(x, ast.Attribute) and x.attr in names) for x in sides)
            number = any(isinstance(x, ast.Constant) and type(x.value) is int for x in sides)
            if named and number:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"version compared with a number outside protocol.SINCE: {found}"
