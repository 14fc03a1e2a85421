"""Shared pieces of the daemon tests: a real `ridge serve` process on a
temporary endpoint with a tiny GGUF model, and raw DEALER clients that speak
the protocol frame by frame (no client library, no mocks). No tests here."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq

from ridge.daemon.transport.endpoint import ipc_path, socket_alive

ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT = 0.5


def daemon_env(tmp: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RIDGE_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    env.update(XDG_RUNTIME_DIR=str(tmp / "xdg-run"), XDG_CONFIG_HOME=str(tmp / "xdg-config"),
               XDG_DATA_HOME=str(tmp / "xdg-data"), PYTHONPATH=str(ROOT), RIDGE_LOG_LEVEL="INFO")
    (tmp / "xdg-run").mkdir(exist_ok=True, mode=0o700)
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Daemon:
    def __init__(self, tmp: Path, model: str, *flags, env_extra: dict | None = None, endpoint: str | None = None,
                 wait: bool = True, entry: tuple[str, ...] = ("-m", "ridge.cli")):
        """entry: what runs `ridge` (a script that prepares the process, then calls ridge.cli.main)."""
        self.tmp = tmp
        self.env = daemon_env(tmp, **(env_extra or {}))
        self.endpoint = endpoint or f"ipc://{tmp / 'xdg-run' / 'ridge' / 'ridge.sock'}"
        cmd = [sys.executable, *entry, "serve", "--model", model, "--device", "cpu", "--threads", "1",
               "--heartbeat-interval", str(HEARTBEAT), *map(str, flags)]
        if endpoint:
            cmd += ["--endpoint", endpoint]
        self.log_path = tmp / f"daemon-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not socket_alive(ipc_path(self.endpoint)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start (rc {self.proc.poll()}):\n{self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # faulthandler: the stacks go to the log
            time.sleep(0.5)
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


class Raw:
    """One DEALER. Tracks the streams it started: id -> {"tokens", "text", "deltas", "final", "error"}."""

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None):
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.endpoint = endpoint
        self.streams: dict[str, dict] = {}
        self.other: list[dict] = []  # frames that belong to no stream (replies, heartbeats, shutdown)
        self.last_send = time.monotonic()

    def send(self, msg: dict, v: int = 1) -> None:
        self.send_raw(pack({"v": v, **msg}))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(frames)
        self.last_send = time.monotonic()

    def generate(self, rid: str, stream: bool = True, **fields) -> None:
        self.streams[rid] = {"tokens": [], "text": "", "deltas": 0, "final": None, "error": None}
        self.send({"type": "generate", "id": rid, "stream": stream, **fields})

    @property
    def open(self) -> list[str]:
        return [r for r, s in self.streams.items() if s["final"] is None and s["error"] is None]

    def recv(self, timeout: float = 10.0) -> dict:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no frame from the daemon")
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def pump(self) -> list[dict]:
        """Read whatever is there; file stream frames; -> the frames read."""
        got = []
        while self.sock.poll(0):
            msg = msgpack.unpackb(self.sock.recv(), raw=False)
            got.append(msg)
            s = self.streams.get(msg.get("id"))
            if s is None or msg["type"] not in ("delta", "final", "error"):
                self.other.append(msg)
            elif msg["type"] == "delta":
                s["tokens"] += msg["token_ids"]
                s["text"] += msg["text"]
                s["deltas"] += 1
            elif msg["type"] == "final":
                s["final"] = msg
            else:
                s["error"] = msg
        if self.open and time.monotonic() - self.last_send > HEARTBEAT:
            self.send({"type": "heartbeat"})
        return got

    def call(self, msg: dict, timeout: float = 10.0) -> dict:
        """Send one message with an id and return the reply with that id."""
        self.send(msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self.recv(deadline - time.monotonic())
            if reply.get("id") == msg.get("id"):
                return reply
        raise TimeoutError(f"no reply to {msg}")

    def close(self) -> None:
        self.sock.close()


def pump_all(clients: list[Raw], until, timeout: float = 120.0, on_frame=None) -> None:
    """Poll every client until `until()` holds; on_frame(client, msg) sees each frame."""
    poller = zmq.Poller()
    by_sock = {}
    for c in clients:
        poller.register(c.sock, zmq.POLLIN)
        by_sock[c.sock] = c
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            open_ = {r: (len(c.streams[r]["tokens"]), c.streams[r]["deltas"]) for c in clients for r in c.open}
            raise TimeoutError(f"streams did not finish: {len(open_)} open: {dict(list(open_.items())[:8])}; "
                               f"daemon: {stats(clients[0].endpoint)}")
        ready = dict(poller.poll(100))
        for c in clients:
            frames = c.pump() if c.sock in ready else (c.pump() if c.open else [])
            if on_frame:
                for m in frames:
                    on_frame(c, m)


def stats(endpoint: str) -> dict:
    c = Raw(endpoint)
    try:
        return c.call({"type": "stats", "id": "s"})
    finally:
        c.close()


def wait_idle(endpoint: str, timeout: float = 20.0) -> dict:
    """Until the engine holds no request and every KV block is free again; -> the stats reply."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(endpoint)
        st = s["stats"]
        if st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"] \
                and s["daemon"]["in_flight"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle: {st['running']} running, {st['waiting']} waiting, "
                                 f"{st['kv_blocks_used']} blocks used, {s['daemon']['in_flight']} in flight")
        time.sleep(0.1)
