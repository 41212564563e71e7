"""systemd's sd_notify datagram protocol (no libsystemd needed).

`NOTIFY_SOCKET` is a filesystem path or, with a leading '@', a Linux abstract socket. Each
message is one datagram of newline-separated `KEY=value` assignments. Without NOTIFY_SOCKET every
call is a no-op, so the same code runs outside systemd.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Send READY/STATUS/WATCHDOG/STOPPING to the service manager."""

    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET") or None
        if addr and addr.startswith("@"):
            addr = "\0" + addr[1:]
        self.address = addr
        self.watchdog_usec = _watchdog_usec(env)
        self._lock = threading.Lock()
        self._last_ping = 0.0
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send one datagram; False (logged once at debug) if there is no manager or it fails."""
        if not self.address:
            return False
        msg = "\n".join(assignments).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(msg, self.address)
                return True
            except OSError as e:
                # the manager going away must never take the service down with it
                log.debug("sd_notify %r failed: %s", msg, e)
                return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def extend_timeout(self, seconds: float) -> bool:
        """EXTEND_TIMEOUT_USEC: the start-up (or stop) timeout now ends `seconds` from now at the
        earliest; sent on every step of a slow start so only a stalled one times out."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    @property
    def watchdog_interval(self) -> float | None:
        """Least seconds between pings: an eighth of WatchdogSec. Pings are sent on progress (each
        decoder layer of a prefill chunk or a decode step, restored layer, vision block), so two
        pings are at most an eighth of the timeout plus one layer apart (sd_watchdog_enabled(3)
        asks for at most half); the limit only keeps thousands of layers a second from becoming
        thousands of datagrams."""
        return self.watchdog_usec / 8e6 if self.watchdog_usec else None

    def watchdog(self, force: bool = False) -> bool:
        """Ping if the watchdog is on and an eighth of the interval passed since the last ping."""
        iv = self.watchdog_interval
        if iv is None or not self.address:
            return False
        now = time.monotonic()
        if not force and now - self._last_ping < iv:
            return False
        self._last_ping = now
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    """WATCHDOG_USEC if set and meant for this process (WATCHDOG_PID absent or our pid)."""
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec:
        return None
    if pid and pid.strip() != str(os.getpid()):
        return None
    try:
        v = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None
    return v if v > 0 else None
