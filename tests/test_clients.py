"""Every client a local user has (issue 43): what real clients send, against a
real `ridge serve --http --ollama` on a tiny random model whose context is 256
tokens. Claude Code's requests through the `anthropic` package (system
messages among the turns, max_tokens far past the context), `curl -d` and
litellm's untyped POSTs on both ports, and /openapi.json and the 405s against
the routes the app really has. No mocks."""
from __future__ import annotations

import json
import re
import subprocess

import anthropic
import ollama
import openai
import pytest

from ridge.daemon.gateway.app import build_app
from ridge.daemon.gateway.link import DaemonLink
from ridge.daemon.gateway.settings import gateway_settings
from test_daemon_harness import Daemon, Raw
from test_gateway import free_port, wait_http
from tiny_models import make_tiny

CONTEXT = 256  # tiny_config's max_position: the daemon's max_model_len
HUGE = 32000  # Claude Code's max_tokens
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clients")
    model, _, _ = make_tiny(tmp, "llama")
    http, olla = free_port(), free_port()
    d = Daemon(tmp, str(model), "--num-kv-blocks", 128, "--http", f"127.0.0.1:{http}",
               "--ollama", f"127.0.0.1:{olla}", "--served-model-name", "tiny")
    d.url, d.ollama = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{olla}"
    wait_http(d.url)
    wait_http(d.ollama)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oai(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(daemon):
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=60)


def prompt_tokens(daemon, messages: list[dict]) -> int:
    return Raw(daemon.endpoint).call({"type": "tokenize", "id": "t", "messages": messages})["count"]


# -- Claude Code: system messages among the turns, max_tokens as a ceiling ----------------------------------
TURNS = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
         {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "and now?"}]


def test_claude_code_system_messages_and_a_huge_max_tokens(claude, oai, daemon):
    """A system message in the middle of `messages` is rendered where it stands, one at their head
    joins the system prompt; max_tokens 32000 on a 256-token context runs to the context's end."""
    messages = [{"role": "system", "content": [{"type": "text", "text": "Reminder."}]}] + TURNS
    chat = [{"role": "system", "content": "Be brief.\n\nReminder."}] + TURNS
    want = oai.chat.completions.create(model="tiny", messages=chat, max_tokens=HUGE, temperature=0)
    n = prompt_tokens(daemon, chat)
    assert want.usage.prompt_tokens == n and want.usage.completion_tokens <= CONTEXT - n
    assert want.choices[0].finish_reason in ("stop", "length")
    kw = dict(model="tiny", system="Be brief.", max_tokens=HUGE, messages=messages, extra_body=GREEDY)
    m = claude.messages.create(**kw)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n
    assert "".join(b.text for b in m.content) == want.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason]
    assert m.usage.output_tokens == want.usage.completion_tokens
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.usage.output_tokens) == (m.stop_reason, m.usage.output_tokens)
    assert claude.messages.count_tokens(model="tiny", system="Be brief.", messages=messages).input_tokens == n


def test_claude_code_system_message_refusals(claude):
    with pytest.raises(anthropic.BadRequestError, match="only text blocks"):
        claude.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": "x"},
            {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "y"}]},
            {"role": "user", "content": "z"}])
    with pytest.raises(anthropic.BadRequestError, match="only system messages"):
        claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "system", "content": "x"}])


def test_max_tokens_is_a_ceiling_on_every_api(oai, daemon):
    """Past the context, every API's max_tokens is what the context leaves, and the answer says it
    ran out (ignore_eos: it does)."""
    chat = [{"role": "user", "content": "hello"}]
    room = CONTEXT - prompt_tokens(daemon, chat)
    for key in ("max_tokens", "max_completion_tokens"):
        c = oai.chat.completions.create(model="tiny", messages=chat, temperature=0, extra_body={"ignore_eos": True},
                                        **{key: HUGE})
        assert (c.choices[0].finish_reason, c.usage.completion_tokens) == ("length", room), key
    c = oai.completions.create(model="tiny", prompt="hello", max_tokens=HUGE, temperature=0,
                               extra_body={"ignore_eos": True})
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == CONTEXT - c.usage.prompt_tokens
    r = oai.responses.create(model="tiny", input="hello", max_output_tokens=HUGE, temperature=0)
    assert r.usage.output_tokens <= CONTEXT - r.usage.input_tokens
    out = ollama.Client(host=daemon.ollama, timeout=60).chat(model="tiny", messages=chat,
                                                              options={"num_predict": HUGE, "temperature": 0})
    assert out.done and out.done_reason in ("stop", "length")
    assert out.eval_count <= CONTEXT - out.prompt_eval_count


