"""What the daemon builds, declared where it lives: each probe package names its probes in
`PROBES` (probes/*/__init__.py) and each detector module its detector in `DETECTOR`; the daemon
finds them and loops over them (agent/daemon.py entries()). A new probe or detector touches no
other file. In the core (docs/ARCHITECTURE.md): probes and detectors import these types.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatch.agent.api import Detector, Probe
    from gpuwatch.agent.budget import Budgets
    from gpuwatch.agent.config import Config
    from gpuwatch.agent.snapshot import Inventory
    from gpuwatch.agent.store import Store
    from gpuwatch.probes.cupti.reports import InProcessReports


@dataclass(frozen=True)
class Context:
    """What a factory gets besides the config: the daemon's shared objects, and the runner's latest
    inventory (a probe that follows another's output reads it there, never the other probe)."""

    cfg: Config
    store: Store | None
    inventory: Callable[[], Inventory]
    reports: InProcessReports  # what in-process agents report over the control socket
    budgets: Budgets
    allocators: Mapping[str, str]  # the pool allocators' names for people (ebpf.pool_libraries included)
    probes: list[Probe] = field(default_factory=list)  # those made before this one, in the runner's order


@dataclass(frozen=True)
class ProbeEntry:
    name: str  # the probe's name: gpuwatch_probe_up{probe}, `gpuwatch status`
    section: str  # its config section
    order: int  # its place among the runner's probes, and so in /metrics (agent/daemon.py lists the agent's own)
    make: Callable[[Context], Probe | None]  # None: the config leaves it off


@dataclass(frozen=True)
class DetectorEntry:
    name: str
    section: str  # the config section it reads, "" for none
    kinds: tuple[str, ...]  # the finding kinds it opens
    order: int  # its place among the runner's detectors
    make: Callable[[Context], Detector]
