"""A late rank, named: the rank of an NCCL communicator that keeps the node's other ranks waiting.

From the eBPF probe's NCCL counters (probes/ebpf/nccl.py): per communicator, the collectives whose
entry times were compared across its ranks on this node, and per rank how many of them it entered
last and the sum of how long after the rank before it. Over the window, a rank that entered at
least `share` of the compared collectives last, by `min_lateness` seconds on average, is a
`straggler_rank` finding: the rank, its pid and process, its GPU (of those NVML lists it on, the one
it holds the most memory on), by
how much, and what its host side was doing meanwhile (the host probe's CPU time, CPU quota
throttling, major page faults, where it follows the process).

A balanced job has no such rank: each rank is last about 1/n of the time, by microseconds.
Counters are read as their increase (a reset — the agent or the job restarted — is no rise).

Pure: observe(history) reads series and returns findings.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from gpuwatch.agent.api import Detector, Finding, Sample
from gpuwatch.agent.history import History
from gpuwatch.agent.metrics import (
    NCCL_COLLECTIVES_COMPARED, NCCL_RANK_LAST, NCCL_RANK_LATENESS, NCCL_STRAGGLER_LATENESS,
    PROCESS_CGROUP_CPU_THROTTLED_TIME, PROCESS_CPU_TIME, PROCESS_GPU_MEMORY_USAGE, PROCESS_PAGING_FAULTS,
)
from gpuwatch.agent.registry import DetectorEntry

KIND = "straggler_rank"


def _rate(history: History, metric: str, pid: str, since: float, **labels: str) -> float | None:
    """The summed rate since `since` of a process's counter series with these labels; None when none
    has two points in the window. (since= hands over the point before the window too: each series'
    rate is over all the points it gives.)"""
    rates = [s.increase() / s.span for s in history.select(metric, since=since, pid=pid, **labels) if len(s) >= 2]
    return sum(rates) if rates else None


class StragglerDetector(Detector):
    name = "straggler"
    interval = 5.0
    kinds = (KIND,)
    needs = ("ebpf",)

    def __init__(self, window: float = 20.0, min_compared: int = 10, share: float = 0.75,
                 min_lateness: float = 0.005) -> None:
        self.window = window            # seconds of counters judged
        self.min_compared = min_compared  # collectives compared in the window, at least
        self.share = share              # of them entered last by this rank, at least
        self.min_lateness = min_lateness  # s after the rank before it, on average

    def observe(self, history: History) -> Iterable[Finding]:
        now = history.newest(NCCL_COLLECTIVES_COMPARED)
        if now is None:
            return []
        since = now - self.window
        compared = {}
        for s in history.select(NCCL_COLLECTIVES_COMPARED, since=since):
            if s and s.latest_ts > since:
                compared[s.labels["comm"]] = s.increase(since)
        lateness = {}
        for s in history.select(NCCL_RANK_LATENESS, since=since):
            lab = s.labels
            lateness[(lab["comm"], lab["rank"], lab["pid"])] = s.increase(since)
        out = []
        for s in history.select(NCCL_RANK_LAST, since=since):
            lab = s.labels
            comm, n = lab["comm"], compared.get(lab["comm"], 0.0)
            if n < self.min_compared or not s or s.latest_ts <= since:
                continue
            last = s.increase(since)
            if last <= 0 or last / n < self.share:
                continue
            mean = lateness.get((comm, lab["rank"], lab["pid"]), 0.0) / last
            if mean < self.min_lateness:
                continue
            out.append(self._finding(history, lab, n, last, mean, since, now))
        return out

    def _finding(self, history: History, lab: dict, compared: float, last: float, mean: float, since: float,
                 now: float) -> Finding:
        pid, rank = lab["pid"], lab["rank"]
        # its GPUs, the one it holds the most memory on first (NCCL's peer access puts a rank on its
        # peers' process lists too, with little memory)
        held = {s.gpu: s.latest for s in history.select(PROCESS_GPU_MEMORY_USAGE, since=since, pid=pid)
                if s.gpu and s and s.latest_ts > since}
        gpus = sorted(held, key=lambda g: (-held[g], g))
        host = {"cpu_seconds_per_second": _rate(history, PROCESS_CPU_TIME, pid, since),
                "throttled_seconds_per_second": _rate(history, PROCESS_CGROUP_CPU_THROTTLED_TIME, pid, since),
                "major_faults_per_second": _rate(history, PROCESS_PAGING_FAULTS, pid, since, type="major")}
        who = f"rank {rank}" if rank else "a rank"
        on = f" on GPU {', '.join(gpus)}" if gpus else ""
        process = lab.get("process", "")
        summary = (f"{who} of NCCL communicator {lab['comm']} (pid {pid}{', ' + process if process else ''}{on}) entered "
                   f"{last / compared:.0%} of the last {compared:.0f} collectives last, {mean * 1000:.1f} ms after "
                   f"the rank before it on average: the node's other ranks wait for it")
        doing = _host_words(host)
        if doing:
            summary += f"; meanwhile it {doing}"
        return Finding(KIND, gpus[0] if gpus else "", "warning", summary,
                       {"id": f"{lab['comm']}:{rank or pid}", "comm": lab["comm"], "rank": rank, "pid": pid,
                        "process": process, "gpus": gpus, "compared": compared, "entered_last": last,
                        "share": last / compared, "lateness_seconds": mean, "window_seconds": self.window,
                        "host": host}, ts=now)

    @staticmethod
    def samples(findings: Sequence[Finding]) -> list[Sample]:
        """The findings as metrics, for alert rules."""
        return [Sample(NCCL_STRAGGLER_LATENESS, f.attrs["lateness_seconds"], f.resource,
                       {"comm": f.attrs["comm"], "rank": f.attrs["rank"], "pid": f.attrs["pid"],
                        "process": f.attrs["process"]}, f.ts)
                for f in findings if f.kind == KIND]


def _host_words(host: dict) -> str:
    """What the host probe saw the process do, in words ("" when it does not follow it)."""
    words = []
    cpu, thr, faults = host["cpu_seconds_per_second"], host["throttled_seconds_per_second"], \
        host["major_faults_per_second"]
    if cpu is not None:
        words.append(f"used {cpu:.2f} CPU cores" + (" (CPU-bound)" if cpu >= 0.9 else ""))
    if thr:
        words.append(f"was throttled by its CPU quota {thr:.2f} s/s")
    if faults:
        words.append(f"made {faults:.0f} major page faults/s")
    return ", ".join(words)


DETECTOR = DetectorEntry(StragglerDetector.name, "", StragglerDetector.kinds, 60, lambda ctx: StragglerDetector())
