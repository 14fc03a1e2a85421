"""The OpenAI-compatible gateway, end to end: a real `ridge serve --http` on a
tiny GGUF model, spoken to with the official `openai` package and with plain
HTTP (http.client) where a test must control the connection itself. A second,
standalone `ridge gateway` process checks the API key and CORS. No mocks.

One daemon serves the module; the last test drains it (503s while draining).
The internal-error tests run a second daemon whose process has two library
functions (llguidance's grammar reader, torch's Generator.manual_seed) fail on
marked input, as a library bug or a failing GPU would."""
from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from ridge.daemon.cli.commands import gateway_endpoint
from ridge.daemon.transport.endpoint import EndpointError, system_endpoint, user_endpoint
from ridge.daemon.gateway.door import FORM, HostRule, body_admitted, is_json, origin_allowed
from ridge.daemon.gateway.run import GatewayThread, listen
from ridge.daemon.gateway.settings import gateway_settings
from test_daemon_harness import ROOT, Daemon, Raw, stats, wait_idle
from tiny_models import make_tiny

MAX_QUEUE, MAX_SEQS = 4, 16
LONG = {"max_tokens": 240, "ignore_eos": True, "n": 32}  # two waves of 16 samples: long enough to catch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    model, _, _ = make_tiny(tmp, "llama")
    port = free_port()
    d = Daemon(tmp, str(model), "--num-kv-blocks", 1024, "--max-num-seqs", MAX_SEQS, "--max-queue", MAX_QUEUE,
               "--http", f"127.0.0.1:{port}", "--served-model-name", "tiny")
    d.url, d.model = f"http://127.0.0.1:{port}", str(model)
    wait_http(d.url)
    yield d
    d.stop()


def http_daemon(tmp, model: str, *flags) -> Daemon:
    """A daemon with its gateway on a free loopback port (d.url), answering."""
    port = free_port()
    d = Daemon(tmp, model, *flags, "--http", f"127.0.0.1:{port}")
    d.url = f"http://127.0.0.1:{port}"
    wait_http(d.url)
    return d


