"""The daemon: one Server, the socket thread's state and its three parts (docs/protocol.md §10).

- transport/loop.py, SocketLoop: the sockets, receiving and sending, liveness, stats feed, drain;
- frontend/requests.py, RequestFlow: generate, embed, rerank, tokenize, detokenize and abort,
  from a message to the engine and its outputs back;
- frontend/control.py, Control: hello, stats, health, heartbeat and models.

What costs CPU in proportion to a request (tokenizing, chat templates, compiling constraints)
runs on the admission workers (frontend/admission.py); the socket thread only takes their
results, each client's in the order it sent them. Built by `ridge serve` (cli/serve.py)."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from ridge.durations import FOREVER

from .frontend.admission import Admission
from .frontend.control import Control
from .frontend.engine_loop import EngineLoop
from .frontend.images import rules_for
from .frontend.models import Models
from .frontend.registry import Entry, Registry
from .frontend.requests import RequestFlow
from .frontend.streams import InFlight
from .frontend.validate import Validator
from .protocol import Limits
from .transport.loop import SocketLoop


class _NoEngine:
    """No model is loaded: the last engine stats known, and no engine to be late or dead."""

    def __init__(self, snapshot: tuple):
        self.snapshot, self.tick = snapshot, time.monotonic()

    @staticmethod
    def is_alive() -> bool:
        return True


@dataclass(kw_only=True)
class ServerConfig:
    """Built by `ridge serve` (daemon/cli/serve.py) from the resolved options: the values of
    options have no defaults here, only in their declarations (daemon/cli/config.py)."""
    endpoint: str
    tcp: str | None  # None: no TCP listener
    pub_endpoint: str | None  # None: no stats PUB socket
    curve: object | None = None  # endpoint.CurveConfig, for the TCP socket
    limits: Limits
    heartbeat_interval: float
    client_timeout: float
    drain_grace: float
    stats_interval: float
    socket_mode: int = 0o600
    prefix_sharing: str  # daemon/transport/sharing.py


def make_validator(engine, model: dict, limits: Limits) -> Validator:
    return Validator(engine.tokenizer, model["vocab_size"], model["max_model_len"], model["block_size"],
                     model["num_kv_blocks"], limits, engine.grammars,
                     model["hidden_size"] if model.get("pooling") else None, model.get("pooling") == "rank",
                     image_rules=rules_for(model.get("path"), model.get("mmproj"), engine.tokenizer))


class Server(SocketLoop, RequestFlow, Control):
    def __init__(self, cfg: ServerConfig, engine, loop: EngineLoop, model: dict, notifier=None, version: str = "",
                 models: Models | None = None):
        """models: the daemon's models (frontend/models.py), the default one (engine, loop, model) among
        them; None: a daemon of that one model. The state every part reads is set here; the handlers
        are the parts' methods."""
        self.cfg, self.model, self.notifier = cfg, model, notifier
        self.server_name = f"ridge {version}".strip()
        self.validator = make_validator(engine, model, cfg.limits)  # the default model's: tokenize, detokenize
        self.model = {**model, "chat": self.validator.chat.info()}
        if models is None:
            entry = Entry(model["name"], model.get("path"), source="default")
            models = Models(Registry(entry, Path("/nonexistent")), None, lambda slot, eng: (self.validator, self.model),
                            max_loaded=1, keep_alive=FOREVER, memory_bytes=None, park_bytes=0, kv_share_gib=None)
            models.adopt(entry, loop, engine)
        self.models = models
        models.send, models.admit, models.refuse = self._send, self._admit_waiting, self._refuse_waiting
        self._owners: dict = {}  # admission Pending -> (Slot, keep_alive) of a generate or embed
        self.admission = Admission()
        self._frame_bytes = 0
        self.finishers = {"generate": self._admit, "tokenize": self._send_frame, "detokenize": self._send_frame,
                          "embed": self._admit_embed, "rerank": self._admit_embed}
        self.ctx = zmq.Context.instance()
        self.routers: list[zmq.Socket] = []
        self.pub: zmq.Socket | None = None
        self.peers: dict = {}  # (router index, routing id) -> Peer
        self.inflight: dict[str, InFlight] = {}  # engine id -> request
        self._ids = itertools.count()
        self.state = "ok"  # ok | draining | error
        self.started = time.monotonic()
        self.counts = {"frames_in": 0, "frames_out": 0, "errors_sent": 0}
        self.aborts = {"client": 0, "disconnected": 0, "timeout": 0, "shutdown": 0}
        self._drain_requested = self._hurry = False
        self._drain_deadline = self._forced_at = self._quiet_since = None
        self._last_sweep = self._last_status = 0.0
        self._published_seq: tuple | None = None
        self.handlers = {"hello": self._hello, "generate": self._generate, "abort": self._abort,
                         "tokenize": self._tokenize, "detokenize": self._detokenize, "stats": self._stats,
                         "health": self._health, "heartbeat": self._heartbeat, "embed": self._embed,
                         "models": self._models, "rerank": self._rerank}

    @property
    def loop(self):
        """The engine loop whose stats and liveness the daemon reports (Models.primary)."""
        slot = self.models.primary()
        return slot.loop if slot is not None else _NoEngine(self.models.snapshot())

