"""The gateway's connection to the daemon: one asyncio DEALER (daemon/aio_client.py)
that every HTTP request shares, found as every client finds the daemon
(docs/protocol.md §1), made on first use and remade after it fails."""
from __future__ import annotations

import asyncio
import logging

from ..aio_client import AsyncClient
from ..client import DaemonUnavailable, RidgeError
from .openai_api import ApiError, from_daemon

log = logging.getLogger("ridge.gateway")

HELLO_TIMEOUT_S = 5.0


class DaemonLink:
    def __init__(self, endpoint: str | None = None):
        self.endpoint = endpoint  # None: RIDGE_ENDPOINT, then the user socket, then the system one
        self.client: AsyncClient | None = None
        self.hello: dict = {}
        self._token_text: dict[int, str] = {}

    async def connect(self) -> AsyncClient:
        """The client, after a `hello`; an ApiError 503 when no daemon answers."""
        if self.client is not None:
            if self.client.failure is None:
                return self.client
            old, self.client = self.client, None  # its reader failed: a new connection
            await old.aclose()
        try:
            client = AsyncClient(self.endpoint, timeout=HELLO_TIMEOUT_S)
        except DaemonUnavailable as e:
            raise ApiError(503, f"the ridge daemon is not running: {e.message}", "service_unavailable_error",
                           code="unavailable", retry_after=5.0) from None
        try:
            self.hello = await client.hello()
        except RidgeError as e:
            await client.aclose()
            raise from_daemon(e.code, e.message, e.reply) from None
        # §4.4: with requests in flight, 3 heartbeat intervals without a frame mean the daemon is gone.
        client.timeout = 3 * client.heartbeat_interval + 2.0
        self._token_text.clear()  # another daemon may serve another model
        self.client = client
        log.info("connected to the daemon at %s: %s", client.endpoint, self.model["name"])
        return client

    async def refresh(self) -> None:
        """Ask `hello` again: the daemon may have been restarted on another model."""
        client = await self.connect()
        try:
            self.hello = await client.hello()
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
        if self.client is not None and (e.code == "timeout" or self.client.failure is not None):
            log.warning("the daemon at %s stopped answering", self.client.endpoint)
            old, self.client, self.hello = self.client, None, {}
            asyncio.get_running_loop().create_task(old.aclose())  # its other requests end with it
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
        if self.client is not None:
            await self.client.aclose()
            self.client = None
