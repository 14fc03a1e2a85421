"""`ridge serve` configuration: flags, then RIDGE_* environment variables,
then $XDG_CONFIG_HOME/ridge/config.toml, then defaults; the first that sets
a key wins. Every key has all three spellings: `--max-queue`, RIDGE_MAX_QUEUE,
`max_queue = 1024`."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from ridge.engine.config import add_engine_args, engine_options
from ridge.options import Option, add_options

from ..gateway.settings import GATEWAY_OPTIONS
from ..transport.sharing import SHARING

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


DAEMON_OPTIONS = [
    Option("endpoint", str, None, "ROUTER endpoint (default: the user socket, or the system one with --system)",
           example="ipc:///run/user/1000/ridge/ridge.sock"),
    Option("system", bool, False, "serve on the system socket /run/ridge/ridge.sock (dir 0750, group ridge)"),
    Option("tcp", str, None, "also listen on tcp://HOST:PORT; loopback only unless CURVE keys are configured",
           example="tcp://127.0.0.1:5555"),
    Option("pub_endpoint", str, None, "stats PUB endpoint (default: beside the socket; 'none' disables)",
           example="none"),
    Option("curve_secret_key_file", str, None, "the daemon's CURVE certificate (.key_secret), for non-loopback TCP",
           example="/etc/ridge/curve/server.key_secret"),
    Option("curve_clients_dir", str, None, "directory of authorised client CURVE certificates",
           example="/etc/ridge/curve/clients"),
    Option("served_model_name", str, None, "the model's name in hello and the HTTP API (default: the model "
           "file's name without .gguf and its quantization tag)", example="SmolLM2-135M-Instruct"),
    Option("max_frame_bytes", int, 1 << 20, "largest client frame"),
    Option("max_prompt_tokens", int, 0, "longest prompt (0: the context length - 1)"),
    Option("max_tokens", int, 0, "largest max_tokens a request may ask (0: the context length)"),
    Option("max_requests_per_client", int, 256, "requests in flight per client connection"),
    Option("max_queue", int, 1024, "requests in flight in the daemon; past it, 'busy'"),
    Option("heartbeat_interval", float, 1.0, "seconds between heartbeats to clients with requests in flight"),
    Option("client_timeout", float, 10.0, "abort a client's requests after this much silence or a full queue"),
    Option("drain_grace", float, 30.0, "seconds in-flight requests get to finish on SIGTERM/SIGINT"),
    Option("stats_interval", float, 0.25, "seconds between stats snapshots (the PUB feed)"),
    Option("models_dir", str, None, "directory of models served by name: GGUF files and HF directories (default: "
           "$XDG_DATA_HOME/ridge/models); config.toml's [models.NAME] tables name others", example="/srv/ridge/models"),
    Option("keep_alive", str, "5m", "how long a model loaded on request stays once idle (seconds or a duration such "
           "as 5m or 1h; 0: unload after each request; -1: never); a request's or [models.NAME]'s keep_alive wins"),
    Option("max_loaded_models", int, 3, "models loaded at once; past it the least recently used idle one unloads"),
    Option("max_loads_per_minute", int, 30, "model loads one user (uid, CURVE key) may start a minute; past it, "
           "too_many_requests"),
    Option("models_memory_gib", float, None, "memory the loaded models' weights and KV pools may hold together; "
           "past it the least recently used idle one unloads (default: the device's, less gpu_reserve_gib; on CPU "
           "three quarters of the free RAM at start)", example=20.0),
    Option("parked_gib", float, None, "host RAM for the converted weights of unloaded models, so that loading one "
           "again is a copy (default: a quarter of the free RAM at start; 0: off)", example=8.0),
    Option("prefix_sharing", str, "user", "who shares cached prompt prefixes: user keeps each local user, CURVE "
           "key and API key apart (a hit is faster than a miss: sharers can tell what others sent); all shares them",
           choices=SHARING),
]


def all_options() -> list[Option]:
    return engine_options() + DAEMON_OPTIONS + GATEWAY_OPTIONS


def defaults() -> dict:
    """Every option at its declared default: what resolve() gives when nothing sets a key."""
    return {o.name: o.default for o in all_options()}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every option as a flag whose default is None, so that 'not given' can fall through."""
    add_engine_args(p, given_only=True)
    add_options(p.add_argument_group("daemon"), DAEMON_OPTIONS, given_only=True)
    add_options(p.add_argument_group("HTTP gateway (OpenAI-compatible API, in the daemon's process)"),
                GATEWAY_OPTIONS, given_only=True)
    p.add_argument("--config", default=None, help="config file (default: $XDG_CONFIG_HOME/ridge/config.toml)")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")


