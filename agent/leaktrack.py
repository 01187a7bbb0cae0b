"""The runner's leak and OOM bookkeeping: which findings are leak forecasts and which probe events
are evidence of an out-of-memory (agent/oom.py scores the one against the other)."""
from __future__ import annotations

from typing import Iterable

from gpuwatch.agent.api import Event, Finding
from gpuwatch.agent.oom import OomRecorder

LEAK_KIND = "memory_leak"  # detectors/leak.py KIND: the findings whose forecasts OOM events score
# Probes' evidence of an out-of-memory: turned into "finding.oom" events (or dropped as the same
# OOM), never passed on as they are.
OOM_EVIDENCE = {"cuda.oom": OomRecorder.driver_oom,  # eBPF: CUDA_ERROR_OUT_OF_MEMORY
                "framework.oom": OomRecorder.framework_oom}  # in-process agents' reports (probes/cupti)


class LeakTracker(OomRecorder):
    """An OomRecorder fed every probe event and every finding that opens, stays open or closes."""

    def event(self, ev: Event, wall: float) -> Event | None:
        """A probe's event as kept: OOM evidence scored (None: the same OOM again), any other as it is."""
        score = OOM_EVIDENCE.get(ev.kind)
        return ev if score is None else score(self, ev, wall)

    def closed(self, f: Finding, exited: bool, wall: float) -> None:
        """A finding closed (`exited`: because its process exited)."""
        if f.kind == LEAK_KIND:
            self.leak_closed(f, exited, wall)

    def open(self, findings: Iterable[Finding], wall: float) -> None:
        """The findings open after a pass, closed ones told first."""
        for f in findings:
            if f.kind == LEAK_KIND:
                self.leak_seen(f, wall)
