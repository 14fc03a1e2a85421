"""Who an HTTP client is (issue 38, findings 5, 6 and 11): its prefix hits, and the
/v1/responses store it writes into. Real daemons with their gateway, a tiny model,
real ipc and HTTP clients.

- A prompt the gateway's own user sent on the socket is never a prefix hit for an
  HTTP request (they were one identity: `cached_tokens` told HTTP users what the
  owner had sent).
- A gateway that requires its one API key cannot tell its holders apart: there a
  request shares prefixes only with the same key and the same cache_salt.
- A stored response is its creator's only (the credential it sent): GET, continue
  and DELETE by anyone else are 404; its metadata is bounded as OpenAI's is; its
  unknown sub-keys are not echoed; the store is bounded in bytes, oldest out."""
from __future__ import annotations

import time

import openai
import pytest

from ridge.daemon.gateway.responses_api import ResponseStore
from test_daemon_harness import Daemon, pump_all
from test_gateway import ask, free_port, wait_http
from test_prefix_sharing import CACHED, ask as ask_socket, fresh_prompt
from tiny_models import make_tiny

KEY = "the-one-system-key"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path, _, _ = make_tiny(tmp_path_factory.mktemp("identity-model"), "llama", max_position=1024)
    return str(path)


def gateway(tmp_path_factory, model: str, **env) -> Daemon:
    port = free_port()
    d = Daemon(tmp_path_factory.mktemp("identity"), model, "--num-kv-blocks", 256, "--http", f"127.0.0.1:{port}",
               "--served-model-name", "tiny", env_extra=env)
    d.url = f"http://127.0.0.1:{port}"
    wait_http(d.url)
    return d


@pytest.fixture(scope="module")
def open_gw(tmp_path_factory, model):
    d = gateway(tmp_path_factory, model)
    yield d
    assert d.stop() == 0, d.output()


@pytest.fixture(scope="module")
def keyed_gw(tmp_path_factory, model):
    d = gateway(tmp_path_factory, model, RIDGE_API_KEY=KEY)
    yield d
    assert d.stop() == 0, d.output()


def cached_over_http(d, prompt: list[int], key: str | None, **extra) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    status, r = ask(d.url, "POST", "/v1/completions", headers,
                    {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True, **extra})
    assert status == 200, r
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_socket_owners_prefix_is_not_a_hit_over_http(open_gw):
    vocab = 256 + 3 + 10
    p = fresh_prompt(vocab)
    assert ask_socket(open_gw.endpoint, p) == 0
    assert ask_socket(open_gw.endpoint, p) == CACHED  # the owner shares with itself
    assert cached_over_http(open_gw, p, None) == 0  # before: CACHED, the owner's prompt told to anyone
    assert cached_over_http(open_gw, p, None) == CACHED  # HTTP's own
    q = fresh_prompt(vocab)
    assert cached_over_http(open_gw, q, None) == 0
    assert ask_socket(open_gw.endpoint, q) == 0  # nor the other way


def test_holders_of_the_one_api_key_share_only_with_their_own_cache_salt(keyed_gw):
    p = fresh_prompt(256 + 3 + 10)
    assert cached_over_http(keyed_gw, p, KEY) == 0
    assert cached_over_http(keyed_gw, p, KEY) == 0  # before: CACHED, every holder of the key one identity
    assert cached_over_http(keyed_gw, p, KEY, cache_salt="mine") == 0
    assert cached_over_http(keyed_gw, p, KEY, cache_salt="mine") == CACHED
    assert cached_over_http(keyed_gw, p, KEY, cache_salt="theirs") == 0
    assert ask_socket(keyed_gw.endpoint, p) == 0


# -- the Responses store ------------------------------------------------------------------------------
def client(d, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_a_stored_response_is_its_creators_only(open_gw):
    alice, bob = client(open_gw, "alice"), client(open_gw, "bob")
    first = alice.responses.create(model="tiny", input="hello", max_output_tokens=2)
    assert alice.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model="tiny", previous_response_id=first.id, input="and?", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(first.id)
    status, _ = ask(open_gw.url, "GET", f"/v1/responses/{first.id}")  # no credential: another owner
    assert status == 404
    follow = alice.responses.create(model="tiny", previous_response_id=first.id, input="and?", max_output_tokens=2)
    assert follow.previous_response_id == first.id
    alice.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(first.id)


@pytest.mark.parametrize("metadata,words", [
    ({f"k{i}": "v" for i in range(17)}, "at most 16 keys"),
    ({"k" * 65: "v"}, "64 characters"),
    ({"k": "v" * 513}, "512"),
], ids=["keys", "key-length", "value-length"])
def test_metadata_past_openais_bounds_is_a_400(open_gw, metadata, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client(open_gw, "alice").responses.create(model="tiny", input="x", max_output_tokens=2, metadata=metadata)


def test_metadata_within_bounds_is_kept(open_gw):
    meta = {f"k{i}": "v" * 512 for i in range(16)}
    r = client(open_gw, "alice").responses.create(model="tiny", input="x", max_output_tokens=2, metadata=meta)
    assert r.metadata == meta


def test_unknown_sub_keys_are_not_echoed(open_gw):
    headers = {"Content-Type": "application/json", "Authorization": "Bearer alice"}
    junk = "x" * 1000
    status, r = ask(open_gw.url, "POST", "/v1/responses", headers, {
        "model": "tiny", "input": "x", "max_output_tokens": 2, "text": {"format": {"type": "text", "junk": junk},
                                                                        "junk": junk},
        "reasoning": {"effort": "low", "junk": junk},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "junk": junk}]})
    assert status == 200, r
    assert junk not in str(r)
    assert r["text"] == {"format": {"type": "text"}} and r["reasoning"]["effort"] == "low"
    assert r["tools"][0]["name"] == "f"
    status, got = ask(open_gw.url, "GET", f"/v1/responses/{r['id']}", {"Authorization": "Bearer alice"})
    assert status == 200 and junk not in str(got)