def wait_http(url: str, timeout: float = 30.0) -> None:
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), 0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def oai(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(text: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


def post(url: str, path: str, body: dict, headers: dict | None = None) -> http.client.HTTPResponse:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    resp.conn = conn  # to hang up: resp.close(), then resp.conn.close()
    return resp


def ask(url: str, method: str, path: str, headers: dict | None = None, body=None) -> tuple[int, dict]:
    """One request with exactly these headers (a "Host" among them replaces http.client's own)
    -> (status, the JSON body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, data, headers or {})
    resp = conn.getresponse()
    reply = json.loads(resp.read() or b"null")
    conn.close()
    return resp.status, reply


# -- who may connect (no daemon needed) ----------------------------------------------------------------
def test_settings_loopback_unless_a_key(tmp_path):
    s = gateway_settings({})
    assert (s.host, s.port, s.api_key, s.url) == ("127.0.0.1", 8000, None, "http://127.0.0.1:8000")
    assert gateway_settings({}, default_http=None) is None  # ridge serve without --http: no gateway
    assert gateway_settings({"http": "[::1]:8001"}).url == "http://[::1]:8001"
    assert gateway_settings({"http": "localhost:9", "cors_allow_origins": "http://a, http://b"}).cors_allow_origins \
        == ("http://a", "http://b")
    for addr in ("0.0.0.0:8000", "[::]:8000", "192.168.1.5:8000", "example.com:80"):
        with pytest.raises(EndpointError, match="API key"):
            gateway_settings({"http": addr})
    key = tmp_path / "key"
    key.write_text("s3cret\n# a comment\n\nother\n")  # one key a line: each holder its own principal
    keyed = gateway_settings({"http": "0.0.0.0:8000", "api_key_file": str(key)})
    assert keyed.api_key == "s3cret" and keyed.api_keys == ("s3cret", "other")
    assert gateway_settings({"http": "0.0.0.0:8000", "api_key": "k"}).api_key == "k"
    key.write_text("\n")
    for bad in ({"http": "no-port"}, {"http": "h:99999"}, {"api_key_file": str(key)},
                {"api_key_file": str(tmp_path / "missing")}):
        with pytest.raises(EndpointError):
            gateway_settings(bad)


def test_settings_lists_and_the_system_daemons_key(tmp_path):
    """allowed_hosts and cors_allow_origins take a TOML list or comma-separated words; an origin with
    a path never matches a browser's Origin, so it is refused at start-up. In front of the system
    daemon, even loopback needs a key: every local user can reach a loopback port."""
    s = gateway_settings({"allowed_hosts": "a.lan, *.b.lan", "cors_allow_origins": ["http://ui.lan:3000", "null"]})
    assert (s.allowed_hosts, s.cors_allow_origins) == (("a.lan", "*.b.lan"), ("http://ui.lan:3000", "null"))
    for bad in ("http://ui.lan/", "ui.lan", "http://ui.lan/app"):
        with pytest.raises(EndpointError, match="not an origin"):
            gateway_settings({"cors_allow_origins": bad})
    with pytest.raises(ValueError, match="allowed_hosts must be a list of strings"):
        gateway_settings({"allowed_hosts": [1, 2]})
    for addr in ("127.0.0.1:8000", "[::1]:8000", "localhost:8000"):
        with pytest.raises(EndpointError, match="system daemon without an API key.*api_key_file"):
            gateway_settings({"http": addr}, system=True)
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    assert gateway_settings({"http": "127.0.0.1:8000", "api_key_file": str(key)}, system=True).api_key == "s3cret"
    assert gateway_settings({"http": "127.0.0.1:8000", "api_key": "k"}, system=True).api_key == "k"


def test_host_rule_answers_names_that_cannot_be_rebound():
    loop = HostRule.of("127.0.0.1")
    for ok in ("127.0.0.1:8000", "localhost:8000", "LocalHost.", "localhost", "[::1]:8000", "127.0.0.2"):
        assert loop.allows(ok), ok
    for bad in ("attacker.example", "attacker.example:8000", "localhost.attacker.example", "127.0.0.1.nip.io",
                "", ":8000", "192.168.1.5:8000", "ridge.lan", "[::1"):
        assert not loop.allows(bad), bad
    everywhere = HostRule.of("0.0.0.0", ("ridge.lan", "*.corp.example"))
    for ok in ("192.168.1.5:8000", "[fe80::1]:8000", "ridge.lan:8000", "RIDGE.LAN", "gpu.corp.example"):
        assert everywhere.allows(ok), ok
    for bad in ("corp.example", "evilcorp.example", "ridge.lan.attacker.example", "attacker.example"):
        assert not everywhere.allows(bad), bad
    assert HostRule.of("::1").allows("[::1]:80") and not HostRule.of("::1").allows("ridge.lan")
    assert HostRule.of("192.168.1.5").allows("192.168.1.5:8000") and not HostRule.of("192.168.1.5").allows("10.0.0.1")
    assert HostRule.of("gpu.box").allows("GPU.box:8000") and HostRule.of("127.0.0.1", ("*",)).allows("any.example")


def test_origins_and_content_types():
    own = "127.0.0.1:8000"
    assert origin_allowed("http://127.0.0.1:8000", own, ())
    assert origin_allowed("http://localhost:8000", "localhost:8000", ())
    for other in ("http://127.0.0.1:3000", "https://127.0.0.1:8000", "http://attacker.example", "null"):
        assert not origin_allowed(other, own, ()), other
    assert origin_allowed("http://ui.lan:3000", own, ("http://ui.lan:3000",))
    assert origin_allowed("http://anything.example", own, ("*",)) and origin_allowed("null", own, ("null",))
    assert is_json("application/json") and is_json("Application/JSON; charset=utf-8")
    assert not any(map(is_json, (None, "", "text/plain", "application/jsonx", "multipart/form-data", "json")))
    for kind in (None, "", FORM, FORM + "; charset=utf-8", "application/json"):  # a program's: read as JSON
        assert body_admitted(kind, has_origin=False), kind
    for kind in (None, FORM, "text/plain"):  # a page's (its Origin allowed): JSON only
        assert not body_admitted(kind, has_origin=True), kind
    assert body_admitted("application/json", has_origin=True)
    assert not any(body_admitted(k, has_origin=False) for k in ("text/plain", "multipart/form-data", "text/xml"))


# -- the API ---------------------------------------------------------------------------------------
def test_models_and_health(oai, daemon):
    assert [m.id for m in oai.models.list()] == ["tiny"]  # --served-model-name
    assert oai.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")
    r = http.client.HTTPConnection(*daemon.url.removeprefix("http://").split(":"))
    r.request("GET", "/health")
    resp = r.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"


def test_chat_whole_and_streamed_agree(oai, daemon):
    kw = dict(model="tiny", messages=chat("hello"), max_completion_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    whole = oai.chat.completions.create(**kw)
    (ch,) = whole.choices
    assert ch.finish_reason == "length" and ch.message.role == "assistant" and ch.message.content
    prompt_tokens = Raw(daemon.endpoint).call({"type": "tokenize", "id": "t", "messages": chat("hello")})["count"]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 12)
    assert whole.usage.total_tokens == prompt_tokens + 12 and whole.model == "tiny"
    parts, usage, finish = [], None, None
    for chunk in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == ch.message.content and finish == "length"
    assert usage.completion_tokens == 12 and usage.prompt_tokens == prompt_tokens


def test_completions_prompts_of_every_shape(oai, daemon):
    kw = dict(model="tiny", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    text = oai.completions.create(prompt="once upon", **kw)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 5
    ids = Raw(daemon.endpoint).call({"type": "tokenize", "id": "t", "text": "once upon"})["token_ids"]
    assert oai.completions.create(prompt=ids, **kw).choices[0].text == text.choices[0].text
    two = oai.completions.create(prompt=["once upon", "a time"], **kw)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == text.choices[0].text
    assert two.usage.completion_tokens == 10
    streamed = {}
    for chunk in oai.completions.create(prompt=["once upon", "a time"], stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: two.choices[0].text, 1: two.choices[1].text}


def _first_new_pair(text: str) -> int | None:
    """A place past the start where two printable characters occur for the first time."""
    return next((k for k in range(3, len(text) - 2)
                 if "\ufffd" not in text[k:k + 2] and text.find(text[k:k + 2]) == k), None)


def test_stop_strings(oai):
    # The random model's greedy text depends on its weights' rounding: take the first prompt whose
    # text has a place to cut.
    for prompt in ("stop here", "once upon", "a time", "hello there", "the end of it"):
        kw = dict(model="tiny", prompt=prompt, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
        full = oai.completions.create(**kw).choices[0].text
        if (cut := _first_new_pair(full)) is not None:
            break
    assert cut is not None, full
    got = oai.completions.create(**kw, stop=[full[cut:cut + 2]]).choices[0]
    assert (got.text, got.finish_reason) == (full[:cut], "stop")


def test_n_samples_seeded(oai):
    kw = dict(model="tiny", messages=chat("pick"), max_tokens=8, temperature=1.0, seed=7, n=2,
              top_p=0.95, extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.01})
    a, b = oai.chat.completions.create(**kw), oai.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1] and a.usage.completion_tokens == 16
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # the seed holds
    assert a.choices[0].message.content != a.choices[1].message.content  # samples differ (seed + index)


def test_logprobs(oai):
    c = oai.chat.completions.create(model="tiny", messages=chat("x"), max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=3, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    assert all(t.logprob <= 0 and isinstance(t.token, str) for t in content)
    comp = oai.completions.create(model="tiny", prompt="y", max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)  # two tokens may share a text


def test_response_format_constrains_the_output(oai):
    """OpenAI's json_schema (chat) and ridge's regex (completions, as vLLM takes it) reach the
    daemon's structured output: every sample conforms, greedy or not."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    chat_resp = oai.chat.completions.create(model="tiny", messages=chat("ok?"), max_tokens=64, n=2,
                                            temperature=1.0, seed=5, response_format=fmt)
    for c in chat_resp.choices:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content)["ok"], bool)
    comp = oai.completions.create(model="tiny", prompt="pick", max_tokens=16, temperature=0,
                                  extra_body={"response_format": {"type": "regex", "regex": "(yes|no)[0-9]{3}"}})
    assert re.fullmatch("(yes|no)[0-9]{3}", comp.choices[0].text), comp.choices[0].text


