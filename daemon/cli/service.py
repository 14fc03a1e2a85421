"""`ridge service install|uninstall|status|config`: the daemon as a systemd
service, from the templates in packaging/ with this installation's paths
filled in. Where systemd is absent it writes what it can and says what to run
on a machine that has it; it never needs systemd to succeed."""
from __future__ import annotations

import argparse
import grp
import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .config import default_config, resolve

UNIT = "ridge.service"
SYSTEM_USER = "ridge"
GPU_GROUPS = ("video", "render")  # device node groups on most distributions; only those that exist are used
REPO = Path(__file__).resolve().parents[2]  # daemon/cli/service.py -> the source checkout
PACKAGING = REPO / "packaging"
DOCS = REPO / "docs" / "service.md"
STOP_MARGIN_S = 15  # TimeoutStopSec = drain_grace + this: the drain, then the final frames and exit
SYSTEM_API_KEY = Path("etc/ridge/api_key")  # made by `install --system --http` when the config names no key


@dataclass(frozen=True)
class Scope:
    system: bool
    root: Path  # "/" normally; a staging directory with --root

    @property
    def name(self) -> str:
        return "system" if self.system else "user"

    @property
    def unit_path(self) -> Path:
        if self.system:
            return self.root / "etc/systemd/system" / UNIT
        return _config_home(self.root) / "systemd/user" / UNIT

    @property
    def config_path(self) -> Path:
        return self.root / "etc/ridge/config.toml" if self.system else _config_home(self.root) / "ridge/config.toml"

    @property
    def sysusers_path(self) -> Path:
        return self.root / "etc/sysusers.d/ridge.conf"

    @property
    def staged(self) -> bool:
        return self.root != Path("/")

    def target(self, path: Path) -> Path:
        """Where a written file will be on the machine the service runs on."""
        return Path("/") / path.relative_to(self.root)

    def systemctl(self, *args: str) -> list[str]:
        return ["systemctl", *([] if self.system else ["--user"]), *args]


def _config_home(root: Path) -> Path:
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return root / base.relative_to("/") if base.is_absolute() else root / base


# -- the effective values ------------------------------------------------------------
def ridge_executable() -> Path:
    """The `ridge` script of the environment this runs in (a venv's bin/ridge), unresolved, so
    the unit keeps following the venv rather than the interpreter it links to."""
    beside = Path(sys.executable).parent / "ridge"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside.absolute()
    found = shutil.which("ridge")
    if found:
        return Path(found).absolute()
    raise FileNotFoundError(f"no `ridge` executable beside {sys.executable} or on PATH; install ridge first "
                            "(make setup, or pip install -e .)")


def _unit_word(text: str) -> str:
    """One word for a unit file: % and $ escaped, quoted when it has spaces."""
    text = text.replace("%", "%%").replace("$", "$$")
    return f'"{text}"' if any(c.isspace() for c in text) else text


def drain_grace(config_file: Path) -> float:
    return float(resolve(argparse.Namespace(config=str(config_file)), environ={}).values["drain_grace"])


def exec_start(scope: Scope, http: str | None = None, key_file: Path | None = None) -> str:
    words = [_unit_word(str(ridge_executable())), "serve"] + (["--system"] if scope.system else [])
    words += ["--http", _unit_word(http)] if http else []
    return " ".join(words + (["--api-key-file", _unit_word(str(scope.target(key_file)))] if key_file else []))


def _config_values(scope: Scope) -> dict:
    return resolve(argparse.Namespace(config=str(scope.config_path)), environ={}).values


def check_http(scope: Scope, http: str, key: str | None = None) -> str | None:
    """Why the daemon would refuse to serve HTTP on `http` with this scope's config file (and `key`,
    the one this install makes), or None."""
    from ..transport.endpoint import EndpointError
    from ..gateway.settings import gateway_settings

    vals = _config_values(scope)
    try:
        gateway_settings({**vals, "http": http, **({"api_key": key} if key else {})}, None, system=scope.system)
    except EndpointError as e:
        return str(e)
    return None


def system_http_key(scope: Scope) -> tuple[Path, str] | None:
    """The system daemon's HTTP API needs a key even on loopback (docs/service.md). Unless the config
    file names one: (the key file the unit will pass, its key: the file's if it exists, else new)."""
    vals = _config_values(scope)
    if vals["api_key"] or vals["api_key_file"]:
        return None
    path = scope.root / SYSTEM_API_KEY
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    return path, (lines[0].strip() if lines and lines[0].strip() else secrets.token_urlsafe(32))


