"""The events a probe's threads find between two drains by the runner (Probe.events())."""
from __future__ import annotations

import threading
from collections import deque

from gpuwatch.agent.api import Event


class EventQueue:
    """Events kept until drained; any thread may put. At most `bound` (None: no bound): when full a
    new event is refused, or with drop_oldest makes room by dropping the oldest; either way it is
    counted in `dropped` (whether that is exported is the probe's choice)."""

    def __init__(self, bound: int | None, drop_oldest: bool = False) -> None:
        self.bound, self.drop_oldest, self.dropped = bound, drop_oldest, 0
        self._lock = threading.Lock()  # held for a list operation only: a leaf under any probe's lock
        self._events: deque[Event] = deque()

    def put(self, event: Event) -> bool:
        """Keep `event`; False when one was dropped for the bound (this one, or the oldest)."""
        with self._lock:
            room = self.bound is None or len(self._events) < self.bound
            if not room:
                self.dropped += 1
                if not self.drop_oldest:
                    return False
                self._events.popleft()
            self._events.append(event)
            return room

    def drain(self) -> list[Event]:
        """The events kept since the last drain, oldest first, and an empty queue."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out
