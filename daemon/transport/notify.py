"""sd_notify(3) in a few lines of stdlib: READY=1, STATUS=, STOPPING=1 and
WATCHDOG=1 to $NOTIFY_SOCKET, when systemd (or a test) set one."""
from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("ridge.daemon")


class Notifier:
    def __init__(self, environ=os.environ):
        addr = environ.get("NOTIFY_SOCKET", "")
        self.addr = "\0" + addr[1:] if addr.startswith("@") else addr  # '@' = the abstract namespace
        self.sock = None
        if self.addr:
            # non-blocking: a notification is never worth stalling the socket loop (a full receiver drops it)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        # ping at half the timeout, as sd_watchdog_enabled(3) advises
        self.watchdog_interval = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else None
        self._last_ping = 0.0

    @property
    def enabled(self) -> bool:
        return self.sock is not None

    def send(self, *lines: str) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendto("\n".join(lines).encode(), self.addr)
        except OSError as e:  # systemd gone, or its queue full (EAGAIN): never fatal
            log.debug("sd_notify failed: %s", e)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def watchdog(self, healthy: bool) -> None:
        """Ping only while the engine loop is alive, so a hung engine gets the daemon restarted."""
        if self.watchdog_interval is None or not healthy:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval:
            self._last_ping = now
            self.send("WATCHDOG=1")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