def _write_key(scope: Scope, path: Path, key: str) -> None:
    """0640, root:ridge: the members of group `ridge` may use the HTTP API as they may use the socket.
    Written while 0600, so that no one else can read it even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(key + "\n")
    try:
        os.chown(path, 0 if os.geteuid() == 0 else -1, grp.getgrnam(SYSTEM_USER).gr_gid)
    except (KeyError, PermissionError):
        print(f"give {scope.target(path)} to group {SYSTEM_USER} on the machine it runs on: "
              f"chown root:{SYSTEM_USER} {scope.target(path)}")
    path.chmod(0o640)
    print(f"wrote {path} (0640, group {SYSTEM_USER}): HTTP clients send `Authorization: Bearer KEY` with its line")


def values(scope: Scope, http: str | None = None, key_file: Path | None = None) -> dict[str, str]:
    groups = []
    for g in GPU_GROUPS:
        try:
            grp.getgrnam(g)
            groups.append(g)
        except KeyError:
            pass
    grace = drain_grace(scope.config_path)
    return {"EXEC_START": exec_start(scope, http, key_file),
            "CONFIG_ENV": _unit_word(f"RIDGE_CONFIG={scope.target(scope.config_path)}"),
            "TIMEOUT_STOP": f"{int(grace + STOP_MARGIN_S)}s",
            "GROUPS": " ".join(groups),
            "DOCS": DOCS.as_uri() if DOCS.is_file() else ""}


def render(template: str, vals: dict[str, str]) -> str:
    """Fill @KEY@ placeholders; a setting whose value comes out empty is left out."""
    out = []
    for line in template.splitlines():
        keys = [k for k in vals if f"@{k}@" in line]
        if any(not vals[k] for k in keys):
            continue
        for k in keys:
            line = line.replace(f"@{k}@", vals[k])
        if not line.lstrip().startswith("#") and re.search(r"@[A-Z_]+@", line):
            raise ValueError(f"unfilled placeholder in {line!r}")
        out.append(line)
    return "\n".join(out) + "\n"


def template(scope: Scope) -> str:
    path = PACKAGING / f"ridge-{scope.name}.service.in"
    if not path.is_file():
        raise FileNotFoundError(f"the unit template {path} is missing: `ridge service` needs a source checkout "
                                "of ridge (packaging/ is not part of the wheel)")
    return path.read_text()


# -- systemd --------------------------------------------------------------------------------
def systemd_missing() -> str | None:
    """Why systemctl cannot be used here, or None."""
    if shutil.which("systemctl") is None:
        return "systemctl is not installed on this machine"
    if not Path("/run/systemd/system").is_dir():  # sd_booted(3)
        return "systemd is not running on this machine (it is not PID 1: a container, or another init)"
    return None


def _run(cmd: list[str]) -> int:
    print("$ " + " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True)
    for text in (r.stdout, r.stderr):
        if text.strip():
            print(text.rstrip())
    return r.returncode


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    print(f"wrote {path}")


def _ensure_user(scope: Scope) -> int:
    sysusers = (PACKAGING / "ridge.sysusers").read_text()
    _write(scope.sysusers_path, sysusers)
    if scope.staged:
        return 0
    try:
        pwd.getpwnam(SYSTEM_USER)
        return 0
    except KeyError:
        pass
    if shutil.which("systemd-sysusers"):
        return _run(["systemd-sysusers", str(scope.sysusers_path)])
    return _run(["useradd", "--system", "--user-group", "--home-dir", "/var/lib/ridge", "--no-create-home",
                 "--shell", "/usr/sbin/nologin", "--comment", "ridge LLM daemon", SYSTEM_USER])


# -- the subcommands --------------------------------------------------------------------------
def install(scope: Scope, enable: bool = True, http: str | None = None) -> int:
    if scope.system and not scope.staged and os.geteuid() != 0:
        print(f"ridge: the system service is installed as root: sudo {ridge_executable()} service install --system",
              file=sys.stderr)
        return 1
    key = system_http_key(scope) if http and scope.system else None
    if http and (why := check_http(scope, http, key and key[1])):
        print(f"ridge: {why}", file=sys.stderr)
        return 1
    if not scope.config_path.exists():
        _write(scope.config_path, default_config(), 0o640 if scope.system else 0o600)
    else:
        print(f"kept {scope.config_path}")
    _write(scope.unit_path, render(template(scope), values(scope, http, key and key[0])))
    if scope.system and _ensure_user(scope) != 0:
        return 1
    if key is not None:
        _write_key(scope, *key)
    manage = " ".join(scope.systemctl())
    then = [f"{manage} daemon-reload", f"{manage} enable --now {UNIT}"]
    if scope.staged:
        print(f"staged under {scope.root}; on the target machine: " + " && ".join(then))
        return 0
    why = systemd_missing()
    if why is not None:
        print(f"{why}, so the service was written but not enabled. On a machine with systemd:\n  "
              + "\n  ".join(then) + f"\nHere, run the daemon directly: {exec_start(scope, http, key and key[0])}")
        return 0
    if _run(scope.systemctl("daemon-reload")) != 0:
        return 1
    if enable and _run(scope.systemctl("enable", "--now", UNIT)) != 0:
        return 1
    if not scope.system:
        print("To keep the service running while you are logged out: loginctl enable-linger $USER")
    print(f"Logs: journalctl {'' if scope.system else '--user '}-u ridge -f")
    return 0


def uninstall(scope: Scope) -> int:
    if scope.system and not scope.staged and os.geteuid() != 0:
        print("ridge: the system service is removed as root: sudo ridge service uninstall --system", file=sys.stderr)
        return 1
    why = None if scope.staged else systemd_missing()
    if not scope.staged and why is None:
        _run(scope.systemctl("disable", "--now", UNIT))
    if scope.unit_path.exists():
        scope.unit_path.unlink()
        print(f"removed {scope.unit_path}")
    else:
        print(f"no unit at {scope.unit_path}")
    if not scope.staged and why is None:
        _run(scope.systemctl("daemon-reload"))
    elif why is not None:
        print(f"{why}: nothing to disable.")
    kept = [str(scope.config_path)] + (["the user `ridge`", "/var/lib/ridge", "/var/cache/ridge"] if scope.system
                                       else [])
    print("kept " + ", ".join(kept) + " (remove them by hand if you no longer want them)")
    return 0


def status(scope: Scope) -> int:
    from ..transport.endpoint import ipc_path, socket_alive, system_endpoint, user_endpoint

    unit = scope.unit_path
    if unit.exists():
        exec_start = next((line.split("=", 1)[1] for line in unit.read_text().splitlines()
                           if line.startswith("ExecStart=")), "?")
        print(f"{scope.name} unit: {unit}\n  ExecStart={exec_start}")
    else:
        print(f"{scope.name} unit: not installed ({unit} is absent); install it with: "
              f"ridge service install --{scope.name}")
    print(f"config: {scope.config_path}" + ("" if scope.config_path.exists() else " (absent: defaults apply)"))
    endpoint = system_endpoint() if scope.system else user_endpoint()
    listening = socket_alive(ipc_path(endpoint))
    print(f"daemon: {'listening' if listening else 'not listening'} on {endpoint}")
    if unit.exists() and (http := _unit_http(unit.read_text())):
        print(f"gateway: {'answering' if _http_alive(http) else 'not answering'} on http://{http}/v1")
    why = systemd_missing()
    if why is not None:
        print(f"systemd: {why}; no service state to show")
        return 0
    _run(scope.systemctl("status", "--no-pager", "--lines=5", UNIT))
    return 0


def _unit_http(unit_text: str) -> str | None:
    """The --http address on the unit's ExecStart line, if any."""
    m = re.search(r"^ExecStart=.* --http (\S+)", unit_text, re.MULTILINE)
    return m.group(1) if m else None


