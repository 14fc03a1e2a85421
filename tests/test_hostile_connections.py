"""Clients that try to crash or starve a shared daemon through its HTTP gateway,
against a real `ridge serve --http` on a tiny GGUF model (no mocks):

- a flood of TCP connections that never finish their headers, more than the
  daemon's open-file limit holds: the daemon lives, its socket clients keep
  their answers, HTTP clients that send their headers are served, and the slow
  connections are closed after `http_header_timeout`;
- one API key holder at its requests-in-flight limit: it alone gets 429.

The flood test runs the daemon under an open-file limit of N_FILES (soft and
hard, so it cannot raise it), which keeps it small and fast."""
from __future__ import annotations

import errno
import http.client
import json
import os
import resource
import socket
import time

import pytest

from test_daemon_harness import Daemon, Raw, stats
from test_gateway import free_port, wait_http
from tiny_models import make_tiny

N_FILES = 400  # the daemon's open-file limit: its HTTP cap is (400 - 256) // 2 = 72 connections
SLOW = 480  # connections that never finish their headers: past the cap, and past every file the daemon has
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
KEY = "alice-key"
ENTRY = f"""
import resource
import sys

resource.setrlimit(resource.RLIMIT_NOFILE, ({N_FILES}, {N_FILES}))
from ridge.cli import main

sys.exit(main())
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """One daemon for both tests: few open files, two API keys, two requests in flight per client."""
    tmp = tmp_path_factory.mktemp("hostile")
    model, _, _ = make_tiny(tmp, "llama", max_position=4096)
    script = tmp / "ridge_few_files.py"
    script.write_text(ENTRY)
    keys = tmp / "api_keys"
    keys.write_text("alice-key\n\n# the team's other keys, one a line\nbob-key\n")
    port = free_port()
    d = Daemon(tmp, str(model), "--http", f"127.0.0.1:{port}", "--api-key-file", keys,
               "--max-requests-per-client", 2, "--max-num-seqs", 8, "--served-model-name", "tiny",
               entry=(str(script),), env_extra={"RIDGE_HTTP_HEADER_TIMEOUT": HEADER_TIMEOUT,
                                                "RIDGE_HTTP_BODY_TIMEOUT": BODY_TIMEOUT})
    d.port = port
    try:
        wait_http(f"http://127.0.0.1:{d.port}")
        yield d
    finally:
        assert d.stop() == 0, d.output()[-3000:]


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def request(port: int, method: str, path: str, body=None, key: str | None = None,
            timeout: float = 30) -> tuple[int, dict, http.client.HTTPConnection]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, None if body is None else json.dumps(body), headers)
    resp = conn.getresponse()
    if body is not None and body.get("stream"):  # the status comes with the first token; the rest is left unread
        return resp.status, {}, conn
    reply = json.loads(resp.read() or b"null")
    conn.close()
    return resp.status, reply, conn


def half_open(port: int) -> socket.socket | None:
    """A connection that sends the start of a request and never its end (slowloris); None if the
    daemon had already closed it."""
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
    except OSError:
        s.close()
        return None
    return s


def closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(0)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError as e:
        return e.errno in (errno.ECONNRESET, errno.EPIPE)


def chat_ok(port: int, key: str) -> dict:
    status, reply, _ = request(port, "POST", "/v1/chat/completions",
                               {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                               key)
    assert status == 200, reply
    return reply


def test_half_finished_connections_past_the_file_limit_cannot_starve_the_daemon(daemon):
    d, port = daemon, daemon.port
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < SLOW + 64:  # this process holds the slow connections' other ends
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    slow: list[socket.socket] = []
    zmq_client = Raw(d.endpoint)
    try:
        chat_ok(port, KEY)
        peak, answers, started = 0, 0, time.monotonic()
        for i in range(SLOW):
            s = half_open(port)
            if s is not None:
                slow.append(s)
            if i % 40 == 39:  # a socket client keeps its answers throughout
                assert d.proc.poll() is None, d.output()[-3000:]
                peak = max(peak, fds(d.proc.pid))
                reply = zmq_client.call({"type": "generate", "id": f"g{i}", "stream": False, "prompt": "hi",
                                         "params": {"max_tokens": 2}}, timeout=20)
                assert reply["type"] == "final", reply
                answers += 1
        flood_s = time.monotonic() - started
        assert len(slow) > N_FILES  # they all connected: the gateway accepted them (or made room for them)
        # HTTP clients that send their headers are answered while the flood is held
        chat_ok(port, KEY)
        peak = max(peak, fds(d.proc.pid))
        assert peak < N_FILES - 128, f"the daemon held {peak} of its {N_FILES} files"
        # every slow connection is closed once its headers are late
        deadline = time.monotonic() + HEADER_TIMEOUT + 5
        while not all(closed_by_peer(s) for s in slow):
            assert time.monotonic() < deadline, \
                f"{sum(not closed_by_peer(s) for s in slow)} slow connections still open after {HEADER_TIMEOUT} s"
            time.sleep(0.2)
        assert d.proc.poll() is None, d.output()[-3000:]
        assert zmq_client.call({"type": "health", "id": "h"})["status"] == "ok"
        chat_ok(port, KEY)
        s = stats(d.endpoint)
        assert s["stats"]["memory"]["host_total"] > 0 and answers == SLOW // 40, (s, flood_s)
        out = d.output()
        assert "engine loop failed" not in out and "Too many open files" not in out, out[-3000:]
        assert "HTTP connections closed" in out  # the log says what the gateway did
    finally:
        for s in slow:
            s.close()
        zmq_client.close()


def test_a_body_that_never_ends_is_closed_after_the_body_timeout(daemon):
    """Headers in time, then a body that stops short: the connection is closed once the body is late,
    and not before."""
    s = socket.create_connection(("127.0.0.1", daemon.port), timeout=BODY_TIMEOUT + 10)
    try:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":".encode())
        t0 = time.monotonic()
        try:
            got = s.recv(1)  # b"": the gateway closed it, with nothing to say
        except ConnectionResetError:
            got = b""
        waited = time.monotonic() - t0
    finally:
        s.close()
    assert got == b"" and BODY_TIMEOUT - 0.5 < waited < BODY_TIMEOUT + 5, (got, waited)
    chat_ok(daemon.port, KEY)


LONG = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
        "ignore_eos": True, "stream": True}


def test_each_api_key_has_its_own_requests_in_flight(daemon):
    """The daemon's max_requests_per_client holds per key holder, each on a connection of its own: one
    at its limit gets 429, and another key holder (and a socket client) still gets answers."""
    d, port = daemon, daemon.port
    held = []
    try:
        for _ in range(2):  # alice's whole budget, streaming
            status, _, conn = request(port, "POST", "/v1/chat/completions", LONG, "alice-key")
            assert status == 200
            held.append(conn)
        status, reply, _ = request(port, "POST", "/v1/chat/completions", {**LONG, "stream": False}, "alice-key")
        assert status == 429 and reply["error"]["code"] == "too_many_requests", reply
        assert chat_ok(port, "bob-key")["usage"]["completion_tokens"] <= 3  # bob is not alice
        socket_client = Raw(d.endpoint)
        try:
            reply = socket_client.call({"type": "generate", "id": "g", "stream": False, "prompt": "hi",
                                        "params": {"max_tokens": 2}}, timeout=20)
            assert reply["type"] == "final", reply
        finally:
            socket_client.close()
        assert request(port, "GET", "/v1/models", key="carol-key")[0] == 401
        assert stats(d.endpoint)["daemon"]["in_flight"] == 2  # alice's, still running
    finally:
        for conn in held:
            conn.close()
    deadline = time.monotonic() + 10  # alice hung up: her requests are aborted
    while stats(d.endpoint)["daemon"]["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