# -- untyped and form POSTs: read as JSON from programs, refused from web pages -----------------------------
def curl(url: str, *args: str) -> tuple[int, dict]:
    """curl as a user runs it -> (status, the JSON body)."""
    done = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args, url], capture_output=True, text=True,
                          timeout=60, check=True)
    body, _, status = done.stdout.rpartition("\n")
    return int(status), json.loads(body)


GENERATE = json.dumps({"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 3}})
CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
NO_TYPE = ("-H", "Content-Type:")  # curl then sends none, as litellm does


def test_curl_d_and_untyped_posts_are_json(daemon):
    for untyped in ((), NO_TYPE):  # `curl -d` sends application/x-www-form-urlencoded
        status, reply = curl(daemon.ollama + "/api/generate", "-d", GENERATE, *untyped)
        assert status == 200 and reply["done"] and reply["eval_count"] <= 3, (untyped, reply)
        for base in (daemon.url, daemon.ollama):
            status, reply = curl(base + "/v1/chat/completions", "-d", CHAT, *untyped)
            assert status == 200 and reply["usage"]["completion_tokens"] <= 3, (base, untyped, reply)


def test_web_pages_are_still_refused(daemon):
    """A browser names the page in an Origin on every POST: a foreign one is refused whatever the body
    says it is; even the gateway's own origin must declare JSON; a body declared as something else
    than JSON or a form is refused from anyone."""
    for base in (daemon.url, daemon.ollama):
        for path, body in (("/api/generate", GENERATE), ("/v1/chat/completions", CHAT)):
            if path.startswith("/api") and base == daemon.url:
                continue
            for kind in ((), NO_TYPE, ("-H", "Content-Type: text/plain"), ("-H", "Content-Type: application/json")):
                status, _ = curl(base + path, "-d", body, "-H", "Origin: http://attacker.example", *kind)
                assert status == 403, (base, path, kind)
            own = "Origin: " + base.replace("127.0.0.1", "localhost")
            host = "Host: " + base.removeprefix("http://").replace("127.0.0.1", "localhost")
            for kind in ((), NO_TYPE):
                status, reply = curl(base + path, "-d", body, "-H", own, "-H", host, *kind)
                assert status == 415, (base, path, kind, reply)
            for kind in ("text/plain", "multipart/form-data; boundary=x"):
                status, _ = curl(base + path, "-d", body, "-H", f"Content-Type: {kind}")
                assert status == 415, (base, path, kind)


# -- /openapi.json and 405s: every route the app has ---------------------------------------------------------
def app_routes(ollama_api: bool) -> dict[str, set[str]]:
    """The app's own routes (built here, as the daemon builds it) -> the methods each path takes."""
    app = build_app(gateway_settings({}, "127.0.0.1:1"), DaemonLink("ipc:///nonexistent"), ollama_api=ollama_api)
    out: dict[str, set[str]] = {}
    for r in app.routes:
        out.setdefault(re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", r.path), set()).update(r.methods)
    return out


def get(url: str) -> dict:
    status, reply = curl(url)
    assert status == 200
    return reply


@pytest.mark.parametrize("ollama_api", [False, True], ids=["http", "ollama"])
def test_openapi_lists_every_route_and_every_405_says_allow(daemon, ollama_api):
    base = daemon.ollama if ollama_api else daemon.url
    routes = app_routes(ollama_api)
    assert {"/v1/rerank", "/rerank", "/v2/rerank"} <= set(routes)
    doc = get(base + "/openapi.json")
    assert set(doc["paths"]) == set(routes)
    for path, methods in routes.items():
        assert {m.upper() for m in doc["paths"][path]} == methods - {"HEAD"}, path
        concrete = path.replace("{model}", "tiny").replace("{response_id}", "resp_x")
        for method in {"GET", "POST", "PUT", "PATCH", "DELETE"} - methods:
            done = subprocess.run(["curl", "-s", "-o", "/dev/null", "-D", "-", "-X", method, base + concrete],
                                  capture_output=True, text=True, timeout=30, check=True)
            head = done.stdout.lower()
            assert head.split(None, 2)[1] == "405", (method, path, head)
            allow = re.search(r"^allow: (.*?)\r?$", head, re.M)
            assert allow and {m.strip().upper() for m in allow.group(1).split(",")} == methods, (method, path, head)


# -- a tool call cut by max_tokens ---------------------------------------------------------------------------
def test_a_call_cut_by_max_tokens_is_dropped_and_no_markup_is_content():
    """Hermes' (Qwen's) calls, the second cut by max_tokens at every character of it: the content is
    the text before the calls, the first call stands whole, the cut one is gone (one whose object is
    whole stands: only its close tag was cut); a stop string at the same place keeps the protocol's
    rule (a named call stays, an unnamed one is text)."""
    from ridge.daemon.frontend.chat_format import HERMES, LLAMA3_JSON, MARKER_TEXT, MISTRAL
    from ridge.daemon.frontend.chat_output import OutputSpec

    def parse(fmt, roles, text: str, cut: bool, start: str = "content"):
        p = OutputSpec(start, fmt, 128, {r: MARKER_TEXT[r] for r in roles}).parser()
        content = "".join(p.feed(c).content for c in text[:-1]) if text else ""  # a character a token, the worst
        content += p.feed(text[-1:], final=True, cut=cut).content
        return content, [(c["name"], c["arguments"]) for c in p.tool_calls()]

    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    second = '\n<tool_call>\n{"name": "now", "arguments": {"zone": "UTC"}}\n</tool_call>'
    whole = [("get_weather", '{"city": "Paris"}')]
    hermes = (HERMES, ("call_open", "call_close"))
    closed = second.index("}}") + 2  # from here on the second call's object is whole: only its close tag is cut
    for k in range(len(second) + 1):
        text = "Let me look.\n" + first + second[:k]
        want = whole + ([("now", '{"zone": "UTC"}')] if k >= closed else [])
        assert parse(*hermes, text, cut=True) == ("Let me look.", want), second[:k]
    # ended by a stop string instead: an unnamed call is text as written, a named one stays
    unnamed, named = "Let me look.\n" + first + '\n<tool_call>\n{"na', "Let me look.\n" + first + second[:40]
    assert parse(*hermes, unnamed, cut=False) == ('Let me look.<tool_call>\n{"na', whole)
    assert len(parse(*hermes, named, cut=False)[1]) == 2
    for k in range(1, first.index("}}") + 2):  # the first call cut: no call, and none of its markup as text
        content, calls = parse(*hermes, "Hi " + first[:k], cut=True)
        assert (content.rstrip(), calls) == ("Hi", []), first[:k]
    mistral = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "now", "arguments": {"zone"')
    assert parse(MISTRAL, ("tool_calls",), mistral, cut=True) == ("", whole)
    llama = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "no'
    assert parse(LLAMA3_JSON, ("python_tag",), llama, cut=True) == ("", whole)
    from ridge.daemon.frontend import harmony
    call = ('<|channel|>commentary to=functions.now <|constrain|>json<|message|>{"zone": "UTC"}<|call|>')
    for k in range(len(call) + 1):  # gpt-oss' one call, cut at every character
        p = harmony.HarmonySpec(True).parser()
        got = p.feed("".join(call[:k]), final=True, cut=True)
        want = [("now", '{"zone": "UTC"}')] if k >= call.index("<|call|>") else []
        assert (got.content, [(c["name"], c["arguments"]) for c in p.tool_calls()]) == ("", want), call[:k]
    think = parse(HERMES, ("call_open", "call_close", "think_open", "think_close"), "<think>hmm</thi", cut=True,
                  start="think")
    assert think == ("", [])