def _http_alive(addr: str) -> bool:
    import socket

    from ..gateway.settings import parse_address
    host, port = parse_address(addr)
    try:
        socket.create_connection(("127.0.0.1" if host in ("0.0.0.0", "::") else host, port), 1.0).close()
        return True
    except OSError:
        return False


def add_service_parser(sub) -> None:
    p = sub.add_parser("service", help="install, remove or inspect ridge as a systemd service",
                       description="The daemon as a systemd service (docs/service.md). The user service runs "
                                   "`ridge serve` on your socket; the system one runs `ridge serve --system` as "
                                   "the user `ridge`, reachable by members of group `ridge`.")
    acts = p.add_subparsers(dest="service_action", required=True)
    for name, text in (("install", "write the unit (and a default config) and enable it"),
                       ("uninstall", "disable and remove the unit (the config is kept)"),
                       ("status", "the unit, the socket and systemd's view of the service")):
        a = acts.add_parser(name, help=text)
        scope = a.add_mutually_exclusive_group()
        scope.add_argument("--user", dest="system", action="store_false", help="the user service (default)")
        scope.add_argument("--system", dest="system", action="store_true", help="the system service (as root)")
        if name != "status":
            a.add_argument("--root", type=Path, default=Path("/"), metavar="DIR",
                           help="write under DIR instead of / (staging for a package), without systemctl")
        if name == "install":
            a.add_argument("--no-enable", action="store_true", help="write the files but do not enable the service")
            a.add_argument("--http", metavar="HOST:PORT", default=None,
                           help="also serve the OpenAI-compatible HTTP API there (ridge serve --http); a "
                                "non-loopback HOST needs api_key_file in the config file; the system service "
                                "needs a key even on loopback and makes /etc/ridge/api_key when the config "
                                "names none")
    acts.add_parser("config", help="print the default config file (every option, commented out)")
    p.set_defaults(func=run_service)


def run_service(args) -> int:
    if args.service_action == "config":
        sys.stdout.write(default_config())
        return 0
    scope = Scope(bool(args.system), Path(getattr(args, "root", None) or "/").absolute())
    if args.service_action == "install":
        return install(scope, enable=not args.no_enable, http=args.http)
    if args.service_action == "uninstall":
        return uninstall(scope)
    return status(scope)
