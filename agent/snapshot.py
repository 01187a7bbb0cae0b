"""Immutable snapshots: what exporters and the control socket read.

The runner builds a new Snapshot after each collection and swaps it in with one
reference assignment, so readers never lock and never see a half-built state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from gpuwatch.agent.api import Event, Finding, Sample


@dataclass(frozen=True, slots=True)
class ProbeStatus:
    name: str
    up: bool
    reason: str = ""  # why it is down or late, for a person
    state: str = "starting"  # starting | up | unavailable | failing | late
    last_duration: float = 0.0
    last_success: float = 0.0  # wall-clock time of the last good collection, 0 if never
    late_total: int = 0
    errors_total: int = 0
    interval: float = 0.0

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class Snapshot:
    ts: float
    samples: tuple[Sample, ...] = ()
    probes: Mapping[str, ProbeStatus] = field(default_factory=dict)
    events: tuple[Event, ...] = ()  # the most recent events, oldest first
    findings: tuple[Finding, ...] = ()

    def by_metric(self, metric: str) -> list[Sample]:
        return [s for s in self.samples if s.metric == metric]


EMPTY = Snapshot(ts=0.0)
