"""The daemon's pieces without a daemon: frame decoding, message checks, the
stream assembler, configuration layering, endpoints and their modes, CURVE,
sd_notify, and the absence of pickle. Real sockets and files, no mocks."""
from __future__ import annotations

import argparse
import ast
import os
import socket
import stat
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from ridge.daemon import protocol as P
from ridge.daemon.cli.config import add_serve_args, defaults, resolve
from ridge.daemon.transport.endpoint import (EndpointError, EndpointLock, check_tcp, client_candidates, is_loopback, load_curve,
                                   prepare_dir, pub_endpoint_for, secure_curve_socket, socket_alive, tcp_host,
                                   user_dir)
from ridge.daemon.transport.notify import Notifier
from ridge.daemon.transport.peers import Peer
from ridge.daemon.frontend.streams import InFlight
from ridge.daemon.frontend.validate import Validator
from ridge.engine.output import RequestOutput

DAEMON_DIR = Path(__file__).resolve().parent.parent / "daemon"


# -- frames ------------------------------------------------------------------------------
def code_of(fn, *a):
    with pytest.raises(P.ProtocolError) as e:
        fn(*a)
    return e.value.code


def test_unpack_accepts_plain_maps_and_rejects_the_rest():
    msg = {"v": 1, "type": "health", "id": "x", "nested": [1, 2.5, None, True, {"a": "b"}]}
    assert P.unpack(P.pack(msg), 1 << 20) == msg
    assert code_of(P.unpack, b"\xc1", 100) == P.BAD_MSGPACK
    assert code_of(P.unpack, P.pack({"a": 1}) + b"\x01", 100) == P.BAD_MSGPACK
    assert code_of(P.unpack, P.pack("str"), 100) == P.BAD_MSGPACK
    assert code_of(P.unpack, msgpack.packb({1: 1}), 100) == P.BAD_MSGPACK
    assert code_of(P.unpack, b"\x81\xa1a\xa2\xc3\x28", 100) == P.BAD_UTF8
    assert code_of(P.unpack, P.pack({"a": "x" * 200}), 100) == P.TOO_LARGE
    assert code_of(P.unpack, msgpack.packb({"t": msgpack.ExtType(1, b"z")}), 100) == P.BAD_MSGPACK
    for bad in ({"b": b"bin"}, {"t": msgpack.Timestamp(1, 0)}):
        obj = msgpack.unpackb(msgpack.packb(bad), raw=False, timestamp=0)
        assert code_of(P.check_plain, obj) == P.BAD_MSGPACK
    deep: list = []
    for _ in range(P.MAX_DEPTH + 2):
        deep = [deep]
    assert code_of(P.check_plain, {"d": deep}) == P.BAD_MSGPACK


def test_envelope_checks_version_type_and_id():
    env = P.envelope({"v": 1, "type": "stats", "id": "a"})
    assert (env.type, env.id, env.body, env.v) == ("stats", "a", {}, 1)
    assert P.envelope({"v": 2, "type": "stats"}).v == 2 and P.envelope({"v": 3, "type": "embed", "id": "e"}).v == 3
    assert code_of(P.envelope, {"type": "stats"}) == P.MISSING_FIELD
    assert code_of(P.envelope, {"v": True, "type": "stats"}) == P.INVALID_FIELD
    with pytest.raises(P.ProtocolError) as e:
        P.envelope({"v": 6, "type": "stats", "id": "q"})
    assert e.value.code == P.UNSUPPORTED_VERSION and e.value.extra == {"supported": [1, 2, 3, 4, 5]} and e.value.request_id == "q"
    assert code_of(P.envelope, {"v": 1}) == P.MISSING_FIELD
    assert code_of(P.envelope, {"v": 1, "type": "boom"}) == P.UNKNOWN_TYPE
    assert code_of(P.envelope, {"v": 1, "type": "generate"}) == P.MISSING_FIELD
    assert code_of(P.envelope, {"v": 1, "type": "stats", "id": ""}) == P.INVALID_FIELD
    assert code_of(P.envelope, {"v": 1, "type": "stats", "id": "é" * 100}) == P.INVALID_FIELD  # 200 bytes


