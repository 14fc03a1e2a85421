"""Who shares prefix blocks (daemon/sharing.py, docs/protocol.md §3.2.2): real daemons on a
tiny model, real ipc, TCP and HTTP connections, and a real engine.

Two local users need two uids, which a test run as one user does not have. So: the identity
of a real ipc connection is checked to be this process's uid; the salt rule is driven with two
uids into a real engine, whose prefix-hit counters tell; and in a real daemon, two real
identities meet: ipc peers (this uid) and a TCP peer (anonymous loopback)."""
from __future__ import annotations

import os
import random
import socket

import openai
import pytest
import zmq

from engine_utils import greedy, load_tiny, make_engine
from ridge.daemon.transport.sharing import engine_salt, peer_identity, uid_identity, uid_of
from test_daemon_harness import Daemon, Raw, pump_all
from tiny_models import make_tiny

CACHED = 32  # a 40-token prompt: its first two 16-token blocks are a hit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_prompt(vocab: int) -> list[int]:
    """40 tokens no other test sends: each test starts from a cold prefix."""
    return [random.randrange(3, vocab) for _ in range(40)]


# -- identities and the salt rule ---------------------------------------------------------------------
def test_an_ipc_peer_is_known_by_its_uid_and_a_plain_tcp_one_is_anonymous(tmp_path):
    ctx = zmq.Context.instance()
    for endpoint, ipc, want in ((f"ipc://{tmp_path}/r.sock", True, uid_identity(os.getuid())),
                                (f"tcp://127.0.0.1:{free_port()}", False, "tcp")):
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        router.bind(endpoint)
        dealer.connect(endpoint)
        dealer.send(b"hi")
        assert router.poll(5000)
        frame = router.recv(copy=False)
        assert peer_identity(frame, ipc) == want
        router.close(linger=0)
        dealer.close(linger=0)


def test_the_uid_is_read_from_the_end_of_the_peer_address():
    assert uid_of("localhost:1000:100:4242") == 1000 and uid_of(":0:0:1") == 0
    assert uid_of("") is None and uid_of("127.0.0.1") is None and uid_of("localhost:x:1:2") is None


def test_the_salt_joins_the_identity_and_the_cache_salt():
    alice, bob = uid_identity(1000), uid_identity(1001)
    assert engine_salt(alice, None, "user") != engine_salt(bob, None, "user")
    assert engine_salt(alice, "s", "user") != engine_salt(bob, "s", "user")  # a salt never replaces the uid
    assert engine_salt(alice, "s", "user") != engine_salt(alice, None, "user")
    assert engine_salt(bob, '["uid:1000", ""]', "user") != engine_salt(alice, None, "user")  # nor mimics one
    assert engine_salt(alice, None, "all") == engine_salt(bob, None, "all") == ""
    assert engine_salt(alice, "s", "all") == engine_salt(bob, "s", "all") != ""


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_tiny(tmp_path_factory, "sharing")


@pytest.mark.parametrize("sharing", ["user", "all"])
def test_two_users_share_prefixes_only_when_the_config_says_all(loaded, sharing):
    """The daemon's salts for uids 1000 and 1001 on one engine: user B hits user A's prompt only
    with prefix_sharing = "all"; user A always hits its own."""
    eng = make_engine(loaded)
    kv = eng.kv_cache_manager
    prompt = fresh_prompt(loaded.config.vocab_size)

    def run(rid: str, uid: int) -> int:
        eng.add_request(rid, prompt, greedy(2), cache_salt=engine_salt(uid_identity(uid), None, sharing))
        while eng.has_unfinished():
            eng.step()
        return kv.prefix_hits

    assert run("a", 1000) == 0
    assert run("b", 1001) == (CACHED if sharing == "all" else 0)
    assert run("a2", 1000) == (2 * CACHED if sharing == "all" else CACHED)


# -- in a daemon: ipc peers and a TCP peer -----------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path, _, _ = make_tiny(tmp_path_factory.mktemp("model"), "llama")
    return str(path)


def start(tmp_path_factory, model: str, *flags) -> Daemon:
    d = Daemon(tmp_path_factory.mktemp("sharing"), model, "--num-kv-blocks", 256, "--tcp",
               f"tcp://127.0.0.1:{free_port()}", *flags)
    d.tcp = next(a for a in d.proc.args if str(a).startswith("tcp://"))
    hello = Raw(d.endpoint)
    d.hello = hello.call({"type": "hello", "id": "h"})
    hello.close()
    return d


