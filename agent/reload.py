"""Whether the last SIGHUP reload of the config worked, for Prometheus, `status` and the events:
gpuwatch_config_last_reload_success (0/1) and _success_timestamp_seconds, as Prometheus' own
prometheus_config_last_reload_successful and _success_timestamp_seconds. The config read at start
counts as the first successful load (the agent does not start on a bad one)."""
from __future__ import annotations

import threading
import time

from gpuwatch.agent.api import Event, Probe, Sample
from gpuwatch.agent.events import EventQueue


class ReloadStatus(Probe):
    name = "config"
    interval = 1.0

    def __init__(self, path: str | None) -> None:
        self.path = path or ""
        self._lock = threading.Lock()
        self.success = True
        self.success_ts = time.time()
        self.error = ""
        self.error_ts = 0.0
        self._events = EventQueue(16)

    def loaded(self) -> None:
        with self._lock:
            self.success, self.success_ts, self.error = True, time.time(), ""

    def rejected(self, error: str) -> None:
        with self._lock:
            repeated = error == self.error  # the same rejection again is said once, as in the log
            self.success, self.error, self.error_ts = False, error, time.time()
            if not repeated:
                self._events.put(Event("config.reload_rejected", self.path,
                                       {"error": error, "summary": "config reload rejected, keeping the running config"}))

    def collect(self) -> list[Sample]:
        with self._lock:
            return [Sample("gpuwatch.config.last_reload.success", 1.0 if self.success else 0.0),
                    Sample("gpuwatch.config.last_reload.success_timestamp", self.success_ts)]

    def events(self) -> list[Event]:
        return self._events.drain()

    def as_dict(self) -> dict:
        with self._lock:
            return {"success": self.success, "success_timestamp": self.success_ts, "error": self.error,
                    "error_timestamp": self.error_ts, "path": self.path}
