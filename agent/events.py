"""The events a probe's threads find between two drains by the runner (Probe.events())."""
from __future__ import annotations

import threading

from gpuwatch.agent.api import Event


class EventQueue:
    """Events kept until drained; any thread may put. At most `bound` (None: no bound): when full a
    new event is refused, or with drop_oldest makes room by dropping the oldest; either way it is
    counted in `dropped` (whether that is exported is the probe's choice)."""

    def __init__(self, bound: int | None, drop_oldest: bool = False) -> None:
        self.bound, self.drop_oldest, self.dropped = bound, drop_oldest, 0
        self._lock = threading.Lock()  # held for one list operation: a leaf under any probe's lock
        self._events: list[Event] = []

    def put(self, event: Event) -> bool:
        """Keep `event`; False when one was dropped for the bound (this one, or the oldest)."""
        with self._lock:
            if full := self.bound is not None and len(self._events) >= self.bound:
                self.dropped += 1
                if not self.drop_oldest:
                    return False
                del self._events[0]
            self._events.append(event)
            return not full

    def drain(self) -> list[Event]:
        """The events kept since the last drain, oldest first; the queue is left empty."""
        with self._lock:
            out, self._events = self._events, []
        return out
