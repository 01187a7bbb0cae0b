"""The core types every probe, detector and exporter imports.

Kept deliberately small: a Sample is one value of one registered metric for one
resource at one time; an Event is something discrete that happened. Probes
produce both, detectors read history and emit findings, exporters translate a
Snapshot. Nothing here does I/O.
"""
from __future__ import annotations

import abc
import dataclasses
import time
from dataclasses import FrozenInstanceError, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping, Sequence, TypeVar

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


class Frozen:
    """Base of the classes made with `frozen` (the wire types, the configuration's sections): frozen
    dataclasses whose __init__, __eq__, __hash__, __repr__ and guard against assignment are these
    methods, shared, rather than generated for each class. Before Python 3.13, dataclasses compile
    each generated method with exec at import: six for each of the wire module's 46 classes were 25 ms
    of every CLI start on the CPU machine and 34 ms on the GPU node (docs/benchmarks.md)."""

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()
    _names: ClassVar[frozenset[str]] = frozenset()
    # (name, default, default factory, wire spec) of each field
    _init: ClassVar[tuple[tuple[str, Any, Any, Any], ...]] = ()
    _post_init: ClassVar[Any] = None  # the class's __post_init__, looked up once

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._init = None  # type: ignore[assignment]  # until `frozen` makes it

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        if cls._init is None:
            raise TypeError(f"{cls.__name__} is not made with api.frozen")
        if len(args) > len(cls._fields):
            raise TypeError(f"{cls.__name__}() takes {len(cls._fields)} positional arguments but {len(args)} were given")
        d = self.__dict__
        d.update(zip(cls._fields, args))
        if kwargs:
            if not kwargs.keys() <= cls._names or (args and d.keys() & kwargs.keys()):
                k = next(k for k in kwargs if k in d or k not in cls._names)
                problem = "multiple values for" if k in d else "an unexpected keyword"
                raise TypeError(f"{cls.__name__}() got {problem} argument {k!r}")
            d.update(kwargs)
        if len(d) < len(cls._fields):
            for name, default, factory, _ in cls._init:
                if name not in d:
                    if default is not dataclasses.MISSING:
                        d[name] = default
                    elif factory is not dataclasses.MISSING:
                        d[name] = factory()
                    else:
                        raise TypeError(f"{cls.__name__}() missing required argument: {name!r}")
        if cls._post_init is not None:
            cls._post_init(self)

    def _values(self) -> tuple:
        d = self.__dict__
        return tuple(d[name] for name in self._fields)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        d = self.__dict__
        return f"{type(self).__qualname__}({', '.join(f'{name}={d[name]!r}' for name in self._fields)})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")


F = TypeVar("F", bound=type)


def frozen(cls: F) -> F:
    """A `Frozen` subclass as a dataclass: its fields (dataclasses.fields, replace and asdict work)
    with Frozen's methods."""
    cls = dataclass(init=False, repr=False, eq=False)(cls)
    fields = dataclasses.fields(cls)
    cls._fields = tuple(f.name for f in fields)
    cls._names = frozenset(cls._fields)
    cls._post_init = getattr(cls, "__post_init__", None)
    cls._init = tuple((f.name, f.default, f.default_factory, f.metadata.get("wire")) for f in fields)
    return cls


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
