"""Where the daemon listens and who may connect (docs/protocol.md §1):
socket directories and their modes, one daemon per endpoint, TCP rules, CURVE."""
from __future__ import annotations

import errno
import fcntl
import grp
import ipaddress
import logging
import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ridge.daemon")

SOCKET_NAME = "ridge.sock"
SYSTEM_DIR = Path("/run/ridge")
SYSTEM_GROUP = "ridge"
USER_MODE, SYSTEM_MODE = 0o700, 0o750
ZAP_DOMAIN = "ridge"


class EndpointError(RuntimeError):
    """The daemon cannot (or must not) listen where it was asked to."""


# -- where -------------------------------------------------------------------------
def user_dir(environ=os.environ) -> Path:
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "ridge"
    run_user = Path(f"/run/user/{os.getuid()}")
    if run_user.is_dir():
        return run_user / "ridge"
    return Path(environ.get("TMPDIR") or tempfile.gettempdir()) / f"ridge-{os.getuid()}"


def user_endpoint(environ=os.environ) -> str:
    return f"ipc://{user_dir(environ) / SOCKET_NAME}"


def system_endpoint() -> str:
    return f"ipc://{SYSTEM_DIR / SOCKET_NAME}"


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def pub_endpoint_for(endpoint: str) -> str | None:
    path = ipc_path(endpoint)
    if path is None:
        return None
    return f"ipc://{path.with_name(path.stem + '-pub' + (path.suffix or '.sock'))}"


def client_candidates(environ=os.environ) -> list[str]:
    """RIDGE_ENDPOINT alone if set; else the user socket, then the system socket."""
    if environ.get("RIDGE_ENDPOINT"):
        return [environ["RIDGE_ENDPOINT"]]
    return [user_endpoint(environ), system_endpoint()]


def find_daemon(environ=os.environ) -> tuple[str | None, list[str]]:
    """-> (the first candidate endpoint with a live daemon behind it, or None; notes on the others).
    A tcp endpoint is taken as given."""
    notes = []
    for ep in client_candidates(environ):
        path = ipc_path(ep)
        state = "alive" if path is None else probe(path)
        if state == "alive":
            return ep, notes
        notes.append(f"{ep}: {state}")
    return None, notes


# -- liveness of a socket file ------------------------------------------------------
def probe(path: Path) -> str:
    """'alive' (something accepts connections on the unix socket at `path`), 'no socket',
    'permission denied' or 'stale'."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return "alive"
    except FileNotFoundError:
        return "no socket"
    except PermissionError:
        return "permission denied"
    except OSError:
        return "stale"
    finally:
        s.close()


def socket_alive(path: Path) -> bool:
    return probe(path) == "alive"


# -- the directory ------------------------------------------------------------------
def prepare_dir(path: Path, mode: int, group: str | None = None) -> None:
    """Create the socket directory `path` with `mode`, or put an existing one right. The rule holds
    for every ipc endpoint, the default ones and an explicit --endpoint alike (docs/protocol.md §1):
    a directory another user owns is refused (they could replace the socket, or read the lock),
    and the mode is set to `mode`, so that the directory alone decides who may connect."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise EndpointError(f"{path} belongs to uid {st.st_uid}, not to this user; refusing to listen there "
                            "(give the socket a directory of its own)")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
    if group:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            log.warning("group %r does not exist; %s keeps group %d", group, path, st.st_gid)
        except PermissionError:
            log.warning("cannot give %s to group %r", path, group)