def config_path(args, environ=os.environ) -> Path:
    if getattr(args, "config", None):
        return Path(args.config)
    if environ.get("RIDGE_CONFIG"):
        return Path(environ["RIDGE_CONFIG"])
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "ridge" / "config.toml"


@dataclass
class Resolved:
    values: dict
    sources: dict  # name -> "flag" | "env RIDGE_X" | "file PATH" | "default"
    path: Path
    models: dict = field(default_factory=dict)  # the file's [models.NAME] tables (daemon/frontend/registry.py)

    def namespace(self) -> argparse.Namespace:
        return argparse.Namespace(**self.values)

    def to_toml(self) -> str:
        lines = [f"# effective ridge serve configuration (file: {self.path})"]
        for o in all_options():
            value, src = self.values[o.name], self.sources[o.name]
            if value is None and not o.auto:
                lines.append(f"# {o.name} is unset  # {src}")
            else:
                lines.append(f"{o.name} = {o.toml(value)}  # {src}")
        return "\n".join(lines) + "\n"


def resolve(args: argparse.Namespace, environ=os.environ) -> Resolved:
    path = config_path(args, environ)
    file_values: dict = {}
    if path.is_file():
        try:
            file_values = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
    models = file_values.pop("models", {})  # named models, not options: daemon/frontend/registry.py reads them
    options = all_options()
    unknown = set(file_values) - {o.name for o in options}
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    values, sources = {}, {}
    for o in options:
        flag = getattr(args, o.name, None)
        if flag is not None:
            values[o.name], sources[o.name] = o.convert(flag, o.flag), "flag"
        elif environ.get(o.env) is not None:
            values[o.name], sources[o.name] = o.convert(environ[o.env], o.env), f"env {o.env}"
        elif o.name in file_values:
            values[o.name], sources[o.name] = o.convert(file_values[o.name], str(path)), f"file {path}"
        else:
            values[o.name], sources[o.name] = o.default, "default"
    return Resolved(values, sources, path, models)


def default_config() -> str:
    """Every `ridge serve` option, commented out, at its default (or its example where it has
    none). packaging/config.toml is this text; tests/test_service.py keeps the two equal."""
    lines = ["# ridge serve configuration. Every option is listed, commented out, at its default;",
             "# uncomment a line to change it. Precedence: command-line flags, then RIDGE_<NAME>",
             "# environment variables, then this file, then the defaults.",
             "# Read from $XDG_CONFIG_HOME/ridge/config.toml (user service), /etc/ridge/config.toml",
             "# (system service), or the file that --config / RIDGE_CONFIG names.",
             "# Check the result with: ridge serve --print-config", ""]
    for title, options in (("Engine", engine_options()), ("Daemon", DAEMON_OPTIONS),
                           ("Gateway: the OpenAI-compatible HTTP API", GATEWAY_OPTIONS)):
        lines += [f"# -- {title} " + "-" * (76 - len(title)), ""]
        for o in options:
            lines.append(f"# {o.help}" + (f" ({', '.join(map(str, o.choices))})" if o.choices else ""))
            if o.default is None and not o.auto:
                lines.append(f"# {o.name} = {o.toml(o.example)}  # unset by default; an example")
            else:
                lines.append(f"# {o.name} = {o.toml(o.default)}")
            lines.append("")
    return "\n".join(lines)