def error_id(fn, *a):
    with pytest.raises(P.ProtocolError) as e:
        fn(*a)
    return e.value.request_id


def test_errors_carry_every_id_the_daemon_can_read():
    """Issue 15, defect 5: a client with several requests on one socket must learn which one failed."""
    long_id = "x" * 129
    assert error_id(P.envelope, {"v": 1, "type": "generate", "id": long_id, "prompt": "p"}) == long_id
    assert error_id(P.envelope, {"v": 7, "type": "generate", "id": long_id}) == long_id
    assert error_id(P.envelope, {"v": 1, "type": "health", "id": 5}) is None  # not a string: nothing to echo
    # A valid id beside a string that is not UTF-8 (the prompt), and beside trailing bytes.
    frame = b"\x84\xa1v\x01\xa4type\xa8generate\xa2id\xa2u8\xa6prompt\xa2\xff\xfe"
    with pytest.raises(P.ProtocolError) as e:
        P.unpack(frame, 1 << 20)
    assert e.value.code == P.BAD_UTF8 and e.value.request_id == "u8"
    assert error_id(P.unpack, P.pack({"v": 1, "type": "health", "id": "tr"}) + b"\x00", 100) == "tr"
    assert error_id(P.unpack, b"\x82\xa2id\xa2\xff\xfe\xa1v\x01", 100) is None  # the id itself is broken
    assert error_id(P.unpack, P.pack({"v": 1, "id": "cut", "type": "health"})[:-3], 100) is None


# -- validation -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def validator(tmp_path_factory):
    from tiny_models import write_tokenizer_files

    from ridge.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    tok = Tokenizer.from_hf_dir(d)
    from ridge.daemon.cli.serve import limits

    return Validator(tok, tok.vocab_size, 64, 16, 8, limits(defaults(), 64))  # prompts <= 63, max_tokens <= 64


def gen(**body):
    return P.Envelope("generate", "g", body)


def test_generate_is_tokenized_and_bounded(validator):
    req = validator.generate(gen(prompt="the hat", params={"max_tokens": 5, "temperature": 1, "stop": ["x"]}))
    assert req.prompt_token_ids == validator.tokenizer.encode("the hat") and req.stream is True
    assert req.params.max_tokens == 5 and req.params.temperature == 1.0 and req.params.stop == ["x"]
    chat = validator.generate(gen(messages=[{"role": "user", "content": "hi"}], stream=False))
    assert chat.prompt_token_ids == validator.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    # The default 256, lowered to the daemon's limit (64), then to the context the prompt leaves,
    # as the engine would: the engine takes what the validator admits without checking it again.
    assert chat.params.max_tokens == 64 - len(chat.prompt_token_ids)
    assert validator.generate(gen(prompt_token_ids=[5, 6])).prompt_token_ids == [5, 6]
    assert code_of(validator.generate, gen(prompt_token_ids=[5] * 64)) == P.INVALID_REQUEST
    # 8 blocks of 16 hold 128 tokens; the context is 64, so it always fits here
    assert code_of(validator.generate, gen(prompt="")) == P.INVALID_REQUEST


@pytest.mark.parametrize("params", [
    {"max_tokens": 0}, {"max_tokens": 65}, {"max_tokens": 1.5}, {"temperature": float("nan")},
    {"temperature": -1}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": 2}, {"repetition_penalty": 0},
    {"seed": "7"}, {"stop": "x"}, {"stop": [1]}, {"stop_token_ids": [-1]}, {"ignore_eos": 1},
    {"logprobs": 21}, {"n": 0}, {"n": 65}, {"speculative": None}, {"whatever": 1}])
def test_absurd_sampling_parameters_are_invalid_fields(validator, params):
    assert code_of(validator.generate, gen(prompt="x", params=params)) == P.INVALID_FIELD


