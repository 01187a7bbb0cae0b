"""sd_notify(3) without libsystemd: readiness and watchdog pings for Type=notify services.

The protocol is one datagram of newline-separated VAR=value lines to the Unix
socket named by $NOTIFY_SOCKET (a leading '@' means the abstract namespace).
Outside systemd there is no $NOTIFY_SOCKET and every call is a cheap no-op.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable

log = logging.getLogger("gpuwatch.sdnotify")


def _address() -> str | None:
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in "/@":
        return None
    return "\0" + addr[1:] if addr[0] == "@" else addr


def notify(state: str) -> bool:
    """Send `state` ("READY=1", "STATUS=...", "STOPPING=1", ...). True if it was sent."""
    addr = _address()
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(state.encode(), addr)
        return True
    except OSError as e:
        log.debug("sd_notify %r to %s failed: %s", state, os.environ.get("NOTIFY_SOCKET"), e)
        return False


def ready(status: str | None = None) -> bool:
    """Tell systemd start-up is complete (and optionally what the agent is doing)."""
    return notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def watchdog_interval() -> float | None:
    """Seconds within which systemd expects a WATCHDOG=1 ping, or None if it expects none."""
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):  # meant for another process (e.g. our parent)
        return None
    return usec / 1e6


class Watchdog:
    """Pings at most every interval/2, so calling ping() on every runner loop costs a clock read."""

    def __init__(self, interval: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = watchdog_interval() if interval is None else interval
        self.clock = clock
        self._last: float | None = None

    def ping(self) -> None:
        if self.interval is None:
            return
        now = self.clock()
        if self._last is None or now - self._last >= self.interval / 2:
            self._last = now
            notify("WATCHDOG=1")
