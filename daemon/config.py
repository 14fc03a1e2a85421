"""`ridge serve` configuration: flags, then RIDGE_* environment variables,
then $XDG_CONFIG_HOME/ridge/config.toml, then defaults; the first that sets
a key wins. Every key has all three spellings: `--max-queue`, RIDGE_MAX_QUEUE,
`max_queue = 1024`."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


@dataclass
class Option:
    name: str  # the config-file key; the flag is --name-with-dashes, the variable RIDGE_NAME
    kind: type  # str, int, float or bool
    default: object
    help: str
    choices: tuple | None = None
    engine: bool = False  # passed to EngineConfig through ridge.cli.engine_config

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "RIDGE_" + self.name.upper()


DAEMON_OPTIONS = [
    Option("endpoint", str, None, "ROUTER endpoint (default: the user socket, or the system one with --system)"),
    Option("system", bool, False, "serve on the system socket /run/ridge/ridge.sock (dir 0750, group ridge)"),
    Option("tcp", str, None, "also listen on tcp://HOST:PORT; loopback only unless CURVE keys are configured"),
    Option("pub_endpoint", str, None, "stats PUB endpoint (default: beside the socket; 'none' disables)"),
    Option("curve_secret_key_file", str, None, "the daemon's CURVE certificate (.key_secret), for non-loopback TCP"),
    Option("curve_clients_dir", str, None, "directory of authorised client CURVE certificates"),
    Option("max_frame_bytes", int, 1 << 20, "largest client frame"),
    Option("max_prompt_tokens", int, 0, "longest prompt (0: the context length - 1)"),
    Option("max_tokens", int, 0, "largest max_tokens a request may ask (0: the context length)"),
    Option("max_requests_per_client", int, 256, "requests in flight per client connection"),
    Option("max_queue", int, 1024, "requests in flight in the daemon; past it, 'busy'"),
    Option("heartbeat_interval", float, 1.0, "seconds between heartbeats to clients with requests in flight"),
    Option("client_timeout", float, 10.0, "abort a client's requests after this much silence or a full queue"),
    Option("drain_grace", float, 30.0, "seconds in-flight requests get to finish on SIGTERM/SIGINT"),
    Option("stats_interval", float, 0.25, "seconds between stats snapshots (the PUB feed)"),
]
def engine_options() -> list[Option]:
    """The engine's options exactly as ridge.cli.add_engine_args defines them (whatever it grows)."""
    from ridge.cli import add_engine_args

    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    out = []
    for a in p._actions:
        if a.option_strings:
            kind = bool if isinstance(a, argparse._StoreTrueAction) else (a.type or str)
            out.append(Option(a.dest, kind, a.default, a.help or "", tuple(a.choices) if a.choices else None,
                              engine=True))
    return out


def all_options() -> list[Option]:
    return engine_options() + DAEMON_OPTIONS


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every option as a flag whose default is None, so that 'not given' can fall through."""
    from ridge.cli import add_engine_args

    add_engine_args(p)
    p.set_defaults(**{o.name: None for o in engine_options()})
    g = p.add_argument_group("daemon")
    for o in DAEMON_OPTIONS:
        if o.kind is bool:
            g.add_argument(o.flag, action="store_true", default=None, help=o.help)
        else:
            g.add_argument(o.flag, type=o.kind, default=None, help=f"{o.help} (default: {o.default})")
    p.add_argument("--config", default=None, help="config file (default: $XDG_CONFIG_HOME/ridge/config.toml)")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")


def config_path(args, environ=os.environ) -> Path:
    if getattr(args, "config", None):
        return Path(args.config)
    if environ.get("RIDGE_CONFIG"):
        return Path(environ["RIDGE_CONFIG"])
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "ridge" / "config.toml"


def _convert(o: Option, raw, where: str):
    if raw is None:
        return None
    try:
        if o.kind is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in _TRUE | _FALSE:
                return s in _TRUE
            raise ValueError(raw)
        if o.kind is int and isinstance(raw, (bool, float)):
            raise ValueError(raw)
        value = o.kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {o.name} must be {o.kind.__name__}, got {raw!r}") from None
    if o.choices and value not in o.choices:
        raise ValueError(f"{where}: {o.name} must be one of {', '.join(map(str, o.choices))}, got {value!r}")
    return value


@dataclass
class Resolved:
    values: dict
    sources: dict  # name -> "flag" | "env RIDGE_X" | "file PATH" | "default"
    path: Path

    def namespace(self) -> argparse.Namespace:
        return argparse.Namespace(**self.values)

    def to_toml(self) -> str:
        lines = [f"# effective ridge serve configuration (file: {self.path})"]
        for name, value in self.values.items():
            src = self.sources[name]
            if value is None:
                lines.append(f"# {name} is unset  # {src}")
            else:
                lines.append(f"{name} = {_toml_value(value)}  # {src}")
        return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if v is None:
        return '""'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def resolve(args: argparse.Namespace, environ=os.environ) -> Resolved:
    path = config_path(args, environ)
    file_values: dict = {}
    if path.is_file():
        try:
            file_values = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
    options = all_options()
    unknown = set(file_values) - {o.name for o in options}
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    values, sources = {}, {}
    for o in options:
        flag = getattr(args, o.name, None)
        if flag is not None:
            values[o.name], sources[o.name] = _convert(o, flag, o.flag), "flag"
        elif environ.get(o.env) is not None:
            values[o.name], sources[o.name] = _convert(o, environ[o.env], o.env), f"env {o.env}"
        elif o.name in file_values:
            values[o.name], sources[o.name] = _convert(o, file_values[o.name], str(path)), f"file {path}"
        else:
            values[o.name], sources[o.name] = o.default, "default"
    return Resolved(values, sources, path)
