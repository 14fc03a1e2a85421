"""`ridge serve`: configuration -> one daemon per endpoint -> model -> sockets
-> the socket loop, until a signal drains it."""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

from ridge.durations import parse_duration

from ..frontend.registry import Entry, Registry, default_models_dir, served_name
from ..gateway.settings import GatewaySettings, gateway_settings
from ..protocol import Limits
from ..transport.endpoint import (SYSTEM_GROUP, SYSTEM_MODE, USER_MODE, EndpointError, EndpointLock, check_pub,
                                  check_tcp, ipc_path, load_curve, prepare_dir, pub_endpoint_for, system_endpoint,
                                  user_endpoint)
from ..transport.notify import Notifier
from .config import resolve

log = logging.getLogger("ridge.daemon")

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class JournalFormatter(logging.Formatter):
    """`<6>ridge.daemon: message`: journald reads the <N> syslog priority from each stderr line
    (SyslogLevelPrefix=, on by default) and stamps the time itself."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6)
        text = super().format(record)
        return "\n".join(f"<{prio}>{line}" for line in text.splitlines())


def setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    journald = bool(os.environ.get("JOURNAL_STREAM"))
    fmt = JournalFormatter("%(name)s: %(message)s") if journald else \
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    for h in root.handlers:
        h.setFormatter(fmt)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("ridge")
    except Exception:
        return "dev"


def limits(c: dict, max_model_len: int) -> Limits:
    """The protocol's limits from resolved options (0: the context's own bound)."""
    return Limits(max_frame_bytes=c["max_frame_bytes"],
                  max_prompt_tokens=min(c["max_prompt_tokens"] or max_model_len - 1, max_model_len - 1),
                  max_tokens=min(c["max_tokens"] or max_model_len, max_model_len),
                  max_requests_per_client=c["max_requests_per_client"], max_queue=c["max_queue"])


def _check(c: dict) -> None:
    for name in ("max_frame_bytes", "max_requests_per_client", "max_queue"):
        if c[name] < 1:
            raise ValueError(f"{name} must be >= 1")
    for name in ("heartbeat_interval", "client_timeout", "stats_interval"):
        if not c[name] > 0:
            raise ValueError(f"{name} must be > 0")
    if c["drain_grace"] < 0:
        raise ValueError("drain_grace must be >= 0")
    parse_duration(c["keep_alive"])
    if c["max_loaded_models"] < 1:
        raise ValueError("max_loaded_models must be >= 1")


def check_listeners(c: dict, system: bool, curve) -> GatewaySettings | None:
    """Where the daemon listens besides its socket, checked before anything binds; -> the HTTP
    gateway's settings, or None. On the system daemon, TCP needs CURVE and HTTP an API key even on
    loopback, or the daemon refuses to start (docs/service.md, "Who can reach what")."""
    if c["tcp"]:
        check_tcp(c["tcp"], curve, system)
    if c["pub_endpoint"]:
        check_pub(c["pub_endpoint"], system)
    return gateway_settings(c, default_http=None, system=system)


def claim_endpoint(endpoint: str, system: bool) -> EndpointLock | None:
    """The socket's directory, checked and given its mode, then the endpoint's lock (§1)."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    prepare_dir(path.parent, SYSTEM_MODE if system else USER_MODE, SYSTEM_GROUP if system else None)
    lock = EndpointLock(path)
    lock.acquire()
    return lock


def new_engine(values: dict, loaded=None):
    """An engine from resolved option values; loaded: a model's weights parked in host RAM."""
    from ridge.engine.builder import build_engine
    from ridge.engine.config import engine_config
    from ridge.engine.core import EngineCore

    from ..frontend.memory import unpark

    if loaded is not None:
        try:
            loaded = unpark(loaded, values["device"])
        except Exception as e:  # the copy failed: the model loads as if never parked
            log.warning("the parked weights of %s could not be used (%s); loading it again", values["model"], e)
            loaded = None
    # The core only: the daemon's socket thread turns its token ids into text (frontend/streams.py).
    return EngineCore(build_engine(engine_config(values), loaded=loaded))


def run_serve(args) -> int:
    res = resolve(args)
    if args.print_config:
        c = res.values
        sys.stdout.write(res.to_toml())
        ep = c["endpoint"] or (system_endpoint() if c["system"] else user_endpoint())
        pub = c["pub_endpoint"] or pub_endpoint_for(ep)
        sys.stdout.write(f"# -> listening on {ep}{' and ' + c['tcp'] if c['tcp'] else ''}, stats on {pub}\n")
        return 0
    setup_logging()
    from ..gateway.connections import raise_fd_limit
    # Socket clients, HTTP connections, model files and the KV tier share the open-file limit, and
    # systemd's soft default (1024) is what a few hundred clients use up: the hard limit is the budget.
    raise_fd_limit()
    c = res.values
    _check(c)
    endpoint = c["endpoint"] or (system_endpoint() if c["system"] else user_endpoint())
    system = bool(c["system"]) and not c["endpoint"]
    lock, http = None, []
    try:
        curve = load_curve(c["curve_secret_key_file"], c["curve_clients_dir"])
        gateway = check_listeners(c, system, curve)
        ollama = gateway_settings(c, default_http=None, system=system, key="ollama")
        lock = claim_endpoint(endpoint, system)
        from ..gateway.run import listen
        for settings, is_ollama in ((gateway, False), (ollama, True)):
            if settings is not None:  # bound now: a port in use fails before the model loads
                http.append((settings, listen(settings), is_ollama))
        return _serve(c, endpoint, system, curve, http, res.models, str(res.path))
    except EndpointError as e:
        log.error("%s", e)
        return 1
    finally:
        for _, sock, _ in http:
            sock.close()
        if lock is not None:
            lock.release()


