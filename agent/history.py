"""In-memory history: one bounded ring buffer per series.

Detectors read trends from here; memory stays bounded because every buffer has a
fixed length, series that stop reporting are dropped after `expire_after` seconds (a process's
series, those with a `pid` label, after `process_expire_after`: processes come and go, and no
detector looks back further than 10 minutes at one), and at most `max_series` are held (the
oldest are forgotten first: processes an ordinary user can start make series).
"""
from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from typing import Iterable, Iterator

from gpuwatch.agent.api import Sample

log = logging.getLogger("gpuwatch.history")

MAX_SERIES = 16384
PROCESS_EXPIRE = 600.0  # the leak detector's longest window


class History:
    def __init__(self, maxlen: int = 720, expire_after: float = 3600.0, max_series: int = MAX_SERIES,
                 process_expire_after: float = PROCESS_EXPIRE) -> None:
        self.maxlen = maxlen
        self.expire_after = expire_after
        self.process_expire_after = process_expire_after
        self.max_series = max_series
        self._series: dict[tuple, deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()
        self.evicted: Counter = Counter()  # series forgotten, by reason (expired, cap)

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
                    if len(series) >= self.max_series:
                        self._evict_oldest()
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

    def _evict_oldest(self) -> None:
        """At the cap: forget the sixteenth of the series whose newest point is oldest (a batch, so a
        flood of new series costs one sort per batch, not a scan per series). Lock held."""
        n = max(1, self.max_series // 16)
        oldest = sorted(self._series, key=lambda k: self._series[k][-1][0] if self._series[k] else float("-inf"))[:n]
        for k in oldest:
            del self._series[k]
        if not self.evicted["cap"]:
            log.warning("history holds %d series, its cap: the oldest are forgotten (counted in "
                        "gpuwatch_history_series_evicted_total{reason=\"cap\"}; not logged again)", self.max_series)
        self.evicted["cap"] += len(oldest)

    def expire(self, now: float) -> int:
        """Forget series whose newest point is older than expire_after (process_expire_after for a
        process's series). Returns how many."""
        def limit(key: tuple) -> float:
            return self.process_expire_after if any(name == "pid" for name, _ in key[2]) else self.expire_after

        with self._lock:
            old = [k for k, buf in self._series.items() if not buf or now - buf[-1][0] > limit(k)]
            for k in old:
                del self._series[k]
            self.evicted["expired"] += len(old)
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