# -- one daemon per endpoint ----------------------------------------------------------
class EndpointLock:
    """An flock on `<socket>.lock`, held for the daemon's life. The kernel drops it when the
    process dies, however it dies, so a leftover socket file is never mistaken for a daemon."""

    def __init__(self, socket_path: Path):
        self.socket_path = socket_path
        self.path = socket_path.with_name(socket_path.name + ".lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise EndpointError(f"a ridge daemon (pid {pid}) is already serving ipc://{self.socket_path}; "
                                    "stop it first, or choose another --endpoint") from None
            raise
        if socket_alive(self.socket_path):  # live, but not holding our lock: not ours to replace
            os.close(fd)
            raise EndpointError(f"something is already listening on ipc://{self.socket_path}; refusing to "
                                "replace it (choose another --endpoint)")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        for stale in (self.socket_path, ):
            if stale.exists() or stale.is_symlink():
                log.info("replacing stale socket %s", stale)
                stale.unlink()

    def release(self) -> None:
        if self.fd is not None:
            for p in (self.socket_path,):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
            os.close(self.fd)
            self.fd = None


# -- TCP and CURVE ----------------------------------------------------------------------
@dataclass
class CurveConfig:
    public_key: bytes
    secret_key: bytes
    clients_dir: Path


def tcp_host(endpoint: str) -> str:
    if not endpoint.startswith("tcp://"):
        raise EndpointError(f"--tcp takes tcp://HOST:PORT, got {endpoint!r}")
    rest = endpoint[len("tcp://"):]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    if ";" in host:  # tcp://source;dest form: the bind side is the part after ';'
        host = host.split(";")[-1]
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_curve(secret_key_file: str | None, clients_dir: str | None) -> CurveConfig | None:
    if not secret_key_file and not clients_dir:
        return None
    if not (secret_key_file and clients_dir):
        raise EndpointError("CURVE needs both curve_secret_key_file and curve_clients_dir")
    import zmq
    import zmq.auth

    if not zmq.has("curve"):
        raise EndpointError("this libzmq was built without CURVE")
    if not Path(clients_dir).is_dir():
        raise EndpointError(f"curve_clients_dir {clients_dir} is not a directory")
    try:
        public, secret = zmq.auth.load_certificate(secret_key_file)
    except (OSError, ValueError) as e:
        raise EndpointError(f"cannot read the CURVE key file {secret_key_file}: {e}") from None
    if not secret:
        raise EndpointError(f"{secret_key_file} holds no secret key (give the .key_secret file)")
    return CurveConfig(public, secret, Path(clients_dir))


def check_tcp(endpoint: str, curve: CurveConfig | None, system: bool = False) -> None:
    """Non-loopback TCP needs CURVE; so does loopback on the system daemon, where any local user
    could connect to the port past the group check on its socket's directory."""
    host = tcp_host(endpoint)
    if curve is not None:
        return
    if not is_loopback(host):
        raise EndpointError(f"refusing to bind {endpoint}: {host} is not a loopback address, and non-loopback "
                            "TCP needs CURVE keys (curve_secret_key_file and curve_clients_dir in the config file)")
    if system:
        raise EndpointError(f"refusing to bind {endpoint} for the system daemon without CURVE: any local user can "
                            f"connect to a loopback port, past the group check on {SYSTEM_DIR} (set "
                            "curve_secret_key_file and curve_clients_dir in the config file)")


def check_pub(endpoint: str, system: bool = False) -> None:
    """The stats feed has no CURVE: on TCP it stays on loopback, and off the system daemon."""
    if not endpoint.startswith("tcp://"):
        return
    if system:
        raise EndpointError(f"refusing to publish stats on {endpoint} for the system daemon: the feed has no "
                            f"CURVE, and any local user can reach a loopback port (leave pub_endpoint unset: the "
                            f"feed stays beside the socket in {SYSTEM_DIR})")
    check_tcp(endpoint, None)


def secure_curve_socket(ctx, sock, curve: CurveConfig):
    """CURVE server on `sock`, with a ZAP handler that admits the certificates in clients_dir.
    -> the authenticator, which must live as long as the socket."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain=ZAP_DOMAIN, location=str(curve.clients_dir))
    sock.curve_secretkey = curve.secret_key
    sock.curve_publickey = curve.public_key
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    return auth
