"""The host side of GPU processes: what a GPU job waits on when its GPU waits on it.

For each process with series of its own on a GPU (the runner's inventory, agent/snapshot.py: NVML's kept
processes and eBPF's busiest), under the same pid/process labels as its GPU series:

  CPU time (user, system) and its rate; the busiest threads' rates (a saturated data-loading
  thread shows as one thread at ~1.0 while the process as a whole looks idle); resident and
  swapped-out memory; major and minor page faults; bytes read and written to storage; context
  switches; threads in uninterruptible sleep (D: waiting on disk); and from its cgroup (v2) the
  CPU quota's throttling (cpu.stat; v1's cpu controller too) and pressure stall time
  (cpu/io/memory.pressure).

psutil where it has the call (CPU times, RSS, context switches, I/O counters); /proc where it has
none (faults and per-thread CPU from .../stat, VmSwap from status) and the cgroup files. Every
read is bounded (processes per collection, threads per process) and a process that exits or is
replaced (its pid reused: the start time differs) mid-way starts afresh: no rate across two
processes, no negative rate. A failure to read is said once per kind, not every collection.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import psutil

from gpuwatch.agent.api import Probe, Sample
from gpuwatch.agent.logs import WarnOnce
from gpuwatch.probes.process.identity import read_stat, sanitise_process_name

log = logging.getLogger(__name__)

TICK = os.sysconf("SC_CLK_TCK")
PRESSURE = ("cpu", "io", "memory")
MAX_LINE = 4096  # bytes read of a cgroup or status file: they are a few lines


@dataclass
class _State:
    """What the last collection read of one process: the base of this one's rates."""

    start_time: int
    at: float  # monotonic seconds
    ticks: int  # user + system, clock ticks
    threads: dict[int, int] = field(default_factory=dict)  # tid -> its ticks
    cgroups: tuple[str, str] | None = None  # its cgroup v2 and v1 cpu directories ("": none we can read)


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_LINE).decode(errors="replace")
    except OSError:
        return None


