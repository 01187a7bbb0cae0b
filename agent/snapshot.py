"""Immutable snapshots: what exporters and the control socket read.

The runner builds a new Snapshot after each collection and swaps it in with one
reference assignment, so readers never lock and never see a half-built state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, TypeVar

from gpuwatch.agent.api import Event, Finding, Sample

T = TypeVar("T")

# Per-process series whose pids are GPU processes (NVML: a context on a GPU; eBPF: CUDA calls).
GPU_PROCESS_METRICS = frozenset({"gpuwatch.process.gpu.memory.usage", "gpuwatch.cuda.calls",
                                 "gpuwatch.process.cuda.memory.live"})


class Inventory:
    """The GPUs and GPU processes a snapshot names: what probes that follow other probes' output
    read (the host side of GPU processes, in-process reports, the reference workload), from the
    runner's latest snapshot. Each view is made on its first read, once per snapshot."""

    __slots__ = ("_samples", "_views")

    def __init__(self, samples: Sequence[Sample]) -> None:
        self._samples = samples
        self._views: dict[Callable, object] = {}

    def view(self, of: Callable[[Sequence[Sample]], T]) -> T:
        """of(the snapshot's samples), made once (a probe package's own view: reports.nvml_view)."""
        if of not in self._views:
            self._views[of] = of(self._samples)
        return self._views[of]  # type: ignore[return-value]

    @property
    def gpus(self) -> list[tuple[int, str]]:
        """(NVML index, UUID) of each GPU, in NVML's order ([] while the NVML probe is down)."""
        return self.view(_gpus)

    @property
    def gpu_processes(self) -> dict[int, str]:
        """pid -> process name of the processes with series of their own on a GPU (NVML's kept
        processes, eBPF's busiest): the processes the host-side probes read, under the same labels."""
        return dict(self.view(_gpu_processes))


def _gpus(samples: Sequence[Sample]) -> list[tuple[int, str]]:
    return sorted((int(s.labels.get("gpu_index", -1)), s.resource) for s in samples if s.metric == "gpuwatch.gpu")


def _gpu_processes(samples: Sequence[Sample]) -> dict[int, str]:
    out: dict[int, str] = {}
    for s in samples:
        if s.metric in GPU_PROCESS_METRICS and s.labels.get("pid", "").isdigit():
            out.setdefault(int(s.labels["pid"]), s.labels.get("process", ""))
    return out


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
    inventory: Inventory = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inventory", Inventory(self.samples))


EMPTY = Snapshot(ts=0.0)
