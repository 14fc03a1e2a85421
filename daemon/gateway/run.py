"""The gateway's server: uvicorn on a socket bound here first (so that a port in
use is an error at start-up, before anything says it is ready), either in the
foreground (`ridge gateway`) or on its own thread and event loop inside the
daemon (`ridge serve --http`, and `--ollama` for Ollama's API on a listener of
its own), talking to the daemon's own socket."""
from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from ..transport.endpoint import EndpointError
from .app import build_app
from .connections import CONNECTIONS, MAX_BACKLOG, connection_cap, guarded, raise_fd_limit
from .link import DaemonLink
from .settings import GatewaySettings

log = logging.getLogger("ridge.gateway")

# The kernel's send buffer of each HTTP connection (Linux doubles it; accepted sockets inherit it): what
# a client that stops reading can make the kernel hold for it before the gateway sees it stuck (then
# aborts it: daemon/aio_client.py). Autotuning would let each such client pin up to tcp_wmem's 4 MiB;
# a token stream needs a few KB a second, and 128 KiB per round trip still carries a whole answer fast.
SEND_BUFFER_BYTES = 128 << 10


def listen(settings: GatewaySettings) -> socket.socket:
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    try:
        sock.bind((settings.host, settings.port))
        sock.listen(MAX_BACKLOG)
    except OSError as e:
        sock.close()
        raise EndpointError(f"cannot serve HTTP on {settings.url}: {e.strerror}") from None
    return sock


def _server(app, settings: GatewaySettings) -> uvicorn.Server:
    # log_config=None: ridge's logging stays as it is; no access log (one line per request costs
    # more than the request's own work here). Both listeners share one cap (connections.py), from the
    # open-file limit as it is now: `ridge serve` and `ridge gateway` raise it first.
    CONNECTIONS.cap = connection_cap(settings.max_connections)
    return uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", ws="none",
                                         http=guarded(settings.header_timeout, settings.body_timeout),
                                         backlog=min(MAX_BACKLOG, CONNECTIONS.cap),
                                         timeout_graceful_shutdown=5, server_header=False))


def _describe(settings: GatewaySettings, ollama_api: bool = False) -> str:
    what = f"Ollama's API on {settings.url}/api and" if ollama_api else "OpenAI-compatible API on"
    return (f"{what} {settings.url}/v1 (metrics on /metrics"
            f"{'; API key required' if settings.api_key else ''})")


def run_foreground(settings: GatewaySettings, endpoint: str | None = None,
                   ollama: GatewaySettings | None = None) -> int:
    """`ridge gateway`: until SIGINT or SIGTERM; with `ollama`, Ollama's listener on a thread beside."""
    raise_fd_limit()
    sock = listen(settings)
    beside = GatewayThread(ollama, endpoint, listen(ollama), ollama_api=True) if ollama is not None else None
    server = _server(build_app(settings, DaemonLink(endpoint), time.process_time), settings)
    log.info("%s", _describe(settings))
    if beside is not None:
        beside.start()
    try:
        server.run(sockets=[sock])
    finally:
        if beside is not None:
            beside.stop()
    return 0


class GatewayThread(threading.Thread):
    """`ridge serve --http`: the gateway on a thread of the daemon, a client of its socket."""

    def __init__(self, settings: GatewaySettings, endpoint: str | None, sock: socket.socket, ollama_api: bool = False):
        super().__init__(name="ridge-ollama" if ollama_api else "ridge-gateway", daemon=True)
        self.settings, self.sock, self.ollama_api = settings, sock, ollama_api  # bound first: listen()
        # thread_time: read on this thread's event loop, it is the gateway's own CPU time
        self.server = _server(build_app(settings, DaemonLink(endpoint), time.thread_time, ollama_api), settings)

    def run(self) -> None:
        log.info("%s", _describe(self.settings, self.ollama_api))
        try:
            self.server.run(sockets=[self.sock])
        except BaseException:  # uvicorn exits with SystemExit on a failed start
            log.exception("the HTTP gateway stopped")

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.is_alive():
            self.join(timeout)
        self.sock.close()
