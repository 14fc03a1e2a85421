"""Issue 38: schemas, grammars and chat templates that would end or hold the daemon.

A chain of 10,000 $defs or Lark rules overflowed llguidance's native stack while it
compiled on an admission worker (SIGSEGV: the whole daemon); a schema that compiles for
seconds held admission; a chat template could write 50 MB or loop for minutes. Each is
sent through every route that reaches it, to a real daemon with its OpenAI and Ollama
listeners, which must refuse it with a clear error and keep answering."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest

from chat_models import make_chat_model
from test_daemon_harness import ROOT, Daemon, Raw
from test_gateway import free_port, wait_http

CHAIN = 10_000
# Client kwargs drive the template: `bomb` writes that many characters, `spin` loops spin**2 times.
HOSTILE = ("{%- if bomb is defined %}{{ 'x' * bomb }}{% endif %}"
           "{%- if spin is defined %}{% for i in range(spin) %}{% for j in range(spin) %}{% endfor %}"
           "{% endfor %}{% endif %}")
MSGS = [{"role": "user", "content": "hello"}]


def ref_chain(n: int = CHAIN) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def rule_chain(n: int = CHAIN) -> str:
    return "\n".join(["start: r0"] + [f"r{i}: r{i + 1}" for i in range(n)] + [f'r{n}: "x"'])


def slow_schema() -> dict:
    """Optional properties cost llguidance's JSON compiler time quadratic in their number, under any
    of its limits: 3,000 take 2-3 s on a shared 2-core machine, these (just under MAX_CHAIN) 2 s on a quiet
    one and 9 s on a shared one, past COMPILE_SECONDS either way."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4900)}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    model = make_chat_model(tmp, "hermes")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": HOSTILE + cfg["chat_template"]}))
    http, ollama = free_port(), free_port()
    d = Daemon(tmp, str(model), "--num-kv-blocks", 256, "--max-num-seqs", 4, "--served-model-name", "tiny",
               "--http", f"127.0.0.1:{http}", "--ollama", f"127.0.0.1:{ollama}")
    d.http, d.ollama = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{ollama}"
    wait_http(d.http)
    wait_http(d.ollama)
    yield d
    d.stop()


def socket_generate(d: Daemon, rid: str, timeout: float = 30.0, **body) -> dict:
    """A version-2 generate on a fresh connection -> its final or error frame."""
    c = Raw(d.endpoint)
    try:
        c.send({"type": "generate", "id": rid, "stream": False, **body}, v=2)
        deadline = time.monotonic() + timeout
        while True:
            m = c.recv(max(0.1, deadline - time.monotonic()))
            if m.get("id") == rid and m["type"] in ("final", "error"):
                return m
    finally:
        c.close()


def post(url: str, body: dict, timeout: float = 30.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_serving(d: Daemon) -> None:
    """The daemon process lives and answers a plain request."""
    assert d.proc.poll() is None, d.output()[-3000:]
    m = socket_generate(d, f"ok-{time.monotonic_ns()}", messages=MSGS, params={"max_tokens": 2})
    assert m["type"] == "final", m


def test_chains_through_the_socket_are_refused(daemon):
    for fmt, says in [({"type": "json_schema", "json_schema": {"schema": ref_chain()}}, "the JSON schema is too deep"),
                      ({"type": "grammar", "grammar": rule_chain()}, "the grammar is too deep")]:
        m = socket_generate(daemon, "chain", prompt="hi", params={"max_tokens": 4, "response_format": fmt})
        assert m["type"] == "error" and says in m["message"], m
        assert_serving(daemon)


def test_chains_through_the_gateway_and_tools_are_refused(daemon):
    url = f"{daemon.http}/v1/chat/completions"
    base = {"model": "tiny", "messages": MSGS, "max_tokens": 4}
    status, body = post(url, {**base, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "c", "schema": ref_chain()}}})
    assert status == 400 and "too deep to compile" in body["error"]["message"], body
    assert_serving(daemon)


