"""The gateway's options, declared once (flags, RIDGE_* variables, config.toml
keys: ridge/options.py), and the rules for where it may listen: loopback by
default, any other address only with an API key, and in front of the system
daemon only with an API key (loopback is open to every local user, and the
system socket is not: docs/service.md, "Who can reach what")."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ridge.options import Option

from ..protocol import MAX_IMAGE_FRAME_BYTES
from ..transport.endpoint import EndpointError, is_loopback

DEFAULT_HTTP = "127.0.0.1:8000"
OLLAMA_HTTP = "127.0.0.1:11434"  # Ollama's own port: its clients look there first

RESPONSES_TTL = Option("responses_ttl", float, 3600.0, "seconds a /v1/responses answer is kept in the gateway's "
                       "memory for previous_response_id and GET (0: none kept)")
MAX_CONNECTIONS = Option("http_max_connections", int, 0, "HTTP connections open at once, over both listeners (0: "
                         "from the open-file limit, keeping room for the daemon's sockets and files; at most "
                         "1024); past it the longest-idle connection is closed, or a new one gets 503")
HEADER_TIMEOUT = Option("http_header_timeout", float, 10.0, "seconds an HTTP connection has to send a request's "
                        "headers, from its connect or the first byte of its next request; then it is closed")
BODY_TIMEOUT = Option("http_body_timeout", float, 30.0, "seconds an HTTP request has to send its body once its "
                      "headers are in; then it is closed")
FETCH_TIMEOUT_S = 10.0
ALLOW_IMAGE_URLS = Option("allow_image_urls", bool, False, "fetch the http(s) image URLs clients send in image "
                          f"parts, each at most {MAX_IMAGE_FRAME_BYTES >> 20} MiB within {FETCH_TIMEOUT_S:g} s "
                          "(off: such a part is a 400 and clients send images inline as data: URLs or base64; "
                          "on: the gateway reaches any address its clients name, the operator's network too)")
ALLOW_PULL = Option("allow_pull", bool, False, "let the Ollama listener's clients download models from the Hugging "
                    "Face Hub into models_dir (/api/pull); off: 403")
GATEWAY_OPTIONS = [
    Option("http", str, None, f"serve the OpenAI-compatible HTTP API on HOST:PORT (`ridge gateway`: default "
           f"{DEFAULT_HTTP}); a non-loopback HOST needs an API key", example=DEFAULT_HTTP),
    Option("api_key", str, None, "require `Authorization: Bearer KEY` on /v1 and /metrics (prefer "
           "RIDGE_API_KEY or api_key_file to a flag, which other users can see)", example="change-me"),
    Option("api_key_file", str, None, "read the API keys from this file, one a line (# comments and blank lines "
           "skipped); each key holder has its own requests-in-flight budget and cached prefixes",
           example="/etc/ridge/api_key"),
    Option("cors_allow_origins", list, None, "origins allowed to call the API from a browser, besides the "
           "gateway's own (CORS is off unless set; * allows any); other origins get 403",
           example=("http://localhost:3000",)),
    Option("allowed_hosts", list, None, "Host names the API answers for, besides localhost, the loopback "
           "addresses and the address it listens on (*.example.com: any name under it; *: any); "
           "other Hosts get 421", example=("ridge.lan",)),
    RESPONSES_TTL, MAX_CONNECTIONS, HEADER_TIMEOUT, BODY_TIMEOUT,
    ALLOW_PULL, ALLOW_IMAGE_URLS,
    Option("ollama", str, None, "serve Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags, ...; and "
           "the OpenAI routes, as Ollama does) on HOST:PORT, its own listener with the same rules as --http",
           example=OLLAMA_HTTP),
]
_BY_NAME = {o.name: o for o in GATEWAY_OPTIONS}
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+")  # scheme://host[:port], as a browser's Origin header


@dataclass(frozen=True)
class GatewaySettings:
    host: str
    port: int
    api_key: str | None = None
    cors_allow_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    responses_ttl: float = RESPONSES_TTL.default
    more_keys: tuple[str, ...] = ()  # api_key_file's other lines: each its own principal (app.py)
    max_connections: int = MAX_CONNECTIONS.default
    header_timeout: float = HEADER_TIMEOUT.default
    body_timeout: float = BODY_TIMEOUT.default
    allow_pull: bool = ALLOW_PULL.default  # /api/pull on the Ollama listener (daemon/pull.py)
    models_dir: str | None = None  # where it puts them: the daemon's models_dir (None: its default)
    allow_image_urls: bool = ALLOW_IMAGE_URLS.default  # fetch http(s) image parts (images.py)

    @property
    def api_keys(self) -> tuple[str, ...]:
        return (self.api_key, *self.more_keys) if self.api_key else ()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def parse_address(addr: str) -> tuple[str, int]:
    """HOST:PORT, [V6]:PORT or :PORT (loopback) -> (host, port)."""
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise EndpointError(f"the HTTP address must be HOST:PORT, got {addr!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def _api_keys(values: dict) -> tuple[str, ...]:
    """The keys, the first one the key (api_key_file's first, or api_key): each a principal of its own."""
    key = values.get("api_key")
    path = values.get("api_key_file")
    if not path:
        return (key,) if key else ()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise EndpointError(f"cannot read api_key_file {path}: {e.strerror}") from None
    keys = tuple(dict.fromkeys(k for k in (line.strip() for line in lines) if k and not k.startswith("#")))
    if not keys:
        raise EndpointError(f"api_key_file {path} holds no key")
    return keys


def _listed(values: dict, name: str) -> tuple[str, ...]:
    return _BY_NAME[name].convert(values.get(name), name) or ()


def _origins(values: dict) -> tuple[str, ...]:
    origins = _listed(values, "cors_allow_origins")
    for o in origins:
        if o not in ("*", "null") and not _ORIGIN.fullmatch(o):
            raise EndpointError(f"cors_allow_origins: {o!r} is not an origin (scheme://host[:port], with no "
                                "path or trailing slash, as browsers send it)")
    return origins


def refuse_keyless_system(addr: str, key: str | None) -> None:
    """The system daemon's socket admits group `ridge` only; a keyless HTTP API in front of it
    would admit every local user (and, on loopback, every process on the machine)."""
    if key is None:
        raise EndpointError(f"refusing to serve HTTP on {addr} for the system daemon without an API key: any "
                            "local user can reach a loopback port, past the group check on /run/ridge (set "
                            "api_key_file, or RIDGE_API_KEY; `ridge service install --system --http` makes one)")


def gateway_settings(values: dict, default_http: str | None = DEFAULT_HTTP, system: bool = False,
                     key: str = "http") -> GatewaySettings | None:
    """Resolved option values -> settings, or None when no HTTP address is set (and no default).
    system: the gateway serves the system daemon. key: the option that holds the address (`ollama`:
    the Ollama listener, which shares the key, CORS and Host rules). Raises EndpointError for an
    address it must not serve on."""
    addr = values.get(key) or default_http
    if not addr:
        return None
    host, port = parse_address(addr)
    keys = _api_keys(values)
    api_key = keys[0] if keys else None
    if not is_loopback(host) and api_key is None:
        raise EndpointError(f"refusing to serve HTTP on {addr}: {host} is not a loopback address, and the API is "
                            "open to anyone who can reach it without an API key (set api_key_file, or "
                            "RIDGE_API_KEY)")
    if system:
        refuse_keyless_system(addr, api_key)
    ttl = RESPONSES_TTL.convert(values.get("responses_ttl"), "responses_ttl")
    given = {o.name: o.convert(values.get(o.name), o.name) for o in (MAX_CONNECTIONS, HEADER_TIMEOUT, BODY_TIMEOUT)}
    given = {name: _BY_NAME[name].default if v is None else v for name, v in given.items()}
    if given["http_max_connections"] < 0 or not (given["http_header_timeout"] > 0 and given["http_body_timeout"] > 0):
        raise EndpointError("http_max_connections must be >= 0 (0: from the open-file limit), and "
                            "http_header_timeout and http_body_timeout > 0")
    return GatewaySettings(host, port, api_key, _origins(values), _listed(values, "allowed_hosts"),
                           RESPONSES_TTL.default if ttl is None else ttl, keys[1:], given["http_max_connections"],
                           given["http_header_timeout"], given["http_body_timeout"],
                           bool(ALLOW_PULL.convert(values.get("allow_pull"), "allow_pull")),
                           values.get("models_dir"),
                           bool(ALLOW_IMAGE_URLS.convert(values.get("allow_image_urls"), "allow_image_urls")))