# -- errors ------------------------------------------------------------------------------------------
def test_invalid_requests_are_400_in_openai_shape(oai, daemon):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x", max_tokens=0)  # 10**6 is a ceiling (test_clients.py)
    assert e.value.code == "invalid_field" and e.value.param == "max_tokens"
    for bad in ({"tools": [{"type": "function", "function": {"name": "f"}}]}, {"frequency_penalty": 3.0},
                {"messages": []}, {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
                {"response_format": {"type": "regex", "regex": "(ab"}}):
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(**{"model": "tiny", "messages": chat("x"), **bad})
    resp = post(daemon.url, "/v1/completions", {"prompt": "x" * (3 << 20)})
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    resp = post(daemon.url, "/v1/completions", {})  # no prompt at all
    assert resp.status == 400 and set(json.loads(resp.read())["error"]) == {"message", "type", "param", "code"}
    host, port = daemon.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port))
    conn.request("POST", "/v1/completions", b"{not json", {"Content-Type": "application/json"})
    assert conn.getresponse().status == 400
    for depth in (150, 100_000):  # past msgpack's limit, and past Python's recursion limit
        nested = b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
        status, reply = ask(daemon.url, "POST", "/v1/completions", {"Content-Type": "application/json"}, nested)
        assert status == 400 and "nests deeper" in reply["error"]["message"], reply
    assert oai.completions.create(model="tiny", prompt="x", max_tokens=2).choices  # still serving


