"""The gateway's HTTP application (Starlette): its routes, who it answers (the
Host, the Origin and JSON bodies: door.py), the API key, CORS, and errors in
OpenAI's shape (Anthropic's on /v1/messages)."""
from __future__ import annotations

import contextlib
import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route

from ridge.errors import internal_error

from . import anthropic_api, openapi, responses_api
from .embeddings_api import embeddings
from .rerank_api import ROUTES as RERANK_ROUTES
from . import responses as R
from .door import HostRule, body_admitted, origin_allowed
from .generation import ClientGone, generate
from .link import PRINCIPAL, SHARED, DaemonLink
from .metrics import CONTENT_TYPE, Metrics
from .openai_api import ApiError
from .settings import GatewaySettings

log = logging.getLogger("ridge.gateway")
OPEN_PATHS = ("/health", "/openapi.json")  # answered without the API key: liveness probes, the schema
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # Anthropic's error shape; key in x-api-key too


def error_response(e: ApiError, path: str = "") -> JSONResponse:
    if path.startswith("/api/"):  # Ollama's routes: {"error": message}, as its clients read it
        body = {"error": e.message}
    else:
        body = anthropic_api.error_body(e) if path in ANTHROPIC_PATHS else e.body()
    return JSONResponse(body, e.status, headers=e.headers())


def _headers(scope, name: bytes) -> list[str]:
    return [v.decode("latin-1") for k, v in scope["headers"] if k == name]


class Door:
    """The outermost ASGI middleware: the Host allowlist and the Origin rule (door.py), before
    CORS answers a preflight; and the count of every answer by route and status for /metrics."""

    def __init__(self, app, hosts: HostRule, origins: tuple[str, ...], metrics: Metrics, routes: set[str]):
        self.app, self.hosts, self.origins, self.metrics, self.routes = app, hosts, origins, metrics, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counted_send(message):
            if message["type"] == "http.response.start":
                self.metrics.collector.count(route, message["status"])
            await send(message)

        refused = self.refusal(scope)
        if refused is not None:
            return await error_response(refused, scope["path"])(scope, receive, counted_send)
        await self.app(scope, receive, counted_send)

    def refusal(self, scope) -> ApiError | None:
        hosts = _headers(scope, b"host")
        if len(hosts) != 1:  # HTTP/1.1 requires exactly one (RFC 9112 §3.2)
            return ApiError(400, "a request needs exactly one Host header", code="invalid_host")
        if not self.hosts.allows(hosts[0]):
            return ApiError(421, f"this gateway does not answer for Host {hosts[0]!r}: it answers for localhost, "
                            "loopback addresses, its own address and the names in allowed_hosts",
                            code="misdirected_request")
        origins = _headers(scope, b"origin")
        if origins and not origin_allowed(origins[0], hosts[0], self.origins):
            return ApiError(403, f"requests from the web origin {origins[0]!r} are not allowed (cors_allow_origins "
                            "names the origins that are)", "permission_error", code="origin_not_allowed")
        return None


class Guard:
    """ASGI middleware inside CORS (a browser's preflight carries no key): the API key (Bearer) on
    every route but /health, and JSON bodies on POST (door.body_admitted). The key a request carries
    names its principal (link.py), whose connection to the daemon, and so whose requests-in-flight
    budget, it uses."""

    def __init__(self, app, api_keys: tuple[str, ...]):
        self.app = app
        self.expected = [(f"Bearer {k}".encode(), k.encode(), f"key{i}") for i, k in enumerate(api_keys)]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        principal, refused = self.admit(scope)
        if refused is not None:
            return await error_response(refused, scope["path"])(scope, receive, send)
        token = PRINCIPAL.set(principal)
        try:
            await self.app(scope, receive, send)
        finally:
            PRINCIPAL.reset(token)

    def _principal(self, scope) -> str | None:
        """The key's principal, or None; every key is compared, in constant time, whichever matches."""
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        given_x = headers.get(b"x-api-key", b"") if scope["path"] in ANTHROPIC_PATHS else None
        found = None
        for bearer, key, principal in self.expected:
            hit = hmac.compare_digest(given, bearer) | (given_x is not None and hmac.compare_digest(given_x, key))
            if hit and found is None:
                found = principal
        return found

    def admit(self, scope) -> tuple[str, ApiError | None]:
        """-> (the request's principal, or why it is refused)."""
        principal = SHARED
        if self.expected and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            principal = self._principal(scope)
            if principal is None:
                return SHARED, ApiError(401, "a valid API key is required: Authorization: Bearer KEY",
                                        "authentication_error", code="invalid_api_key")
        if scope["method"] == "POST" and not body_admitted((_headers(scope, b"content-type") or [None])[0],
                                                            bool(_headers(scope, b"origin"))):
            return principal, ApiError(415, "a POST body must be JSON, sent as Content-Type: application/json "
                                       "(a program that sends no Origin may also leave the type out, or send "
                                       "curl's application/x-www-form-urlencoded)", code="unsupported_media_type")
        return principal, None


# -- routes ------------------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    try:
        h = await request.app.state.link.call("health")
    except ApiError as e:
        return JSONResponse({"status": "unavailable", "error": e.message}, 503, headers=e.headers())
    body = {k: h[k] for k in ("status", "model", "running", "waiting")}
    return JSONResponse(body, 200 if h["status"] == "ok" else 503)