@pytest.fixture(scope="module")
def per_user(tmp_path_factory, model):
    port = free_port()
    d = start(tmp_path_factory, model, "--http", f"127.0.0.1:{port}")
    d.url = f"http://127.0.0.1:{port}"
    yield d
    assert d.stop() == 0, d.output()


@pytest.fixture(scope="module")
def shared(tmp_path_factory, model):
    d = start(tmp_path_factory, model, "--prefix-sharing", "all")
    yield d
    assert d.stop() == 0, d.output()


def ask(endpoint: str, prompt: list[int], **fields) -> int:
    """One request on a new connection; -> its cached prompt tokens."""
    c = Raw(endpoint)
    c.generate("a", stream=False, prompt_token_ids=prompt, params={"max_tokens": 2, "ignore_eos": True}, **fields)
    pump_all([c], lambda: not c.open)
    c.close()
    s = c.streams["a"]
    assert s["error"] is None, s["error"]
    return s["final"]["usage"]["cached_tokens"]


def test_hello_says_who_shares(per_user, shared):
    assert per_user.hello["prefix_sharing"] == "user" and shared.hello["prefix_sharing"] == "all"


def test_a_user_shares_with_itself_and_not_with_another_identity(per_user):
    p = fresh_prompt(per_user.hello["model"]["vocab_size"])
    assert ask(per_user.endpoint, p) == 0
    assert ask(per_user.endpoint, p) == CACHED  # another connection of the same uid
    assert ask(per_user.tcp, p) == 0  # another identity: no hit on the first's prompt
    assert ask(per_user.tcp, p) == CACHED  # its own


def test_a_cache_salt_splits_sharing_and_never_joins_identities(per_user):
    p = fresh_prompt(per_user.hello["model"]["vocab_size"])
    assert ask(per_user.endpoint, p, cache_salt="team") == 0
    assert ask(per_user.endpoint, p) == 0
    assert ask(per_user.endpoint, p, cache_salt="team") == CACHED
    assert ask(per_user.tcp, p, cache_salt="team") == 0  # the same salt from another identity


def test_prefix_sharing_all_shares_across_identities(shared):
    p = fresh_prompt(shared.hello["model"]["vocab_size"])
    assert ask(shared.endpoint, p) == 0
    assert ask(shared.tcp, p) == CACHED
    assert ask(shared.tcp, p, cache_salt="x") == 0 and ask(shared.endpoint, p, cache_salt="x") == CACHED


@pytest.mark.parametrize("salt", [5, "", "x" * 1025, ["a"]], ids=["int", "empty", "too-long", "array"])
def test_a_bad_cache_salt_is_invalid_field(per_user, salt):
    c = Raw(per_user.endpoint)
    c.generate("a", prompt="hi", cache_salt=salt)
    reply = c.recv()
    c.close()
    assert reply["type"] == "error" and reply["code"] == "invalid_field" and "cache_salt" in reply["message"]


# -- over HTTP: the API key's identity -------------------------------------------------------------
def cached_over_http(d, prompt: list[int], key: str, **extra) -> int:
    oai = openai.OpenAI(base_url=d.url + "/v1", api_key=key, max_retries=0, timeout=60)
    r = oai.completions.create(model="x", prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True, **extra})
    return r.usage.prompt_tokens_details.cached_tokens


def test_http_clients_share_only_with_the_same_api_key(per_user):
    p = fresh_prompt(per_user.hello["model"]["vocab_size"])
    assert cached_over_http(per_user, p, "alice") == 0
    assert cached_over_http(per_user, p, "alice") == CACHED
    assert cached_over_http(per_user, p, "bob") == 0
    assert cached_over_http(per_user, p, "bob", cache_salt="s") == 0
    assert cached_over_http(per_user, p, "bob", cache_salt="s") == CACHED
    assert ask(per_user.endpoint, p) == 0  # the gateway's own user, on ipc, without a key


def test_a_cache_salt_that_is_not_a_string_is_a_400(per_user):
    oai = openai.OpenAI(base_url=per_user.url + "/v1", api_key="alice", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        oai.completions.create(model="x", prompt="hi", max_tokens=2, extra_body={"cache_salt": 5})