def test_busy_daemon_is_429_with_retry_after(oai, daemon):
    holder = Raw(daemon.endpoint)
    for i in range(MAX_QUEUE):  # the daemon's whole queue: 8 waves of 16 samples, far from done
        holder.generate(f"hold{i}", prompt="hold", params=LONG)
    deadline = time.monotonic() + 10  # the holder's frames reach the daemon before the gateway's
    while stats(daemon.endpoint)["daemon"]["in_flight"] < MAX_QUEUE:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        with pytest.raises(openai.RateLimitError) as e:
            oai.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.code == "busy" and int(e.value.response.headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):  # streamed requests are refused before their 200
            list(oai.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True))
    finally:
        for rid in holder.open:
            holder.send({"type": "abort", "id": rid})
        holder.close()
    wait_idle(daemon.endpoint)


def test_a_keyless_standalone_gateway_never_falls_back_to_the_system_socket(daemon, monkeypatch, tmp_path):
    """`ridge gateway` without a key serves the daemon it finds at start, or the user socket: it is
    never left to find the system socket later (in front of that one it needs a key)."""
    monkeypatch.delenv("RIDGE_ENDPOINT", raising=False)
    base = {"endpoint": None, "system": False}
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # no daemon here
    assert gateway_endpoint(base, keyed=False) == user_endpoint() and gateway_endpoint(base, keyed=True) is None
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(daemon.tmp / "xdg-run"))
    assert gateway_endpoint(base, keyed=False) == daemon.endpoint
    assert gateway_endpoint({**base, "system": True}, keyed=False) == system_endpoint()
    assert gateway_endpoint({**base, "endpoint": "tcp://127.0.0.1:5"}, keyed=False) == "tcp://127.0.0.1:5"


