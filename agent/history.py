"""In-memory history: one bounded ring buffer per series.

Detectors read trends from here; memory stays bounded because every buffer has a
fixed length (its points packed as doubles: 16 bytes a point), series that stop reporting are dropped after `expire_after` seconds (a process's
series, those with a `pid` label, after `process_expire_after`: processes come and go, and no
detector looks back further than 10 minutes at one), and at most `max_series` are held (the
oldest are forgotten first: processes an ordinary user can start make series).

Detectors read it through select(), which hands over Series: a counter's increase and rate, with
its resets handled here once, its newest value, and windows of it.
"""
from __future__ import annotations

import logging
import threading
import statistics
from array import array
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

from gpuwatch.agent.api import Sample

log = logging.getLogger("gpuwatch.history")

MAX_SERIES = 16384
PROCESS_EXPIRE = 600.0  # the leak detector's longest window


@dataclass(frozen=True, slots=True)
class Series:
    """One series as select() hands it over: a copy of its points, oldest first, its metric, its GPU
    (the resource; "" for a node's or a process's host series) and its labels. Of a counter, a drop
    is a reset (a driver, agent or job restart), never a negative increase."""

    points: list[tuple[float, float]]
    metric: str = ""
    gpu: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.points)

    @property
    def latest(self) -> float | None:
        return self.points[-1][1] if self.points else None

    @property
    def latest_ts(self) -> float | None:
        return self.points[-1][0] if self.points else None

    @property
    def span(self) -> float:
        """Seconds from its first point to its last."""
        return self.points[-1][0] - self.points[0][0] if self.points else 0.0

    def window(self, since: float) -> Series:
        """Its points at or after `since`."""
        return Series([pt for pt in self.points if pt[0] >= since], self.metric, self.gpu, self.labels)

    def values(self, t0: float, t1: float) -> list[float]:
        """Its values in (t0, t1]."""
        return [v for t, v in self.points if t0 < t <= t1]

    def increase(self, since: float = float("-inf")) -> float:
        """A counter's increase since `since`, from its value before then when it has one: the sum of
        its rises (a reset to a lower value is not one)."""
        pts = [(t, v) for t, v in self.points if t >= since]
        before = [v for t, v in self.points if t < since]
        if before:
            pts.insert(0, (since, before[-1]))
        return sum(max(0.0, b - a) for (_, a), (_, b) in zip(pts, pts[1:]))

    def first_rise(self, since: float) -> float | None:
        """When the counter first rose at or after `since`."""
        prev = None
        for t, v in self.points:
            if prev is not None and v > prev and t >= since:
                return t
            prev = v
        return None

    def rate(self, t0: float, t1: float) -> float | None:
        """A counter's rate over (t0, t1] from consecutive points, a drop (a reset) skipped with its
        interval; None with no interval to judge."""
        total = span = 0.0
        for (ta, a), (tb, b) in zip(self.points, self.points[1:]):
            if tb <= t0 or tb > t1 or tb <= ta or b < a:
                continue
            total += b - a
            span += tb - ta
        return total / span if span > 0 else None

    def typical_rate(self, t0: float, t1: float) -> float | None:
        """A counter's usual rate over (t0, t1]: the median of its rates between consecutive points, so
        that one burst (a server reading its weights in at start) does not pass for its usual rate."""
        rates = [(b - a) / (tb - ta) for (ta, a), (tb, b) in zip(self.points, self.points[1:])
                 if t0 < tb <= t1 and tb > ta and b >= a]
        return statistics.median(rates) if rates else None