def test_the_store_is_bounded_in_bytes_oldest_out():
    store = ResponseStore(3600.0, max_bytes=10_000)
    for i in range(10):
        store.put(f"r{i}", [{"role": "user", "content": "x" * 2000}], {"id": f"r{i}"}, owner="o")
    assert store.bytes <= 10_000 and list(store.items) == ["r6", "r7", "r8", "r9"]
    store.put("huge", [{"role": "user", "content": "x" * 20_000}], {}, owner="o")  # bigger than the store
    assert "huge" not in store.items and "r9" in store.items
    store.delete("r9", "o")
    assert store.bytes == sum(s.size for s in store.items.values())


# -- model control (finding 8) --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """A default model and three others; up to 3 loaded; a principal may start 3 loads a minute.
    The victim is this uid on ipc, the other principal anonymous loopback TCP."""
    from test_many_models import FLAGS

    d_models = tmp_path_factory.mktemp("hostile-models")
    for i, name in enumerate(("alpha", "a", "b", "c")):
        make_tiny(d_models, seed=i + 1)[0].rename(d_models / f"{name}.gguf")
    flags = [f for f in FLAGS]
    flags[flags.index("--max-loaded-models") + 1] = 3
    d = Daemon(tmp_path_factory.mktemp("hostile-many"), str(d_models / "alpha.gguf"), "--models-dir", d_models,
               *flags, "--max-loads-per-minute", 3, "--tcp", f"tcp://127.0.0.1:{free_port()}")
    d.tcp = next(a for a in d.proc.args if str(a).startswith("tcp://"))
    yield d
    assert d.stop() == 0, d.output()


def test_one_principal_cannot_unload_or_evict_anothers_models(many):
    from ridge.daemon.client import Client, RidgeError
    from test_many_models import listing

    def state(c, name):
        return listing(c)[name]["state"]

    victim, other = Client(many.endpoint, timeout=60), Client(many.tcp, timeout=60)
    try:
        def gen(c, model, **kw):
            return c.generate("hello", model=model, max_tokens=2, temperature=0.0, ignore_eos=True, **kw)

        gen(other, "alpha", keep_alive=0)  # the default model: before, unloaded for everyone
        gen(victim, "a")
        gen(other, "a", keep_alive=0)  # the victim's load: before, unloaded as soon as this was done
        time.sleep(1.0)
        assert state(victim, "alpha") == "ready" and state(victim, "a") == "ready"
        gen(other, "b", keep_alive=0)  # its own load: its keep_alive holds
        deadline = time.monotonic() + 20
        while state(victim, "b") != "available":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        gen(other, "b")
        gen(other, "c")  # 3 loaded already: its own b goes, not the victim's a nor the default
        assert state(victim, "a") == "ready" and state(victim, "alpha") == "ready"
        assert state(victim, "b") in ("available", "unloading")
        with pytest.raises(RidgeError) as e:  # its fourth load within a minute
            gen(other, "b")
        assert e.value.code == "too_many_requests"
        gen(victim, "b")  # another principal's loads are its own to count
    finally:
        victim.close()
        other.close()


# -- the gateway's principals, as the daemon knows them ---------------------------------------------------
def _raw_hello(endpoint: str, principal: str):
    from test_daemon_harness import Raw

    c = Raw(endpoint)
    return c, c.call({"type": "hello", "id": "h", "principal": principal})


def test_only_the_daemons_own_user_may_split_its_identity(many):
    """The gateway speaks for many people over connections of the daemon's own uid: it names the
    principal of each (hello's `principal`), and each is then apart for prefixes, admission and
    model control. Any other peer naming one is refused: an identity is what the transport proves."""
    tcp, reply = _raw_hello(many.tcp, "http:key0")
    tcp.close()
    assert reply["type"] == "error" and reply["code"] == "invalid_request" and "principal" in reply["message"]
    prompt = fresh_prompt(256)
    assert ask_socket(many.endpoint, prompt) == 0  # the owner, on its own
    assert ask_socket(many.endpoint, prompt) == CACHED

    def as_principal(name: str) -> int:
        c, hello = _raw_hello(many.endpoint, name)
        assert hello["type"] == "hello", hello
        again = c.call({"type": "hello", "id": "h2", "principal": name})  # the gateway's refresh
        assert again["type"] == "hello", again
        other = c.call({"type": "hello", "id": "h3", "principal": name + "x"})
        assert other["type"] == "error" and other["code"] == "invalid_request"
        c.generate("a", stream=False, prompt_token_ids=prompt, params={"max_tokens": 2, "ignore_eos": True})
        pump_all([c], lambda: not c.open)
        c.close()
        return c.streams["a"]["final"]["usage"]["cached_tokens"]

    assert as_principal("http:key0") == 0  # not the owner's prefix
    assert as_principal("http:key0") == CACHED  # its own
    assert as_principal("http:key1") == 0