# -- the door: Host, Origin, Content-Type ----------------------------------------------------------------
def gateway_count(url: str, route: str, status: int) -> float:
    return scrape(url).get(("ridge:gateway_requests_total", (("route", route), ("status", str(status)))), 0)


def test_the_door_refuses_other_hosts_origins_and_plain_text(daemon):
    """What a web page can send to a loopback port is refused before it reaches the daemon: another
    Host (DNS rebinding: 421), another page's Origin (403), a body declared neither JSON nor a form
    (415: a program's untyped and form bodies are read as JSON, test_clients.py). Each refusal is
    counted, in OpenAI's shape."""
    port = daemon.url.rsplit(":", 1)[1]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    json_type = {"Content-Type": "application/json"}
    counts = {code: gateway_count(daemon.url, "/v1/completions", code) for code in (421, 403, 415)}
    for host in ("attacker.example", f"attacker.example:{port}", f"localhost.attacker.example:{port}"):
        status, reply = ask(daemon.url, "POST", "/v1/completions", {"Host": host, **json_type}, body)
        assert status == 421 and reply["error"]["code"] == "misdirected_request", (host, reply)
    for origin in ("http://attacker.example", f"http://localhost:{int(port) + 1}", "null"):
        status, reply = ask(daemon.url, "POST", "/v1/completions", {"Origin": origin, **json_type}, body)
        assert status == 403 and reply["error"]["code"] == "origin_not_allowed", (origin, reply)
    for kind in ("text/plain", "multipart/form-data; boundary=x", "application/xml"):
        status, reply = ask(daemon.url, "POST", "/v1/completions", {"Content-Type": kind} if kind else {}, body)
        assert status == 415 and set(reply["error"]) == {"message", "type", "param", "code"}, (kind, reply)
    assert {code: gateway_count(daemon.url, "/v1/completions", code) - n for code, n in counts.items()} == \
        {421: 3, 403: 3, 415: 3}
    with socket.create_connection(("127.0.0.1", int(port))) as s:  # HTTP/1.0 may leave out the Host
        s.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 400 ")


