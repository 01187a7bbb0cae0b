"""In-memory history: one bounded ring buffer per series.

Detectors read trends from here; memory stays bounded because every buffer has a
fixed length and series that stop reporting are dropped after `expire_after` seconds.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Iterable, Iterator

from gpuwatch.agent.api import Sample


class History:
    def __init__(self, maxlen: int = 720, expire_after: float = 3600.0) -> None:
        self.maxlen = maxlen
        self.expire_after = expire_after
        self._series: dict[tuple, deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def append(self, samples: Iterable[Sample], newer_than: float = float("-inf")) -> None:
        """Add points; samples with ts <= newer_than are skipped (a probe's re-emitted slow values)."""
        with self._lock:
            series = self._series
            for s in samples:
                if s.ts <= newer_than:
                    continue
                key = s.series_key()
                buf = series.get(key)
                if buf is None:
                    buf = series[key] = deque(maxlen=self.maxlen)
                elif buf[-1][0] == s.ts:
                    continue  # a slow metric re-emitted between its reads: same point, not a new one
                buf.append((s.ts, s.value))

    def shift(self, delta: float) -> None:
        """Move every point by `delta` seconds: the wall clock stepped (runner), and trends must
        stay continuous rather than see an hour-long gap or points that go back in time."""
        with self._lock:
            for key, buf in self._series.items():
                self._series[key] = deque(((t + delta, v) for t, v in buf), maxlen=buf.maxlen)

    def expire(self, now: float) -> int:
        """Forget series whose newest point is older than expire_after. Returns how many."""
        with self._lock:
            old = [k for k, buf in self._series.items() if not buf or now - buf[-1][0] > self.expire_after]
            for k in old:
                del self._series[k]
            return len(old)

    def series(self, metric: str, resource: str | None = None,
               since: float | None = None) -> Iterator[tuple[tuple, list[tuple[float, float]]]]:
        """(key, points) for every series of `metric` (optionally of one resource); points are copies.
        With `since`: only the points from then on, and the one before (a counter's increase over
        the window needs its value at the start), read from the newest back."""
        with self._lock:
            if since is None:
                items = [(k, list(buf)) for k, buf in self._series.items()
                         if k[0] == metric and (resource is None or k[1] == resource)]
            else:
                items = []
                for k, buf in self._series.items():
                    if k[0] != metric or (resource is not None and k[1] != resource):
                        continue
                    recent = []
                    for pt in reversed(buf):
                        recent.append(pt)
                        if pt[0] < since:
                            break
                    recent.reverse()
                    items.append((k, recent))
        yield from items

    def __len__(self) -> int:
        return len(self._series)