def test_response_format_is_checked_and_compiled_at_admission(validator):
    ok = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}
    req = validator.generate(gen(prompt="x", params={"response_format": ok}))
    assert req.params.response_format == ok
    assert validator.generate(gen(prompt="x", params={"response_format": {"type": "regex", "regex": "a+"}}))
    for fmt, says in [
            ("json", "params.response_format must be a map with a type"),
            ({"type": "yaml"}, "params: response_format.type must be one of text, json_object, json_schema"),
            ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
             "params.response_format: the JSON schema does not compile: "),
            ({"type": "regex", "regex": "[a-"}, "params.response_format: the regex does not compile: "),
            ({"type": "grammar", "grammar": "start: ("}, "params.response_format: the grammar does not compile: ")]:
        with pytest.raises(P.ProtocolError) as e:
            validator.generate(gen(prompt="x", params={"response_format": fmt}))
        assert e.value.code == P.INVALID_FIELD and e.value.message.startswith(says), e.value.message


def test_small_operations(validator):
    ids = validator.tokenize(P.Envelope("tokenize", None, {"text": "the"}))
    assert validator.detokenize(P.Envelope("detokenize", None, {"token_ids": ids})) == "the"
    assert validator.hello(P.Envelope("hello", None, {"versions": [0, 1]})) == 1
    assert code_of(validator.hello, P.Envelope("hello", None, {"versions": [6]})) == P.UNSUPPORTED_VERSION
    assert code_of(validator.tokenize, P.Envelope("tokenize", None, {})) == P.MISSING_FIELD
    assert code_of(validator.no_fields, P.Envelope("stats", None, {"x": 1})) == P.INVALID_FIELD


# -- the stream assembler ----------------------------------------------------------------------
def out(index, ids, text, finished=False, reason=None, n_out=0):
    return RequestOutput("e1", index, ids, text, finished, reason, None, None, 3, n_out, 0,
                         {"queue": 0.1, "ttft": 0.2, "decode_tps": 5.0, "e2e": 1.0} if finished else {})


def test_inflight_merges_deltas_and_ends_with_one_final():
    inf = InFlight(None, "a", "e1", stream=True, n=2, logprobs=False)
    inf.add(out(0, [1], "x", n_out=1))
    inf.add(out(0, [2], "y", n_out=2))  # two steps behind: merged into one delta
    inf.add(out(1, [3], "z", True, "stop", 1))
    frames = inf.take_frames()
    assert [(f["type"], f["index"], f["token_ids"], f["text"]) for f in frames] == \
        [("delta", 0, [1, 2], "xy"), ("delta", 1, [3], "z")]
    inf.add(out(0, [], "!", True, "length", 2))
    final = inf.take_frames()
    assert [f["type"] for f in final] == ["delta", "final"] and final[0]["token_ids"] == [] and final[0]["text"] == "!"
    f = final[1]
    assert f["finish_reason"] == "length" and f["usage"] == {"prompt_tokens": 3, "completion_tokens": 3,
                                                               "cached_tokens": 0}
    assert [c["finish_reason"] for c in f["choices"]] == ["length", "stop"] and inf.take_frames() == []


def test_inflight_forced_final_on_shutdown():
    inf = InFlight(None, "a", "e1", stream=False, n=1, logprobs=False)
    inf.add(out(0, [1, 2], "ab", n_out=2))
    inf.force_finish("abort", "shutdown")
    (f,) = inf.take_frames()
    assert f["finish_reason"] == "abort" and f["detail"] == "shutdown" and f["token_ids"] == [1, 2]