def test_the_gateways_own_names_and_origin_work(daemon):
    """Its own origin, under each of its loopback names, and the openai package under `localhost`."""
    port = daemon.url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost"):
        status, reply = ask(daemon.url, "POST", "/v1/completions", {
            "Host": host, "Origin": f"http://{host}", "Content-Type": "application/json; charset=utf-8"},
            {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert status == 200 and reply["usage"]["completion_tokens"] <= 2, (host, reply)
    by_name = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    assert by_name.chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=2).model == "tiny"


# -- a client that goes away ----------------------------------------------------------------------------
def wait_kv_used(endpoint: str) -> None:
    """Until a stats snapshot (at most stats_interval old) shows the request holding blocks."""
    deadline = time.monotonic() + 10
    while stats(endpoint)["stats"]["kv_blocks_used"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_disconnect_aborts_and_frees_kv(daemon):
    """Streaming or not, an HTTP client that disconnects has its daemon request aborted: its KV
    blocks are free again within a moment, and the daemon counts a client abort."""
    before = stats(daemon.endpoint)["daemon"]["aborts"]["client"]
    resp = post(daemon.url, "/v1/completions", {"model": "tiny", "prompt": "bye", "stream": True, **LONG})
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # streaming
    wait_kv_used(daemon.endpoint)
    resp.close()
    resp.conn.close()
    wait_idle(daemon.endpoint, timeout=10)
    assert stats(daemon.endpoint)["daemon"]["aborts"]["client"] == before + 1
    host, port = daemon.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    body = json.dumps({"model": "tiny", "prompt": "bye", **LONG}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_kv_used(daemon.endpoint)
    s.close()  # before its whole response
    wait_idle(daemon.endpoint, timeout=10)
    assert stats(daemon.endpoint)["daemon"]["aborts"]["client"] == before + 2


# -- metrics --------------------------------------------------------------------------------------------
def scrape(url: str) -> dict:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port))
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(resp.read().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_parse_and_move(oai, daemon):
    m0 = scrape(daemon.url)
    model = (("model_name", "tiny"),)
    for name in ("ridge:num_requests_running", "ridge:num_requests_waiting", "ridge:kv_cache_usage_perc",
                 "ridge:prompt_tokens_total", "ridge:generation_tokens_total", "ridge:prefix_cache_hits_total",
                 "ridge:prefix_cache_queries_total", "ridge:spec_decode_num_accepted_tokens_total",
                 "ridge:time_to_first_token_seconds_count", "ridge:inter_token_latency_seconds_count",
                 "ridge:e2e_request_latency_seconds_count"):
        assert (name, model) in m0, name
    assert ("ridge:gateway_cpu_seconds_total", ()) in m0 and ("process_cpu_seconds_total", ()) in m0
    oai.chat.completions.create(model="tiny", messages=chat("count me"), max_tokens=7, temperature=0,
                                extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 5
    while True:  # the stats are the engine's latest snapshot: at most stats_interval + a step old
        m1 = scrape(daemon.url)

        def moved(name, labels=model):
            return m1[(name, labels)] - m0.get((name, labels), 0)
        if moved("ridge:e2e_request_latency_seconds_count") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert moved("ridge:generation_tokens_total") >= 7 and moved("ridge:prompt_tokens_total") > 0
    assert moved("ridge:request_success_total", (("finished_reason", "length"),) + model) >= 1
    assert moved("ridge:time_to_first_token_seconds_count") >= 1 and moved("ridge:inter_token_latency_seconds_count") >= 6
    assert moved("ridge:e2e_request_latency_seconds_count") >= 1
    inf = m1[("ridge:e2e_request_latency_seconds_bucket", (("le", "+Inf"),) + model)]
    assert inf == m1[("ridge:e2e_request_latency_seconds_count", model)]
    key = ("ridge:gateway_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))
    assert m1[key] - m0.get(key, 0) == 1


# -- internal errors: an error id for the client, the exception for the log ----------------------------------
FAULTS = textwrap.dedent('''
    """`ridge` with two library functions that fail on marked input, as a library bug or a failing
    GPU would: llguidance's grammar reader on a grammar that says "ridgeboom" (at admission, on one of
    the daemon's admission workers), and torch's Generator.manual_seed(4242) (in a step, on the engine thread)."""
    import sys

    import llguidance
    import torch

    from ridge.cli import main

    real_grammar_from = llguidance.grammar_from


    def grammar_from(*args, **kw):
        if any("ridgeboom" in str(a) for a in args):
            raise RuntimeError("llguidance panicked: secret-detail-1 in /opt/private/grammar.rs")
        return real_grammar_from(*args, **kw)


    class Generator(torch.Generator):
        def manual_seed(self, seed):
            if seed == 4242:
                raise RuntimeError("CUDA error: secret-detail-2 at /opt/private/sampler.cu")
            return super().manual_seed(seed)


    llguidance.grammar_from, torch.Generator = grammar_from, Generator
    sys.exit(main())
''')
ERROR_ID = re.compile(r"internal error; id ([0-9a-f]{12})")


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, daemon):
    tmp = tmp_path_factory.mktemp("faulty")
    script = tmp / "faulty_ridge.py"
    script.write_text(FAULTS)
    port = free_port()
    d = Daemon(tmp, daemon.model, "--http", f"127.0.0.1:{port}", "--served-model-name", "tiny", entry=(str(script),))
    d.url = f"http://127.0.0.1:{port}"
    wait_http(d.url)
    yield d
    d.stop()


def logged(d: Daemon, error_id: str, timeout: float = 10.0) -> str:
    """The daemon's log from the line that names `error_id` on (the traceback follows it)."""
    deadline = time.monotonic() + timeout
    while error_id not in (text := d.output()):
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    return text[text.index(error_id):]


def test_a_daemon_failure_is_an_error_id_for_the_client(faulty):
    """An exception at admission (on a worker, daemon/admission.py) is the `internal` error frame;
    one in a step is the request's final error, which the gateway answers with a 500. Neither says what the exception said; the
    daemon's log has it, with its traceback, under the same id."""
    raw = Raw(faulty.endpoint)
    fmt = {"type": "grammar", "grammar": 'start: "ridgeboom"'}
    params = {"max_tokens": 2, "response_format": fmt}
    reply = raw.call({"type": "generate", "id": "g", "prompt": "x", "params": params})
    raw.close()
    assert (reply["type"], reply["code"], reply["id"]) == ("error", "internal", "g")
    error_id = ERROR_ID.fullmatch(reply["message"]).group(1)
    after = logged(faulty, error_id)
    assert "Traceback" in after and "secret-detail-1" in after.split("Traceback", 1)[1]
    resp = post(faulty.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3, "temperature": 1.0,
                                                "seed": 4242})
    error = json.loads(resp.read())["error"]
    assert resp.status == 500 and (error["type"], error["code"]) == ("server_error", "internal")
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
    after = logged(faulty, ERROR_ID.search(error["message"]).group(1))
    assert "Traceback" in after and "secret-detail-2" in after.split("Traceback", 1)[1]
    ok = post(faulty.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3, "seed": 7})
    assert ok.status == 200  # the daemon keeps serving


def test_a_gateway_failure_is_a_500_with_an_error_id(daemon, monkeypatch, caplog):
    """The gateway's own exceptions (here prometheus_client's, rendering /metrics) are a 500 with an
    error id and a generic message; the gateway's log has the exception and its traceback."""
    def collect(self):
        raise RuntimeError("prometheus_client: secret-detail-3")
        yield

    monkeypatch.setattr(CollectorRegistry, "collect", collect)
    settings = gateway_settings({"http": f"127.0.0.1:{free_port()}"})
    gateway = GatewayThread(settings, daemon.endpoint, listen(settings))
    gateway.start()
    try:
        wait_http(settings.url)
        status, reply = ask(settings.url, "GET", "/metrics")
    finally:
        gateway.stop()
    assert status == 500 and (reply["error"]["type"], reply["error"]["code"]) == ("server_error", "internal")
    error_id = ERROR_ID.fullmatch(reply["error"]["message"]).group(1)
    (record,) = [r for r in caplog.records if error_id in r.getMessage()]
    assert record.name == "ridge.gateway" and "GET /metrics" in record.getMessage()
    assert "secret-detail-3" in str(record.exc_info[1]) and record.exc_info[2] is not None  # the traceback


# -- the standalone gateway: the API key and CORS ----------------------------------------------------------
def ridge(env, *argv, **kw):
    return subprocess.Popen([sys.executable, "-m", "ridge.cli", *argv], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def test_standalone_gateway_key_and_cors(daemon, tmp_path):
    refused = [ridge(daemon.env, "gateway", "--http", f"0.0.0.0:{free_port()}"),  # both, before any model loads
               ridge(daemon.env, "serve", "--endpoint", f"ipc://{tmp_path}/x.sock", "--http", f"0.0.0.0:{free_port()}")]
    for r in refused:
        out, _ = r.communicate(timeout=60)
        assert r.returncode == 1 and "not a loopback address" in out and "API key" in out, out
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    port = free_port()
    g = ridge(dict(daemon.env, RIDGE_API_KEY="ignored"), "gateway", "--endpoint", daemon.endpoint, "--http",
              f"127.0.0.1:{port}", "--api-key-file", str(key), "--cors-allow-origins", "http://app.example",
              "--allowed-hosts", "ridge.lan,*.corp.example")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        c = ok.chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=3)
        assert c.usage.completion_tokens <= 3 and c.model == "tiny"
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and resp.getheader("access-control-allow-origin") == "http://app.example"
        conn.request("GET", "/v1/models", headers={"Origin": "http://app.example", "Authorization": "Bearer s3cret"})
        resp = conn.getresponse()
        assert json.loads(resp.read())["data"][0]["id"] == "tiny"
        assert resp.getheader("access-control-allow-origin") == "http://app.example"
        for origin in ("http://elsewhere.example", "http://app.example.attacker.example"):
            conn.request("OPTIONS", "/v1/chat/completions", headers={"Origin": origin,
                                                                     "Access-Control-Request-Method": "POST"})
            resp = conn.getresponse()
            assert resp.status == 403 and json.loads(resp.read())["error"]["code"] == "origin_not_allowed"
        bearer = {"Authorization": "Bearer s3cret"}
        for host, want in (("ridge.lan", 200), (f"gpu.corp.example:{port}", 200), ("attacker.example", 421),
                           ("ridge.lan.attacker.example", 421)):
            assert ask(url, "GET", "/v1/models", {"Host": host, **bearer})[0] == want, host
        assert ask(url, "GET", "/v1/models", {"Host": "attacker.example"})[0] == 421  # before the key
    finally:
        g.send_signal(signal.SIGINT)
        g.communicate(timeout=30)
    # the in-daemon gateway has no CORS configured: another origin is refused, and no CORS header is sent
    conn = http.client.HTTPConnection(*daemon.url.removeprefix("http://").split(":"))
    conn.request("GET", "/health", headers={"Origin": "http://app.example"})
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 403 and resp.getheader("access-control-allow-origin") is None


# -- the figure's command ------------------------------------------------------------------------------------
def test_bench_server_openai_reports_the_ratio_and_gateway_cpu(daemon, tmp_path):
    out = tmp_path / "bench.json"
    r = ridge(daemon.env, "bench", "server", "--api", "openai", "--url", daemon.url, "--model", daemon.model,
              "--device", "cpu", "--threads", "1", "--requests", "4", "--in-flight", "2", "--lengths", "fixed:6",
              "--retries", "0", "--num-kv-blocks", "256", "--json", str(out))
    text, _ = r.communicate(timeout=300)
    assert r.returncode == 0, text
    (res,) = json.loads(out.read_text())["results"]["server"]
    assert res["server"]["useful_tokens"] == res["ridge"]["useful_tokens"] == 24 and not res["server"]["errors"]
    assert res["server_over_ridge"] == pytest.approx(1 / res["ratio"])
    assert res["server_over_ridge_median"] == pytest.approx(res["server_over_ridge"])  # one round
    cpu = res["server"]["server_cpu"]
    assert cpu["gateway_s"] > 0 and "daemon_socket_thread_s" in cpu and cpu["gateway_cores"] < 2
    assert "CPU while serving" in text, text


# -- last: draining ---------------------------------------------------------------------------------------
def test_draining_daemon_is_503(oai, daemon):
    holder = Raw(daemon.endpoint)
    holder.generate("hold", prompt="hold", params=LONG)  # keeps the daemon draining for a moment
    time.sleep(0.2)
    daemon.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while Raw(daemon.endpoint).call({"type": "health", "id": "h"})["status"] != "draining":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(openai.InternalServerError) as e:
        oai.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert e.value.status_code == 503 and e.value.code == "shutting_down"
    assert int(e.value.response.headers["retry-after"]) >= 1
    host, port = daemon.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port))
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 503 and json.loads(resp.read())["status"] == "draining"
    while holder.open:
        holder.pump()
        time.sleep(0.01)
    holder.close()
    assert daemon.proc.wait(30) == 0
