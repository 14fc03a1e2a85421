"""Who the gateway answers (docs/service.md, "Who can reach what"). Every web
page on the machine can send requests to a loopback port; these rules keep
pages from using the answers.

- Host: a page that rebinds its own name to 127.0.0.1 (DNS rebinding) sends
  its own name as the Host, so only names that cannot be rebound are
  answered: `localhost`, loopback addresses, the address the gateway listens
  on (every address of the machine when that is 0.0.0.0 or ::) and the
  configured `allowed_hosts`. An address, unlike a name, cannot be rebound.
- Origin: a browser names the page that sent a request. Only the gateway's
  own origin (`http://` + an allowed Host) and `cors_allow_origins` are
  answered; the Host rule comes first, since a rebound page's origin looks
  like the gateway's own.
- Content-Type: a page may POST `text/plain`, a form or no declared type
  across sites without a CORS preflight, but a browser names the page in an
  Origin on every POST. So a POST that carries an Origin (an allowed one: the
  others are refused whatever they send) must declare application/json; one
  without an Origin is a program's, and its body is read as JSON whether it
  declares JSON, nothing, or the form type `curl -d` sends (as Ollama reads
  it). Another declared type says the body is something else: refused.

The rules only; app.py applies them to requests."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

WILDCARD_BINDS = ("0.0.0.0", "::")


def host_name(header: str) -> str:
    """A Host header -> its name or address, lower case, without port, brackets or a final dot."""
    value = header.strip().lower()
    if value.startswith("["):  # [v6]:port
        value = value[1:value.find("]")] if "]" in value else value
    elif value.count(":") == 1:
        value = value.rsplit(":", 1)[0]
    return value.rstrip(".")


def _address(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


@dataclass(frozen=True)
class HostRule:
    names: frozenset[str]  # exact names and addresses
    suffixes: tuple[str, ...]  # ".example.com" for "*.example.com"
    any_address: bool  # listening on every address: each of the machine's addresses is the gateway's own
    any_host: bool  # "*": the check is off (a reverse proxy in front checks the Host)

    @classmethod
    def of(cls, bound: str, allowed: tuple[str, ...] = ()) -> HostRule:
        listed = {host_name(h) for h in allowed if not h.startswith("*")}
        suffixes = tuple(h[1:].lower() for h in allowed if h.startswith("*."))
        return cls(frozenset({"localhost", host_name(bound)} | listed), suffixes, bound in WILDCARD_BINDS,
                   "*" in allowed)

    def allows(self, header: str) -> bool:
        name = host_name(header)
        if not name:
            return False
        if self.any_host or name in self.names or name.endswith(self.suffixes):
            return True
        address = _address(name)
        return address is not None and (address.is_loopback or self.any_address or str(address) in self.names)


def origin_allowed(origin: str, host: str, cors: tuple[str, ...]) -> bool:
    """An Origin header, on a request whose Host the HostRule allowed, against cors_allow_origins."""
    if "*" in cors or origin in cors:
        return True
    return origin.lower() == f"http://{host.strip().lower()}"  # the gateway's own origin: it speaks plain HTTP


def _media(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_json(content_type: str | None) -> bool:
    """application/json, with or without parameters (`; charset=utf-8`)."""
    return _media(content_type) == "application/json"


FORM = "application/x-www-form-urlencoded"


def body_admitted(content_type: str | None, has_origin: bool) -> bool:
    """Whether a POST body is read as JSON: declared JSON always; undeclared or declared a form (curl
    -d, litellm, Ollama's clients) only from a program, which sends no Origin."""
    if is_json(content_type):
        return True
    return not has_origin and (content_type is None or _media(content_type) in ("", FORM))