# -- a client that stops reading: the ROUTER pushes back -------------------------------------------
def test_peer_sees_a_full_queue_as_stalled_and_a_closed_one_as_gone(tmp_path):
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 4)
    router.bind(f"ipc://{tmp_path}/r.sock")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 4)
    dealer.connect(f"ipc://{tmp_path}/r.sock")
    dealer.send(b"hi")
    ident, _ = router.recv_multipart()
    peer = Peer((0, ident), router, ident)
    peer.outq.extend([b"x" * 65536] * 400)  # never read: the kernel buffers, then both HWMs, fill up
    status, sent = peer.send_pending()
    assert status == "stalled" and 0 < sent < 400 and peer.stalled_since is not None
    dealer.close(linger=0)
    # A peer that closes with nothing queued is reported at the next send. (One that closes with a full
    # queue may keep answering EAGAIN: libzmq can hold the pipe; the daemon's stall timeout covers that.)
    other = ctx.socket(zmq.DEALER)
    other.connect(f"ipc://{tmp_path}/r.sock")
    other.send(b"hi")
    ident2, _ = router.recv_multipart()
    peer2 = Peer((0, ident2), router, ident2)
    other.close(linger=0)
    deadline = time.monotonic() + 5
    status = None
    while status != "gone" and time.monotonic() < deadline:
        time.sleep(0.05)
        peer2.outq.append(b"ping")
        status, _ = peer2.send_pending()
    assert status == "gone"
    router.close(linger=0)


# -- configuration ------------------------------------------------------------------------------
def parse(*argv):
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_config_precedence_flag_env_file_default(tmp_path):
    cfg = tmp_path / "ridge" / "config.toml"
    cfg.parent.mkdir()
    cfg.write_text('max_queue = 7\nclient_timeout = 3.5\nmodel = "/m.gguf"\nmax_num_seqs = 9\nsystem = true\n')
    env = {"XDG_CONFIG_HOME": str(tmp_path), "RIDGE_MAX_QUEUE": "11", "RIDGE_MAX_NUM_SEQS": "12"}
    r = resolve(parse("--max-num-seqs", "13"), env)
    assert r.values["max_num_seqs"] == 13 and r.sources["max_num_seqs"] == "flag"
    assert r.values["max_queue"] == 11 and r.sources["max_queue"] == "env RIDGE_MAX_QUEUE"
    assert r.values["client_timeout"] == 3.5 and r.values["model"] == "/m.gguf" and r.values["system"] is True
    assert r.values["drain_grace"] == 30.0 and r.sources["drain_grace"] == "default"
    assert r.values["block_size"] == 16  # the engine's own default, from its EngineConfig field
    text = r.to_toml()
    assert "max_queue = 11  # env RIDGE_MAX_QUEUE" in text and "max_num_seqs = 13  # flag" in text
    cfg.write_text("max_qeue = 1\n")
    with pytest.raises(ValueError, match="unknown key"):
        resolve(parse(), env)
    cfg.write_text("max_queue = 'many'\n")
    with pytest.raises(ValueError, match="max_queue must be int"):
        resolve(parse(), {"XDG_CONFIG_HOME": str(tmp_path)})


# -- endpoints, modes, one daemon per endpoint ----------------------------------------------------
def test_socket_directories_get_their_modes(tmp_path):
    user, system = tmp_path / "u" / "ridge", tmp_path / "s"
    prepare_dir(user, 0o700)
    prepare_dir(system, 0o750, group="ridge")  # the group may not exist here: a warning, not a failure
    assert stat.S_IMODE(user.stat().st_mode) == 0o700 and stat.S_IMODE(system.stat().st_mode) == 0o750
    os.chmod(user, 0o755)
    prepare_dir(user, 0o700)  # ridge's own directory is put right
    assert stat.S_IMODE(user.stat().st_mode) == 0o700


def test_an_explicit_endpoint_directory_follows_the_same_rule(tmp_path):
    """Issue 15, defect 4: --endpoint's directory is checked and given its mode like the default one."""
    from ridge.daemon.cli.serve import claim_endpoint

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    lock = claim_endpoint(f"ipc://{mine}/r.sock", system=False)
    try:
        assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    finally:
        lock.release()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    if os.geteuid() == 0:
        os.chown(theirs, 65534, -1)  # root can hand it to `nobody`
    else:
        theirs = Path("/")  # owned by root
    with pytest.raises(EndpointError, match="belongs to uid"):
        claim_endpoint(f"ipc://{theirs}/r.sock", system=False)
    assert claim_endpoint("tcp://127.0.0.1:5555", system=False) is None


