"""The core types every probe, detector and exporter imports.

Kept deliberately small: a Sample is one value of one registered metric for one
resource at one time; an Event is something discrete that happened. Probes
produce both, detectors read history and emit findings, exporters translate a
Snapshot. Nothing here does I/O.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatch.agent.history import History
    from gpuwatch.agent.snapshot import Snapshot


def printable(text: str) -> str:
    """Text safe for a terminal, a log line and a label: what is not printable becomes "?" —
    C0 and C1 controls (newlines, ESC, U+009B CSI), format characters such as the bidi controls
    (U+202A-202E, U+2066-2069, U+200E/F, U+061C) and zero-width ones, line and paragraph
    separators, non-ASCII spaces, lone surrogates, private-use and unassigned code points
    (Python's str.isprintable: Unicode categories C* and Z* but the ASCII space)."""
    if text.isprintable():  # the common case, in C; False for any surrogate (category Cs)
        return text
    return "".join(c if c.isprintable() else "?" for c in text)


@dataclass(frozen=True, slots=True)
class HistogramValue:
    """A histogram's state, cumulative since `start`: observations per bucket of the registry's
    bounds (agent/metrics.py Metric.buckets), not cumulative, the last one above every bound."""

    counts: tuple[int, ...]
    sum: float
    min: float
    max: float
    start: float  # wall-clock seconds when counting began (OTLP's start time of a cumulative point)

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True, slots=True)
class Sample:
    """One value of a registered metric.

    metric:    the metric's registry name (its OpenTelemetry name, e.g. "hw.temperature").
    resource:  the GPU UUID for per-GPU metrics, "" for node or agent metrics.
    labels:    the metric's other label values (never the GPU, which is the resource).
    ts:        wall-clock seconds (time.time()) when the value was read.
    histogram: for a histogram metric, its state (value is then its count).
    """

    metric: str
    value: float
    resource: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)
    histogram: HistogramValue | None = None

    def series_key(self) -> tuple:
        return (self.metric, self.resource, tuple(sorted(self.labels.items())))


@dataclass(frozen=True, slots=True)
class Event:
    """Something discrete that happened: an XID, a probe failure, a finding."""

    kind: str
    resource: str = ""
    attrs: Mapping[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)


class GpuwatchError(Exception):
    """Base of every error a person may see: its text says what is wrong and what to do. The CLI
    catches this one type and prints the text; anything else escaping is a bug (a traceback)."""


class ProbeUnavailable(GpuwatchError):
    """A probe cannot run here. The message must tell a person what to do about it."""


class ProbeDisabled(ProbeUnavailable):
    """A probe that needs an optional part that is not installed (an extra such as
    `gpuwatch[baseline]`): off by the install, not down. The message names what to install."""


class ProbeNotRunning(ProbeUnavailable):
    """A query to a probe that is not running now; str() (and `reason`) says why: not started
    yet, or what made its last start or collection fail."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ProbeBusy(GpuwatchError):
    """A query that could not get at the probe within its timeout: the probe's own work (a start
    that compiles and attaches, a collection, a shutdown that detaches) held it all that time."""


class Probe(abc.ABC):
    """A source of samples, ticked by the runner every `interval` seconds.

    collect() must return within `deadline` seconds; if it does not, the runner
    marks the probe late and keeps serving the last good samples.
    """

    name: str = "probe"
    interval: float = 1.0
    deadline: float = 5.0

    def start(self) -> None:
        """Acquire what the probe needs; raise ProbeUnavailable with a reason if it cannot run."""

    @abc.abstractmethod
    def collect(self) -> Iterable[Sample]:
        """Read the current values. May raise ProbeUnavailable when the source went away."""

    def events(self) -> list[Event]:
        """Events seen since the last call (drained). Default: none."""
        return []

    def shutdown(self) -> None:
        """Release everything. Must be idempotent."""


@dataclass(frozen=True, slots=True)
class Finding:
    """A detector's judgement: what it saw, about which resource, how sure."""

    kind: str
    resource: str
    severity: str  # "info" | "warning" | "critical"
    summary: str
    attrs: Mapping[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)


class Detector(abc.ABC):
    name: str = "detector"
    interval: float = 0.0  # seconds between judgements; 0: every tick
    kinds: tuple[str, ...] = ()  # the finding kinds it reports: what `gpuwatch findings --kind` accepts
    # Probes whose series it judges, any one enough: with none of them up it is blind, and
    # `gpuwatch findings` says so rather than "no open findings".
    needs: tuple[str, ...] = ()

    @abc.abstractmethod
    def observe(self, history: "History") -> Iterable[Finding]:
        """Pure: read series from history, return the findings that hold now."""

    def samples(self, findings: "Sequence[Finding]") -> Iterable[Sample]:
        """The findings as registered metrics (for alert rules). Default: none."""
        return []


class Exporter(abc.ABC):
    name: str = "exporter"

    def start(self) -> None:
        """Open listeners or connections."""

    @abc.abstractmethod
    def publish(self, snapshot: "Snapshot") -> None:
        """Take a new snapshot. Must not block on the network."""

    def event(self, ev: Event) -> None:
        """Something that happened (a finding, an XID). Must not block. Default: ignored."""

    def shutdown(self) -> None:
        """Stop. Must be idempotent."""