def test_chains_in_tools_parameters_are_refused(daemon, tmp_path):
    """tools[].parameters (and Anthropic's input_schema, which becomes them) go into the chat grammar.
    The template writes the tools into the prompt, so a 10,000-link chain is 350K tokens for the
    tiny byte-level model, past its context: the validator is given a context that takes it, as a
    real tokenizer and a 128K context would."""
    from ridge.daemon import protocol as P
    from ridge.daemon.cli.config import defaults
    from ridge.daemon.cli.serve import limits
    from ridge.daemon.frontend.validate import Validator
    from ridge.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(make_chat_model(tmp_path, "hermes"))
    ctx = 1 << 20
    v = Validator(tok, tok.vocab_size, ctx, 16, ctx // 16, limits(defaults(), ctx))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", **ref_chain()}}}
    for choice in ("required", "auto"):
        env = P.Envelope("generate", "t", {"messages": MSGS, "tools": [tool], "tool_choice": choice,
                                          "params": {"max_tokens": 4}}, 2)
        with pytest.raises(P.ProtocolError, match="tools: the chat grammar .* is too deep to compile"):
            v.generate(env)
    assert_serving(daemon)


def test_chains_through_ollama_format_are_refused(daemon):
    status, body = post(f"{daemon.ollama}/api/chat", {"model": "tiny", "messages": MSGS, "stream": False,
                                                      "format": ref_chain(), "options": {"num_predict": 4}})
    assert status == 400 and "too deep to compile" in body["error"], body
    assert_serving(daemon)


def test_a_schema_that_compiles_for_seconds_is_refused_within_the_budget(daemon):
    from ridge.engine.structured.bounds import COMPILE_SECONDS

    t = time.monotonic()
    m = socket_generate(daemon, "slow", prompt="hi", params={
        "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {"schema": slow_schema()}}})
    assert m["type"] == "error" and "took longer than" in m["message"], m
    assert time.monotonic() - t < COMPILE_SECONDS + 5
    assert_serving(daemon)


@pytest.mark.parametrize("kwargs, says", [({"bomb": 50_000_000}, "larger than"),
                                          ({"spin": 100_000}, "ran longer than")])
def test_a_chat_template_past_its_budget_is_refused(daemon, kwargs, says):
    t = time.monotonic()
    m = socket_generate(daemon, "tpl", messages=MSGS, chat_template_kwargs=kwargs, params={"max_tokens": 2})
    assert m["type"] == "error" and "the chat template failed" in m["message"] and says in m["message"], m
    assert time.monotonic() - t < 10
    assert_serving(daemon)


def test_the_deepest_grammar_admitted_compiles_on_a_small_caller_stack():
    """The bound's own margin: grammars just under MAX_CHAIN, in the shapes that cost the most stack
    a step, compile while the caller's thread has 2 MiB (an admission worker's under `ulimit -s
    unlimited`). In a subprocess: a crash here is a failure, not the end of the test run."""
    script = textwrap.dedent("""
        import json, sys, threading
        sys.path.insert(0, "tests")
        from pathlib import Path
        import tempfile
        from tiny_models import write_tokenizer_files
        from ridge.tokenizer import Tokenizer
        from ridge.engine.structured.bounds import MAX_CHAIN, chain_weight
        from ridge.engine.structured.format import Constraint
        from ridge.engine.structured.grammar import GrammarCompiler, grammar_text
        d = Path(tempfile.mkdtemp()); write_tokenizer_files(d)
        tok = Tokenizer.from_hf_dir(d)
        gc = GrammarCompiler(tok, tok.vocab_size)
        n = MAX_CHAIN - 2
        lark = Constraint("grammar", "\\n".join(["start: r0"] + [f"r{i}: r{i+1}" for i in range(n)] + [f'r{n}: "x"']))
        links = MAX_CHAIN // 8 - 1  # 8 steps a link: 3 nested objects, their maps, a $ref
        defs = {f"d{i}": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
                "type": "object", "properties": {"c": {"$ref": f"#/$defs/d{i+1}"}}}}}}} for i in range(links)}
        defs[f"d{links}"] = {"type": "string"}
        nested = Constraint("json_schema", json.dumps({"$ref": "#/$defs/d0", "$defs": defs}))
        def run():
            for c in (lark, nested):
                assert MAX_CHAIN - 300 < chain_weight(grammar_text(c)) <= MAX_CHAIN, chain_weight(grammar_text(c))
                gc.compile(c)
            print("compiled")
        threading.stack_size(2 << 20)
        t = threading.Thread(target=run); t.start(); t.join()
    """)
    p = subprocess.run([sys.executable, "-P", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "compiled" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])
