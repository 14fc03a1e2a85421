"""Who shares prefix blocks (docs/protocol.md §3.2.2).

A cached prefix is served only to a request with the same engine salt, and a hit
is visibly faster than a miss: anyone who shares a prefix cache can tell whether
someone else sent a given prompt. So with `prefix_sharing = "user"` (the default)
the engine salt joins who sent the request, its identity, to the cache_salt it
gave; with "all" only the cache_salt separates requests.

An identity is what the transport proves, never what the client says:
- ipc: the peer's uid, from SO_PEERCRED (libzmq puts `:uid:gid:pid` at the end
  of the frame property Peer-Address). On the user daemon every peer is the one
  user, who shares with itself; on the system daemon each local user is apart.
- TCP with CURVE: the client's public key (the ZAP handler's User-Id).
- TCP without CURVE: one identity, "tcp", for every such peer: none is known.
The HTTP gateway is an ipc peer as the user it runs as, so it keeps its clients
apart itself, in the cache_salt it sends (http_salt): every HTTP request's salt is
marked as HTTP's, so none meets that user's own socket requests; a gateway that
requires its one API key cannot tell its holders apart, so there a request shares
only with the same key and a cache_salt it gave (a secret of its sender's), and
without one with nobody. A client's cache_salt can only split its sharing further:
it is combined with the identity, never put in its place."""
from __future__ import annotations

import hashlib
import json
import logging
import secrets

import zmq

log = logging.getLogger("ridge.daemon")

SHARING = ("user", "all")
UNKNOWN_IPC = "ipc"  # a platform without SO_PEERCRED: every ipc peer is one identity


def uid_of(peer_address: str) -> int | None:
    """The uid in an ipc Peer-Address (`host:uid:gid:pid`), or None."""
    parts = peer_address.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[1])


def _prop(frame: zmq.Frame, name: str) -> str | None:
    try:
        return frame.get(name)
    except zmq.ZMQError:  # not set on this connection (EINVAL)
        return None


def peer_identity(frame: zmq.Frame, ipc: bool) -> str:
    """The identity of the peer that sent frame, from what its connection proves."""
    if ipc:
        uid = uid_of(_prop(frame, "Peer-Address") or "")
        if uid is None:
            _warn_once("no peer credentials on the ipc socket: its peers share one prefix cache")
            return UNKNOWN_IPC
        return uid_identity(uid)
    key = _prop(frame, "User-Id")
    return f"curve:{key}" if key else "tcp"


def uid_identity(uid: int) -> str:
    return f"uid:{uid}"


_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        log.warning("%s", text)


def engine_salt(identity: str | None, cache_salt: str | None, sharing: str) -> str:
    """The salt the engine starts a request's block chain from; "" when nothing separates it."""
    who = identity if sharing == "user" else None
    if who is None and not cache_salt:
        return ""
    return json.dumps([who, cache_salt or ""])


def http_salt(salt: str | None, authorization: str | None, sharing: str | None, keyed: bool) -> str | None:
    """The cache_salt the gateway sends for an HTTP request with the body's `salt` and the
    `Authorization` it carried. keyed: the gateway requires its API key, so every client carries
    the same one and a key proves only that it is held. Under "user" sharing an HTTP request never
    shares with the gateway user's own socket requests (they send no salt, or one of their own, and
    no "http:" salt can be named without sending it), shares with another HTTP request only when
    both gave the same Authorization and, on a keyed gateway, the same cache_salt too; a keyed
    request without a cache_salt shares with nobody."""
    if sharing != "user":
        return salt or None
    if keyed and not salt:
        return "http-once:" + secrets.token_hex(16)
    return "http:" + hashlib.sha256(json.dumps([authorization, salt]).encode()).hexdigest()