class _Points:
    """A series' points in two arrays of doubles that wrap at `maxlen`: 16 bytes a point, where a
    deque of (ts, value) tuples took 90 (a tuple and a float each; the ts is shared by a batch). At
    the default 720 points that was 7.7 MiB for the 126 series of one GPU on the replay, and 61 MiB
    for 1,000 (bench/history_memory.py)."""

    __slots__ = ("ts", "values", "start", "maxlen")

    def __init__(self, maxlen: int) -> None:
        self.ts = array("d")
        self.values = array("d")
        self.start = 0  # where the oldest point is, once the arrays are full
        self.maxlen = maxlen

    def __len__(self) -> int:
        return len(self.ts)

    def append(self, t: float, v: float) -> None:
        if len(self.ts) < self.maxlen:
            self.ts.append(t)
            self.values.append(v)
        else:
            i = self.start
            self.ts[i] = t
            self.values[i] = v
            self.start = (i + 1) % self.maxlen

    def newest_ts(self) -> float:
        return self.ts[self.start - 1]  # the last element until the arrays are full

    def points(self, since: float | None = None) -> list[tuple[float, float]]:
        """Oldest first (History keeps only points newer than a series' newest: they are in time
        order). With `since`: those from then on and the one before."""
        s = self.start
        ts, values = (self.ts, self.values) if not s else (self.ts[s:] + self.ts[:s], self.values[s:] + self.values[:s])
        first = 0 if since is None else max(0, bisect_left(ts, since) - 1)
        return list(zip(ts[first:], values[first:]))


class History:
    def __init__(self, maxlen: int = 720, expire_after: float = 3600.0, max_series: int = MAX_SERIES,
                 process_expire_after: float = PROCESS_EXPIRE) -> None:
        self.maxlen = maxlen
        self.expire_after = expire_after
        self.process_expire_after = process_expire_after
        self.max_series = max_series
        self._series: dict[tuple, _Points] = {}
        self._lock = threading.Lock()
        self.evicted: Counter = Counter()  # series forgotten, by reason (expired, cap)

    def append(self, samples: Iterable[Sample], newer_than: float = float("-inf")) -> None:
        """Add points; samples with ts <= newer_than are skipped (a probe's re-emitted slow values), and
        so is a point not newer than its series' newest (a series is in time order)."""
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
                    buf = series[key] = _Points(self.maxlen)
                elif buf.newest_ts() >= s.ts:
                    continue  # a slow metric re-emitted between its reads (same point), or one out of order
                buf.append(s.ts, s.value)

    def shift(self, delta: float) -> None:
        """Move every point by `delta` seconds: the wall clock stepped (runner), and trends must
        stay continuous rather than see an hour-long gap or points that go back in time."""
        with self._lock:
            for key, buf in self._series.items():
                moved = self._series[key] = _Points(buf.maxlen)
                for t, v in buf.points():
                    moved.append(t + delta, v)

    def _evict_oldest(self) -> None:
        """At the cap: forget the sixteenth of the series whose newest point is oldest (a batch, so a
        flood of new series costs one sort per batch, not a scan per series). Lock held."""
        n = max(1, self.max_series // 16)
        oldest = sorted(self._series, key=lambda k: self._series[k].newest_ts() if self._series[k] else float("-inf"))[:n]
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
            old = [k for k, buf in self._series.items() if not buf or now - buf.newest_ts() > limit(k)]
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
            items = [(k, buf.points(since)) for k, buf in self._series.items()
                     if k[0] == metric and (resource is None or k[1] == resource)]
        yield from items

    def select(self, metric: str, /, gpu: str | None = None, since: float | None = None,
               **labels: str) -> list[Series]:
        """The series of `metric` (of one GPU; gpu="" for host series) whose labels have these values;
        `since` as in series()."""
        out = []
        for (_, resource, key), pts in self.series(metric, gpu, since):
            lab = dict(key)
            if all(lab.get(k) == v for k, v in labels.items()):
                out.append(Series(pts, metric, resource, lab))
        return out

    def newest(self, *metrics: str) -> float | None:
        """The time of the newest point of any series of these metrics: a detector's "now"."""
        with self._lock:
            return max((buf.newest_ts() for k, buf in self._series.items() if k[0] in metrics and buf), default=None)

    def __len__(self) -> int:
        return len(self._series)