def _kv(text: str | None) -> dict[str, int]:
    """ "key value" lines (cpu.stat) or "Key:  value kB" (status) as ints; what does not parse is left out."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def pressure_totals(text: str | None) -> dict[str, float]:
    """A PSI file ("some avg10=0.00 avg60=0.00 avg300=0.00 total=123") as {scope: stalled seconds}."""
    out: dict[str, float] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if parts and parts[0] in ("some", "full"):
            for p in parts[1:]:
                if p.startswith("total=") and p[6:].isdigit():
                    out[parts[0]] = int(p[6:]) / 1e6
    return out


def _under(root: str, rel: str) -> str:
    path = os.path.normpath(os.path.join(root, rel.lstrip("/")))
    # "/../.." (a cgroup namespace's view of another): not ours to read
    return path if path == root or path.startswith(root + "/") else ""


def cgroup_dirs(pid: int, proc: str, root: str) -> tuple[str, str]:
    """The process's cgroup v2 directory (its PSI and cpu.stat; under `root`, or `root`/unified on a
    hybrid v1/v2 host) and its cgroup v1 cpu controller directory (cpu.stat only); "" for none."""
    v2 = v1 = ""
    unified = root if os.path.exists(f"{root}/cgroup.controllers") else f"{root}/unified"
    for line in (_read(f"{proc}/{pid}/cgroup") or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = _under(unified, parts[2]) if os.path.isdir(unified) else ""
        elif "cpu" in parts[1].split(","):
            for mount in (parts[1], "cpu", "cpu,cpuacct"):
                if os.path.isdir(f"{root}/{mount}"):
                    v1 = _under(f"{root}/{mount}", parts[2])
                    break
    return v2, v1


class HostProcessProbe(Probe):
    name = "host"
    deadline = 5.0
    MAX_PROCESSES = 64  # per collection: the ones given first (the daemon gives the kept GPU processes)
    MAX_THREADS = 1024  # a process with more gets no per-thread reads (they would make a collection slow)
    TOP_THREADS = 3

    def __init__(self, processes: Callable[[], Mapping[int, str]], interval: float = 5.0, proc: str = "/proc",
                 cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.processes, self.interval, self.proc, self.cgroup_root = processes, interval, proc, cgroup_root
        self._state: dict[int, _State] = {}
        self._once = WarnOnce(log)  # each failing read said once

    def collect(self) -> list[Sample]:
        ts, now = time.time(), time.monotonic()
        given = list(self.processes().items())[:self.MAX_PROCESSES]
        out: list[Sample] = []
        for pid, name in given:
            try:
                out += self._process(pid, name or "unknown", ts, now)
            except (psutil.NoSuchProcess, ProcessLookupError):
                self._state.pop(pid, None)  # it exited mid-read: its series end with it
        wanted = {pid for pid, _ in given}
        for pid in list(self._state):
            if pid not in wanted:
                del self._state[pid]
        return out

    def _process(self, pid: int, name: str, ts: float, now: float) -> list[Sample]:
        st = read_stat(pid, self.proc)
        if st is None or st.exited:
            self._state.pop(pid, None)
            return []
        labels = {"pid": str(pid), "process": name}
        out: list[Sample] = []

        def add(metric: str, value: float, **extra: str) -> None:
            out.append(Sample(metric, float(value), "", dict(labels, **extra) if extra else labels, ts))

        p = psutil.Process(pid)
        with p.oneshot():
            cpu = p.cpu_times()
            add("gpuwatch.process.cpu.time", cpu.user, mode="user")
            add("gpuwatch.process.cpu.time", cpu.system, mode="system")
            add("gpuwatch.process.memory.rss", p.memory_info().rss)
            ctx = p.num_ctx_switches()
            add("gpuwatch.process.context_switches", ctx.voluntary, type="voluntary")
            add("gpuwatch.process.context_switches", ctx.involuntary, type="involuntary")
            try:
                io = p.io_counters()
                add("gpuwatch.process.disk.io", io.read_bytes, direction="read")
                add("gpuwatch.process.disk.io", io.write_bytes, direction="write")
            except (psutil.AccessDenied, AttributeError):
                self._once("io", "cannot read the I/O counters of GPU processes (/proc/PID/io needs root or the "
                                 "same user): gpuwatch_process_disk_io_bytes_total is left out")
        add("gpuwatch.process.paging.faults", st.major_faults, type="major")
        add("gpuwatch.process.paging.faults", st.minor_faults, type="minor")
        swap = _kv(_read(f"{self.proc}/{pid}/status")).get("VmSwap")
        if swap is not None:
            add("gpuwatch.process.memory.swap", swap * 1024)

        before = self._state.get(pid)
        if before is not None and before.start_time != st.start_time:
            before = None  # the pid names another process now
        ticks = st.user_ticks + st.system_ticks
        state = _State(st.start_time, now, ticks, cgroups=before.cgroups if before else None)
        if before is not None and now > before.at and ticks >= before.ticks:
            add("gpuwatch.process.cpu.utilization", (ticks - before.ticks) / TICK / (now - before.at))
        self._threads(pid, before, state, add)
        if state.cgroups is None:
            state.cgroups = cgroup_dirs(pid, self.proc, self.cgroup_root)
        self._cgroup(*state.cgroups, add)
        self._state[pid] = state
        return out

    def _threads(self, pid: int, before: _State | None, state: _State, add) -> None:
        task = f"{self.proc}/{pid}/task"
        try:
            tids = [int(t) for t in os.listdir(task) if t.isdigit()]
        except OSError:
            return
        if len(tids) > self.MAX_THREADS:
            self._once(f"threads:{pid}", "process %d has %d threads: its threads are not read one by one (over %d)",
                       pid, len(tids), self.MAX_THREADS)
            return
        blocked, busy = 0, []
        elapsed = state.at - before.at if before is not None else 0.0
        for tid in tids:
            t = read_stat(tid, task)
            if t is None:
                continue  # it ended between the listing and the read
            blocked += t.state == "D"
            ticks = t.user_ticks + t.system_ticks
            state.threads[tid] = ticks
            was = before.threads.get(tid) if before is not None else None
            if was is not None and elapsed > 0 and ticks >= was:
                busy.append(((ticks - was) / TICK / elapsed, tid, t.comm))
        add("gpuwatch.process.threads.blocked", blocked)
        for util, tid, comm in sorted(busy, reverse=True)[:self.TOP_THREADS]:
            add("gpuwatch.process.thread.cpu.utilization", util, tid=str(tid), thread=sanitise_process_name(comm))

    def _cgroup(self, v2: str, v1: str, add) -> None:
        # v2's cpu.stat only where v2 has the cpu controller (a hybrid host mounts v2 without it)
        on_v2 = v2 and "cpu" in (_read(f"{v2}/cgroup.controllers") or "").split()
        cpu = _kv(_read(f"{v2}/cpu.stat")) if on_v2 else {}
        if "throttled_usec" in cpu:
            add("gpuwatch.process.cgroup.cpu.throttled.time", cpu["throttled_usec"] / 1e6)
        elif v1:  # cgroup v1's cpu controller: throttled_time in nanoseconds
            cpu = _kv(_read(f"{v1}/cpu.stat"))
            if "throttled_time" in cpu:
                add("gpuwatch.process.cgroup.cpu.throttled.time", cpu["throttled_time"] / 1e9)
        if "nr_throttled" in cpu:
            add("gpuwatch.process.cgroup.cpu.throttled.periods", cpu["nr_throttled"])
        for resource in PRESSURE if v2 else ():
            for scope, seconds in pressure_totals(_read(f"{v2}/{resource}.pressure")).items():
                add("gpuwatch.process.cgroup.pressure.stall.time", seconds, resource=resource, scope=scope)
