"""The gateway's connections to the daemon: one asyncio DEALER (daemon/aio_client.py)
per principal, which all of that principal's HTTP requests share, found as
every client finds the daemon (docs/protocol.md §1), made on first use and
remade after it fails.

A principal is an API key (app.Guard sets PRINCIPAL per request), or, with no
key, "http": every keyless HTTP user, who on loopback all look alike. The
daemon counts `max_requests_per_client` per connection, so each principal gets
the budget a socket client gets, and one that fills it gets 429 alone."""
from __future__ import annotations

import asyncio
import contextvars
import logging

from ..aio_client import AsyncClient
from ..client import DaemonUnavailable, RidgeError
from .openai_api import ApiError, from_daemon

log = logging.getLogger("ridge.gateway")

HELLO_TIMEOUT_S = 5.0
SHARED = "http"  # the principal of requests that carry no key
PRINCIPAL: contextvars.ContextVar[str] = contextvars.ContextVar("ridge_gateway_principal", default=SHARED)


class DaemonLink:
    def __init__(self, endpoint: str | None = None):
        self.endpoint = endpoint  # None: RIDGE_ENDPOINT, then the user socket, then the system one
        self.clients: dict[str, AsyncClient] = {}  # principal -> its connection
        self.hello: dict = {}
        self._token_text: dict[int, str] = {}

    @property
    def client(self) -> AsyncClient | None:
        """The current request's principal's connection (outside a request: the keyless one)."""
        return self.clients.get(PRINCIPAL.get())

    async def connect(self) -> AsyncClient:
        """The principal's client, after a `hello`; an ApiError 503 when no daemon answers."""
        principal = PRINCIPAL.get()
        if (old := self.clients.get(principal)) is not None:
            if old.failure is None:
                return old
            del self.clients[principal]  # its reader failed: a new connection
            await old.aclose()
        try:
            client = AsyncClient(self.endpoint, timeout=HELLO_TIMEOUT_S)
        except DaemonUnavailable as e:
            raise ApiError(503, f"the ridge daemon is not running: {e.message}", "service_unavailable_error",
                           code="unavailable", retry_after=5.0) from None
        try:
            self.hello = await client.hello(_principal(client, principal))
        except RidgeError as e:
            await client.aclose()
            raise from_daemon(e.code, e.message, e.reply) from None
        # §4.4: with requests in flight, 3 heartbeat intervals without a frame mean the daemon is gone.
        client.timeout = 3 * client.heartbeat_interval + 2.0
        if (other := self.clients.get(principal)) is not None and other.failure is None:
            await client.aclose()  # another request of this principal connected meanwhile
            return other
        if not self.clients:
            self._token_text.clear()  # another daemon may serve another model
        self.clients[principal] = client
        log.info("connected to the daemon at %s: %s", client.endpoint, self.model["name"])
        return client

    async def refresh(self) -> None:
        """Ask `hello` again: the daemon may have been restarted on another model."""
        client = await self.connect()
        try:
            self.hello = await client.hello(_principal(client, PRINCIPAL.get()))
        except RidgeError as e:
            raise self.failed(e) from None

    @property
    def model(self) -> dict:
        return self.hello.get("model", {})

    @property
    def limits(self) -> dict:
        return self.hello.get("limits", {})

    async def call(self, type_: str, **fields) -> dict:
        client = await self.connect()
        try:
            return await client.call(type_, **fields)
        except RidgeError as e:
            raise self.failed(e) from None

    def failed(self, e: RidgeError) -> ApiError:
        """A request's RidgeError -> its HTTP error; a daemon that stopped answering, or a connection
        whose reader failed, is reconnected next time."""
        client = self.client
        if client is not None and (e.code == "timeout" or client.failure is not None):
            log.warning("the daemon at %s stopped answering", client.endpoint)
            del self.clients[PRINCIPAL.get()]
            if not self.clients:
                self.hello = {}
            asyncio.get_running_loop().create_task(client.aclose())  # its other requests end with it
        return from_daemon(e.code, e.message, e.reply)

    async def token_text(self, ids: set[int]) -> dict[int, str]:
        """Each token's own text (for logprobs), asked of the daemon once per id."""
        missing = [t for t in ids if t not in self._token_text]
        if missing:  # one round trip per id, all at once, and every id only once
            replies = await asyncio.gather(*(self.call("detokenize", token_ids=[t], skip_special_tokens=False)
                                             for t in missing))
            self._token_text.update((t, r["text"]) for t, r in zip(missing, replies))
        return {t: self._token_text[t] for t in ids}

    async def close(self) -> None:
        clients, self.clients = list(self.clients.values()), {}
        for client in clients:
            await client.aclose()


def _principal(client, principal: str) -> str | None:
    """What the connection tells the daemon it speaks for: over ipc the gateway runs as a user the
    daemon knows by uid, and splits that identity per principal (Server._subdivide); over TCP the
    daemon knows no user to split."""
    return f"http:{principal}" if client.endpoint.startswith("ipc://") else None
