"""The agent's own GPU work: the processes it starts that hold a CUDA context (the CUPTI sampler,
the reference workload's child), so that nothing the agent judges counts them as a user's.

A probe that starts such a process says so through `own_processes()` (typed: pid + role) and
exports it as `gpuwatch.agent.gpu_process{pid, role}`; the baseline's busy check leaves these pids
out, the leak detector never makes one a suspect, `top` names them as the agent's. Nothing here
goes by a process's name: a user's process may call itself anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, runtime_checkable

from gpuwatch.agent.api import Sample

ROLES = ("cupti_sampler", "baseline")
METRIC = "gpuwatch.agent.gpu_process"
TITLES = {"cupti_sampler": "gpuwatch-sampler", "baseline": "gpuwatch-baseline"}


@dataclass(frozen=True)
class OwnProcess:
    pid: int
    role: str  # one of ROLES

    def __post_init__(self) -> None:
        if self.role not in ROLES or not isinstance(self.pid, int) or isinstance(self.pid, bool) or self.pid <= 0:
            raise ValueError(f"not an own process: pid {self.pid!r}, role {self.role!r}")


@runtime_checkable
class GpuTenant(Protocol):
    """A probe whose child holds a CUDA context and can step aside while a baseline run holds the GPU."""

    def own_processes(self) -> list[OwnProcess]: ...

    def pause(self, reason: str, timeout: float) -> bool: ...

    def resume(self) -> None: ...


def samples(own: Iterable[OwnProcess], ts: float) -> list[Sample]:
    return [Sample(METRIC, 1.0, labels={"pid": str(p.pid), "role": p.role}, ts=ts) for p in own]


def pids_in(history, now: float, stale: float) -> dict[str, str]:
    """pid (as the samples' label text) -> role of the agent's own GPU processes seen within `stale`
    seconds of `now` in a History."""
    return {s.labels["pid"]: s.labels["role"] for s in history.select(METRIC, since=now - stale)
            if s and now - s.latest_ts <= stale and s.labels.get("pid", "").isdigit() and s.labels.get("role") in ROLES}


def pids_of(samples_: Iterable[Sample]) -> dict[int, str]:
    """pid -> role from one snapshot's samples."""
    return {int(s.labels["pid"]): s.labels["role"] for s in samples_
            if s.metric == METRIC and s.labels.get("pid", "").isdigit() and s.labels.get("role") in ROLES}