def _serve(c: dict, endpoint: str, system: bool, curve, http=(), table: dict | None = None,
           where: str = "config.toml") -> int:
    from ..frontend.engine_loop import EngineLoop
    from ..frontend.memory import park, plan_sharing
    from ..frontend.models import Models
    from ..server import Server, make_validator

    notifier = Notifier()
    notifier.status("loading the model")
    models_dir = Path(c["models_dir"]) if c["models_dir"] else default_models_dir()
    registry = Registry(Entry("default", c["model"], source="default"), models_dir, table, where)
    memory, parked, share = plan_sharing(c, registry)

    def build(entry: Entry, loaded=None, kv_gib: float | None = None) -> EngineLoop:
        """One model's engine, built on its own thread (frontend/engine_loop.py): the daemon's options, the
        entry's over them, and its share of the KV budget unless the entry sets its own."""
        values = {**c, **entry.options, "model": entry.path}
        if kv_gib is not None and values["num_kv_blocks"] is None:
            values["kv_memory_gib"] = min(kv_gib, values["kv_memory_gib"] or kv_gib)
        loop = EngineLoop(lambda: new_engine(values, loaded), c["stats_interval"])
        loop.park = park
        loop.start()
        return loop

    loop = build(registry.default, None, share)
    loop.ready.wait()  # built on the engine thread: see engine_loop.py
    if loop.error is not None:  # the model the daemon starts with must load, or it does not start
        raise loop.error
    loop.drain_outbox()
    engine = loop.engine
    model = engine.model_info()
    model["name"] = c["served_model_name"] or served_name(model)
    registry.default.name, registry.default.path = model["name"], model["path"]
    cfg = _server_config(c, endpoint, system, curve, engine.max_model_len)

    def ready(slot, eng) -> tuple:
        """A model loaded on request: its validator and what hello would say of it."""
        if slot.entry is registry.default:
            return server.validator, server.model
        info = {**eng.model_info(), "name": slot.name}
        validator = make_validator(eng, info, limits(c, eng.max_model_len))
        return validator, {**info, "chat": validator.chat.info()}

    models = Models(registry, build, ready, max_loaded=c["max_loaded_models"],
                    keep_alive=parse_duration(c["keep_alive"]), memory_bytes=memory, park_bytes=parked,
                    kv_share_gib=share)
    models.default_pooling = c["pooling"]
    models.loads_per_minute = c["max_loads_per_minute"]
    server = Server(cfg, engine, loop, model, notifier, _version(), models)
    models.adopt(registry.default, loop, engine)
    return _run(server, cfg, models, http, c, endpoint, notifier)


def _server_config(c: dict, endpoint: str, system: bool, curve, max_model_len: int):
    from ..server import ServerConfig

    pub = c["pub_endpoint"] if c["pub_endpoint"] is not None else pub_endpoint_for(endpoint)
    return ServerConfig(endpoint=endpoint, tcp=c["tcp"], pub_endpoint=None if pub == "none" else pub, curve=curve,
                        limits=limits(c, max_model_len), heartbeat_interval=c["heartbeat_interval"],
                        client_timeout=c["client_timeout"], drain_grace=c["drain_grace"],
                        stats_interval=c["stats_interval"], socket_mode=0o660 if system else 0o600,
                        prefix_sharing=c["prefix_sharing"])


def _run(server, cfg, models, http, c: dict, endpoint: str, notifier) -> int:
    """Bind, start the gateways, serve until drained; then stop everything in order."""
    model = server.model
    gateways = []
    try:
        server.bind()
        from ..gateway.run import GatewayThread
        for settings, sock, is_ollama in http:
            gateways.append(GatewayThread(settings, endpoint, sock, ollama_api=is_ollama))
            gateways[-1].start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.request_drain())
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: every thread's stack to the log
        where = endpoint + (f" and {c['tcp']}" if c["tcp"] else "")
        log.info("serving %s (%s, %s KV, %d blocks of %d) on %s; stats on %s", model["name"], model["device"],
                 model["kv_dtype"], model["num_kv_blocks"], model["block_size"], where, cfg.pub_endpoint)
        notifier.ready(f"serving {model['name']} on {endpoint}")
        code = server.run()
        log.info("stopped (exit %d)", code)
        return code
    finally:
        for gateway in gateways:  # after the drain: every request's final frame is out
            gateway.stop()
        for lp in models.loops():
            lp.stop()
        server.close()
        if (path := cfg.pub_endpoint and ipc_path(cfg.pub_endpoint)) and path.exists():
            path.unlink()
        for lp in models.loops():
            if lp.is_alive():
                lp.join(10)
        notifier.close()