def test_served_model_name_is_the_gguf_file_name():
    """Issue 15, defect 6: the embedded model is called what the README calls it."""
    from ridge.daemon.frontend.registry import served_name
    from ridge.quant.source import default_model_path

    readme = (DAEMON_DIR.parent / "README.md").read_text()
    name = served_name({"path": str(default_model_path()), "name": "Smollm2 135M 8k Lc100K Mix1 Ep2"})
    assert name == "SmolLM2-135M-Instruct" and name in readme
    assert served_name({"path": "/m/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "name": "x"}) == "Qwen2.5-0.5B-Instruct"
    assert served_name({"path": "/m/tiny-llama-F32.gguf", "name": "x"}) == "tiny-llama"
    assert served_name({"path": "/m/some-hf-dir", "name": "some-hf-dir"}) == "some-hf-dir"
    assert user_dir({"XDG_RUNTIME_DIR": "/x"}) == Path("/x/ridge")
    assert pub_endpoint_for("ipc:///x/ridge.sock") == "ipc:///x/ridge-pub.sock"
    assert client_candidates({"RIDGE_ENDPOINT": "tcp://127.0.0.1:5"}) == ["tcp://127.0.0.1:5"]
    assert client_candidates({"XDG_RUNTIME_DIR": "/x"}) == ["ipc:///x/ridge/ridge.sock", "ipc:///run/ridge/ridge.sock"]


def test_lock_refuses_a_second_daemon_and_replaces_a_stale_socket(tmp_path):
    path = tmp_path / "ridge.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # a leftover file nobody listens on
    s.close()
    assert path.exists() and not socket_alive(path)
    first = EndpointLock(path)
    first.acquire()
    assert not path.exists()  # stale: removed, for the daemon to bind afresh
    with pytest.raises(EndpointError, match=f"pid {os.getpid()}"):
        EndpointLock(path).acquire()
    first.release()
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(path))
    live.listen()
    with pytest.raises(EndpointError, match="already listening"):
        EndpointLock(path).acquire()
    live.close()


def test_tcp_rules():
    assert tcp_host("tcp://127.0.0.1:5555") == "127.0.0.1" and tcp_host("tcp://[::1]:5") == "::1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("*") and not is_loopback("eth0")
    check_tcp("tcp://127.0.0.1:5555", None)
    for ep in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://192.168.1.5:5555", "tcp://eth0:5555"):
        with pytest.raises(EndpointError, match="CURVE"):
            check_tcp(ep, None)
    for ep in ("tcp://127.0.0.1:5555", "tcp://[::1]:5555", "tcp://localhost:5555"):  # any local user reaches these
        with pytest.raises(EndpointError, match="system daemon without CURVE"):
            check_tcp(ep, None, system=True)


def test_curve_from_files_admits_known_clients_only(tmp_path):
    import zmq.auth

    from ridge.daemon.client import make_socket

    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir(), clients.mkdir()
    _, server_secret = zmq.auth.create_certificates(keys, "server")
    client_public, client_secret = zmq.auth.create_certificates(keys, "client")
    _, stranger_secret = zmq.auth.create_certificates(keys, "stranger")
    os.rename(client_public, clients / "client.key")
    curve = load_curve(server_secret, str(clients))
    check_tcp("tcp://0.0.0.0:1", curve)  # non-loopback is allowed once CURVE is configured
    with pytest.raises(EndpointError):
        load_curve(server_secret, None)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    auth = secure_curve_socket(ctx, router, curve)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        good = make_socket(ctx, f"tcp://127.0.0.1:{port}", curve.public_key, client_secret)
        bad = make_socket(ctx, f"tcp://127.0.0.1:{port}", curve.public_key, stranger_secret)
        plain = make_socket(ctx, f"tcp://127.0.0.1:{port}")
        for s in (good, bad, plain):
            s.send(b"ping")
        assert router.poll(5000)
        assert router.recv_multipart()[1] == b"ping"
        assert not router.poll(1000)  # neither the unknown key nor the plaintext client got through
        for s in (good, bad, plain):
            s.close(linger=0)
    finally:
        router.close(linger=0)
        auth.stop()
        ctx.destroy(linger=0)


# -- sd_notify ----------------------------------------------------------------------------------
def test_notify_sends_ready_status_and_watchdog(tmp_path):
    path = tmp_path / "notify.sock"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(path))
    n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
    n.ready("serving x")
    n.status("busy")
    n.watchdog(True)
    n.watchdog(True)  # within the interval: no second ping
    n.watchdog(False)
    got = [sink.recv(4096).decode() for _ in range(3)]
    assert got[0].startswith("READY=1\nSTATUS=serving x") and got[1] == "STATUS=busy" and got[2] == "WATCHDOG=1"
    sink.settimeout(0.1)
    with pytest.raises(TimeoutError):
        sink.recv(4096)
    assert not Notifier({}).enabled
    assert Notifier({"NOTIFY_SOCKET": "@abstract"}).addr == "\0abstract"
    assert Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1", "WATCHDOG_PID": "1"}).watchdog_interval is None
    n.close()
    sink.close()