def _model_card(request: Request, m: dict) -> dict:
    """One of the daemon's models (docs/protocol.md §3.10); max_model_len is known once it loaded,
    and always for the default."""
    link = request.app.state.link
    length = m.get("max_model_len") or (link.model["max_model_len"] if m["default"] else None)
    return {"id": m["name"], "object": "model", "created": request.app.state.started,
            "owned_by": "ridge", "max_model_len": length}


async def _listing(request: Request) -> list[dict]:
    link = request.app.state.link
    await link.refresh()
    return (await link.call("models"))["models"]


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request, m) for m in await _listing(request)]})


async def model(request: Request) -> Response:
    listing = await _listing(request)
    found = [m for m in listing if m["name"] == request.path_params["model"]]
    if not found:
        raise ApiError(404, f"the model {request.path_params['model']!r} does not exist; this daemon serves "
                       f"{', '.join(repr(m['name']) for m in listing)}", "not_found_error", "model", "model_not_found")
    return JSONResponse(_model_card(request, found[0]))


async def chat_completions(request: Request) -> Response:
    return await generate(request, R.CHAT)


async def completions(request: Request) -> Response:
    return await generate(request, R.COMPLETION)


async def metrics(request: Request) -> Response:
    reply = await request.app.state.link.call("stats")
    return Response(request.app.state.metrics.render(reply), media_type=CONTENT_TYPE)


async def openapi_json(request: Request) -> Response:
    state = request.app.state
    if state.openapi is None:  # made on first use: the models' schemas take a moment to generate
        state.openapi = openapi.document(keyed=state.keyed, ollama=state.ollama)
    return JSONResponse(state.openapi)


# -- errors ------------------------------------------------------------------------------------------
async def _api_error(request: Request, e: ApiError) -> Response:
    return error_response(e, request.url.path)


def allowed_methods(app, scope) -> list[str]:
    """Every method some route of this path takes: one path may be several routes (GET and DELETE of
    /v1/responses/{id}), each of which knows only its own."""
    methods: set[str] = set()
    for route in app.routes:
        if route.matches(scope)[0] is not Match.NONE and route.methods:
            methods |= set(route.methods)
    return sorted(methods)


async def _http_error(request: Request, e: HTTPException) -> Response:
    type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    response = error_response(ApiError(e.status_code, str(e.detail), type_, code=str(e.status_code)),
                              request.url.path)
    if e.status_code == 405:  # RFC 9110 §15.5.6: a 405 names the methods the resource takes
        response.headers["Allow"] = ", ".join(allowed_methods(request.app, request.scope))
    return response


async def _client_gone(request: Request, e: ClientGone) -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def _internal(request: Request, e: Exception) -> Response:
    message = internal_error(log, f"internal error on {request.method} {request.url.path}", e)
    return error_response(ApiError(500, message, "server_error", code="internal"), request.url.path)


def build_app(settings: GatewaySettings, link: DaemonLink | None = None, gateway_cpu=time.process_time,
              ollama_api: bool = False) -> Starlette:
    """The app; `link` reaches the daemon (default: found as every client finds it). ollama_api: the
    `--ollama` listener's, Ollama's /api routes beside the OpenAI ones (Ollama serves both)."""
    link = link or DaemonLink()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            await link.connect()
        except ApiError as e:  # serve anyway: requests get 503 until the daemon is there
            log.warning("%s", e.message)
        yield
        await link.close()

    routes = [Route("/health", health), Route("/v1/models", models), Route("/v1/models/{model:path}", model),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]), Route("/metrics", metrics),
              Route("/v1/embeddings", embeddings, methods=["POST"]),
              Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
              Route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"]),
              Route("/v1/responses", responses_api.create, methods=["POST"]),
              Route("/v1/responses/{response_id}", responses_api.retrieve, methods=["GET"]),
              Route("/v1/responses/{response_id}", responses_api.delete, methods=["DELETE"]),
              Route("/openapi.json", openapi_json)]
    routes += [Route(path, handler, methods=["POST"]) for path, handler in RERANK_ROUTES]
    if ollama_api:
        from .ollama_routes import ROUTES
        routes += ROUTES
    metrics_ = Metrics(gateway_cpu)
    middleware = [Middleware(Door, hosts=HostRule.of(settings.host, settings.allowed_hosts),
                             origins=settings.cors_allow_origins, metrics=metrics_, routes={r.path for r in routes}),
                  Middleware(Guard, api_keys=settings.api_keys)]
    if settings.cors_allow_origins:  # outside the key check: a browser's preflight carries no key
        middleware.insert(1, Middleware(CORSMiddleware, allow_origins=list(settings.cors_allow_origins),
                                        allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error, ClientGone: _client_gone,
                                        Exception: _internal})
    app.state.link, app.state.metrics, app.state.started = link, metrics_, int(time.time())
    app.state.responses = responses_api.ResponseStore(settings.responses_ttl)
    app.state.openapi, app.state.keyed, app.state.ollama = None, settings.api_key is not None, ollama_api
    app.state.settings = settings  # /api/pull reads allow_pull and models_dir (ollama_routes.py)
    return app