# -- no pickle ----------------------------------------------------------------------------------
def test_no_pickle_anywhere_in_the_daemon():
    banned = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle"}
    for path in DAEMON_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            elif isinstance(node, ast.Attribute) and node.attr in ("recv_pyobj", "send_pyobj", "load", "loads"):
                assert not (isinstance(node.value, ast.Name) and node.value.id in banned | {"torch"}), path
                assert node.attr not in ("recv_pyobj", "send_pyobj"), path
            assert not banned & set(names), (path, names)


def test_notify_never_blocks_on_a_full_receiver(tmp_path):
    path = tmp_path / "full.sock"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(path))  # never read
    n = Notifier({"NOTIFY_SOCKET": str(path)})
    t0 = time.monotonic()
    for _ in range(2000):
        n.status("x" * 100)
    assert time.monotonic() - t0 < 5
    n.close()
    sink.close()


def test_journald_log_lines_carry_syslog_priorities():
    import logging

    from ridge.daemon.cli.serve import JournalFormatter

    f = JournalFormatter("%(name)s: %(message)s")
    rec = logging.LogRecord("ridge.daemon", logging.WARNING, __file__, 1, "two\nlines", None, None)
    assert f.format(rec) == "<4>ridge.daemon: two\n<4>lines"
    rec.levelno = logging.INFO
    assert f.format(rec).startswith("<6>")


def test_embed_is_checked_by_the_validator(validator):
    """embed (§3.9): version 3 only, an embedding model's daemon only, inputs and dimensions checked."""
    import copy
    embedder = copy.copy(validator)
    embedder.embedding_size = 32
    env = lambda v=3, **body: P.Envelope("embed", "e", body, v)  # noqa: E731
    req = embedder.embed(env(input=["hello", [5, 6, 7]], dimensions=8))
    assert req.inputs[1] == [5, 6, 7] and req.inputs[0] and req.dimensions == 8 and req.version == 3
    assert code_of(embedder.embed, env(2, input=["hello"])) == P.UNKNOWN_TYPE
    assert code_of(validator.embed, env(input=["hello"])) == P.INVALID_REQUEST  # the model generates
    assert code_of(embedder.generate, gen(prompt="hi")) == P.INVALID_REQUEST
    for body, code in (({}, P.MISSING_FIELD), ({"input": []}, P.INVALID_FIELD), ({"input": "hi"}, P.INVALID_FIELD),
                       ({"input": [[]]}, P.INVALID_REQUEST), ({"input": [[10 ** 6]]}, P.INVALID_FIELD),
                       ({"input": ["x" * 0]}, P.INVALID_REQUEST), ({"input": [[1] * 64]}, P.INVALID_FIELD),
                       ({"input": ["hi"], "dimensions": 33}, P.INVALID_FIELD),
                       ({"input": ["hi"], "dimensions": 0}, P.INVALID_FIELD),
                       ({"input": ["hi"], "extra": 1}, P.INVALID_FIELD)):
        assert code_of(embedder.embed, env(**body)) == code, body
