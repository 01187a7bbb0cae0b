"""The daemon's side of the in-process agents: their reports, checked, kept and turned into samples.

In-process agents (probes/cupti/inprocess.py) call the control method `cupti.report` every
interval; the control server has parsed the report into a `wire.CuptiReport` (the one validator)
before it gets here. A report is the client's word about its CUDA work and nothing more: what the
server can know it takes from the kernel and NVML, never from the report —

- who: the caller's pid from SO_PEERCRED; its name (`/proc/PID/comm`) and start time from /proc.
  Reports are keyed by (pid, start time), so a reused pid is a new process;
- when: the time of receipt (the client's `ts` and `started` are at most ordering hints);
- where: a memory entry counts only for a GPU NVML knows, and only as *verified* for a GPU NVML
  lists the process on. Where NVML cannot list the GPU's processes (per-process info unsupported,
  processes folded beyond its cap, or its pids are not in our PID namespace) the entry is kept as
  *self-reported*: exported under metrics of its own that no detector or alert rule reads.
  Where NVML lists the GPU's processes and this one is not among them, the entry is dropped.
  An entry names its GPU by the UUID the process's CUDA gave for the device (the in-process agent
  asks CUDA, so CUDA_VISIBLE_DEVICES's renumbering is the process's own); one that came with the
  device's ordinal only is named from the process's CUDA_VISIBLE_DEVICES (`devices`,
  probes/process/cuda_devices.py), or not at all where that is not sure. A UUID the process gave
  is never replaced by what its environment says: it is the better word.

A report may also say its framework raised an out-of-memory error (`oom`: which framework, caught
by nobody or seen by PyTorch's allocator, the device and bytes asked for, and a count that rises
with each). The server makes a "framework.oom" event of a rise — its pid and name from the kernel,
its time its own, its GPU the device's entry when NVML lists the process there — at most one per
process every OOM_EVENT_INTERVAL, taken before the rate limit below (the report an OOM'd program
sends as it exits must not be dropped for coming soon after the last), and the runner scores it
against the leak forecast (agent/oom.py).

What each user can make the agent hold is bounded: MAX_REPORTERS_PER_USER processes per uid,
MAX_REPORTERS in all, one report per process every MIN_REPORT_INTERVAL (faster ones are dropped,
the reply is the same). Refusals and drops are counted per cause
(`gpuwatch_cupti_reports_refused_total`, `gpuwatch_cupti_memory_refused_total`) and logged once
per cause. The reply tells the agent whether someone (`gpuwatch trace --pid`) wants continuous
kernel activity from it now.

`InProcessProbe` (name "cupti") exports what the reports say: per process the allocator's
white and grey bytes per GPU, per kernel the GPU time, launches, mean duration and
theoretical occupancy (the busiest kernels of the busiest processes; the rest folded into
"other"), and the agent's own health (records, drops, decode time, state).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from gpuwatch.agent import wire
from gpuwatch.agent.api import Event, Probe, Sample
from gpuwatch.agent.events import EventQueue
from gpuwatch.probes.process.identity import ProcessIdentity, identify

log = logging.getLogger("gpuwatch.cupti")

MAX_PROCESSES = 32  # processes with series of their own on /metrics; the rest fold into pid="other"
KERNELS_PER_PROCESS = 10
MAX_REPORTERS_PER_USER = 16
MAX_REPORTERS = 256
MIN_REPORT_INTERVAL = 0.1  # seconds between two kept reports of one process: half the shortest
# interval an in-process agent reports at (0.2 s), so an honest one's jitter never trips it
KEEP_AFTER_EXIT = 60.0  # seconds a finished process's last report stays readable (trace summaries)
STALE = 10.0  # a live process that stops reporting for this long is shown as not reporting
WATCH_SECONDS = 10.0  # continuous kernels are asked for this long after each trace poll
STATES = wire.CUPTI_STATES
OOM_EVENT_INTERVAL = 60.0  # seconds: one OOM event per process at most this often (agent/oom.py SAME_OOM_S)
MAX_EVENTS = 256  # OOM events not yet drained by the runner; more are dropped and counted
MAX_LABEL = 120
REFUSED = ("too_often", "user_limit", "total_limit", "unknown_process")
MEMORY_REFUSED = ("unknown_gpu", "not_on_gpu")
OTHER = {"pid": "other", "process": "other"}

# uuid -> the pids NVML lists on that GPU, or None where NVML cannot say (see nvml_view).
NvmlView = Mapping[str, "frozenset[int] | None"]


class ReportError(ValueError):
    """A report the agent will not keep; str() says why."""


def nvml_view(samples: Iterable[Sample], exists: Callable[[int], bool] | None = None) -> dict:
    """NVML's view of the GPUs from the NVML probe's samples (NvmlView): each GPU it knows, with the
    pids it lists there, or None where that list cannot be checked against: NVML does not list the
    GPU's processes (not supported, the GPU lost), folded some beyond its cap, charged some no
    memory, or lists pids none of which is a process here (the agent runs in another PID
    namespace than the GPU's processes)."""
    exists = exists or (lambda pid: os.path.exists(f"/proc/{pid}"))
    gpus: set[str] = set()
    counted: dict[str, float] = {}
    listed: dict[str, set[int]] = {}
    folded: set[str] = set()
    for s in samples:
        if s.metric == "gpuwatch.gpu.up":
            gpus.add(s.resource)
        elif s.metric == "gpuwatch.gpu.processes":
            counted[s.resource] = counted.get(s.resource, 0.0) + s.value
        elif s.metric == "gpuwatch.process.gpu.memory.usage":
            pid = s.labels.get("pid", "")
            if pid.isdigit():
                listed.setdefault(s.resource, set()).add(int(pid))
            else:
                folded.add(s.resource)
    view: dict[str, frozenset[int] | None] = {}
    for uuid in gpus:
        pids = listed.get(uuid, set())
        unsure = (uuid not in counted or uuid in folded or len(pids) < counted[uuid]
                  or (pids and not any(exists(p) for p in pids)))
        view[uuid] = None if unsure else frozenset(pids)
    return view


@dataclass(frozen=True)
class Memory:
    """The allocator's bytes on one GPU. verified: NVML lists the process on that GPU; otherwise
    self-reported (kept out of the series detectors and alert rules read)."""

    uuid: str
    device: int
    allocated: int
    reserved: int
    verified: bool
    frameworks: tuple[str, ...] = ()


@dataclass(frozen=True)
class Report:
    pid: int
    start_time: int
    process: str  # from /proc/PID/comm, sanitised as the other probes name processes
    uid: int  # the reporting process's user as the kernel said: who may read the report
    received: float  # wall time of receipt: the time of every sample from this report
    cupti: wire.ReportCupti
    kernels: tuple  # of wire.ReportKernel
    kernels_other: wire.ReportKernelsOther
    copies: tuple  # of wire.ReportCopy
    memory: tuple[Memory, ...]

    @classmethod
    def build(cls, msg: wire.CuptiReport, who: ProcessIdentity, uid: int, received: float,
              view: NvmlView, devices: "Callable[[], Sequence[str]] | None" = None) -> tuple["Report", Counter]:
        """The report as the server knows it, and the memory entries dropped by cause. devices():
        NVML's UUID of each of the process's CUDA ordinals from its environment, asked only for an
        entry that came without a UUID."""
        dropped: Counter = Counter()
        latest: dict[str, wire.ReportMemory] = {}
        table: Sequence[str] | None = None
        for m in msg.memory:
            uuid = m.uuid
            if not uuid and devices is not None:
                table = devices() if table is None else table
                uuid = table[m.device] if m.device < len(table) else ""
            if uuid not in view:
                dropped["unknown_gpu"] += 1
            elif uuid not in latest or m.ts >= latest[uuid].ts:  # the client's ts orders its own entries
                latest[uuid] = m
        memory = []
        for uuid, m in latest.items():
            pids = view[uuid]
            if pids is not None and who.pid not in pids:
                dropped["not_on_gpu"] += 1
            else:
                memory.append(Memory(uuid, m.device, m.allocated, m.reserved, verified=pids is not None,
                                     frameworks=m.frameworks))
        return cls(pid=who.pid, start_time=who.start_time, process=who.comm, uid=uid,
                   received=received, cupti=msg.cupti, kernels=msg.kernels, kernels_other=msg.kernels_other,
                   copies=msg.copies, memory=tuple(memory)), dropped

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.start_time

    @property
    def verified(self) -> bool:
        return any(m.verified for m in self.memory)

    @property
    def gpu_seconds(self) -> float:
        return sum(k.gpu_seconds for k in self.kernels) + self.kernels_other.gpu_seconds

    def as_dict(self) -> dict:
        c = self.cupti
        return {
            "pid": self.pid, "process": self.process, "received": self.received, "state": c.state,
            "reason": c.reason, "mode": c.mode, "observed_seconds": c.observed_seconds,
            "records": c.records, "dropped": c.dropped, "decode_seconds": c.decode_seconds,
            "kernels": [k.to_json() for k in self.kernels],
            "kernels_other": {"launches": self.kernels_other.launches,
                              "gpu_seconds": self.kernels_other.gpu_seconds},
            "copies": [c.to_json() for c in self.copies],
            "memory": [{"device": m.device, "uuid": m.uuid, "allocated": m.allocated, "reserved": m.reserved,
                        "self_reported": not m.verified, "frameworks": list(m.frameworks)} for m in self.memory],
        }


class InProcessReports:
    """The latest report of each in-process agent, and who is watching which process: the one
    owner of both. `gpus` returns NVML's view now (NvmlView; the daemon reads the runner's
    snapshot)."""

    def __init__(self, gpus: Callable[[], NvmlView] = dict, clock=time.monotonic, wallclock=time.time,
                 identify: Callable[[int], ProcessIdentity | None] = identify,
                 devices: Callable[[int], Sequence[str]] = lambda pid: ()) -> None:
        """devices(pid): NVML's UUID of each CUDA ordinal of process pid, from its environment
        (probes/process/cuda_devices.visible_uuids; the daemon's), for what comes without a UUID."""
        self._lock = threading.Lock()
        self._reports: dict[tuple[int, int], Report] = {}
        self._watch: dict[tuple[int, int], float] = {}  # key -> monotonic time until which kernels are wanted
        self._gpus = gpus
        self._clock = clock
        self._wall = wallclock
        self._identify = identify
        self._devices = devices
        self._tables: dict[tuple[int, int], tuple[str, ...]] = {}  # key -> devices(pid), read once: pruned with the reports
        self.refused: Counter = Counter()  # reports, by cause (REFUSED)
        self.memory_refused: Counter = Counter()  # memory entries, by cause (MEMORY_REFUSED)
        self._logged: set[str] = set()
        # key -> (the highest OOM count seen, monotonic time of its last OOM event): pruned with the reports
        self._ooms: dict[tuple[int, int], tuple[int, float]] = {}
        self.oom_events = EventQueue(MAX_EVENTS)  # "framework.oom"

    def _count(self, counter: Counter, cause: str, n: int, what: str) -> None:
        counter[cause] += n
        if cause not in self._logged:  # once per cause: a flood must not become a flood of log lines
            self._logged.add(cause)
            log.warning('%s (counted in gpuwatch_cupti_%s_refused_total{reason="%s"}; not logged again)', what,
                        "reports" if counter is self.refused else "memory", cause)

    def _refuse(self, cause: str, message: str) -> ReportError:
        self._count(self.refused, cause, 1, f"in-process report refused: {message}")
        return ReportError(message)

    def accept(self, msg: wire.CuptiReport, pid: int, uid: int, who: ProcessIdentity | None = None) -> dict:
        """Keep a report from process `pid` of user `uid` (as the kernel named the caller); `who`:
        that process as the control server identified it at accept (and found alive before this
        request), else read now. ReportError when it is not kept and the agent should know why."""
        received = self._wall()
        if who is None:
            who = self._identify(pid)
        if who is None:
            raise self._refuse("unknown_process", f"process {pid} is gone")
        view = self._gpus()
        now = self._clock()
        with self._lock:
            last = self._reports.get((who.pid, who.start_time))
            if last is None:
                self._prune(received)
                if len(self._reports) >= MAX_REPORTERS:
                    raise self._refuse("total_limit", f"the agent keeps reports of {MAX_REPORTERS} processes "
                                                      "already")
                if sum(1 for r in self._reports.values() if r.uid == uid) >= MAX_REPORTERS_PER_USER:
                    raise self._refuse("user_limit", f"the agent keeps reports of {MAX_REPORTERS_PER_USER} "
                                                     f"processes of user {uid} already")
            too_often = last is not None and 0 <= received - last.received < MIN_REPORT_INTERVAL
            report = None
            if too_often:
                self._count(self.refused, "too_often", 1, f"in-process reports of process {pid} dropped: more "
                            f"than one every {MIN_REPORT_INTERVAL:g} s")
            else:
                report, dropped = Report.build(msg, who, uid, received, view, lambda: self._table(who))
                for cause, n in dropped.items():
                    why = "a GPU NVML does not know" if cause == "unknown_gpu" else "a GPU NVML does not list it on"
                    self._count(self.memory_refused, cause, n, f"memory entries of process {pid} dropped: {why}")
                self._reports[report.key] = report
            if msg.oom is not None:  # a report dropped above still tells of its OOM
                self._oom(msg.oom, who, received, now, report or last, view)
            until = self._watch.get((who.pid, who.start_time), 0.0)
        return {"detail_seconds": round(until - now, 1) if until > now else 0}

    def _oom(self, oom: wire.ReportOom, who: ProcessIdentity, received: float, now: float,
             report: Report | None, view: NvmlView) -> None:
        """A rise of the report's OOM count is an OOM: a "framework.oom" event, one per process every
        OOM_EVENT_INTERVAL at most. Its GPU: the device's memory entry NVML vouches for; without
        one, the device named from the process's environment where NVML lists it there. Lock held."""
        key = (who.pid, who.start_time)
        count, last_event = self._ooms.get(key, (0, float("-inf")))
        if oom.count <= count:
            return
        if now - last_event < OOM_EVENT_INTERVAL:
            self._ooms[key] = (oom.count, last_event)  # the same OOM's retries, or a flood: no event
            return
        self._ooms[key] = (oom.count, now)
        gpu = next((m.uuid for m in (report.memory if report else ()) if m.verified and m.device == oom.device), "")
        if not gpu and oom.device is not None:
            table = self._table(who)
            named = table[oom.device] if oom.device < len(table) else ""
            pids = view.get(named)
            gpu = named if pids is not None and who.pid in pids else ""
        self.oom_events.put(Event("framework.oom", gpu, {
            "pid": str(who.pid), "process": who.comm, "framework": oom.framework, "how": oom.how,
            "device": oom.device, "requested_bytes": oom.requested_bytes}, received))

    def _table(self, who: ProcessIdentity) -> tuple[str, ...]:
        """devices(pid) of the process, read once: the environment it was started with does not
        change, and a report every 0.1 s must not read it every time. Lock held."""
        key = (who.pid, who.start_time)
        if key not in self._tables:
            self._tables[key] = tuple(self._devices(who.pid))[:wire.MAX_GPUS]
        return self._tables[key]

    def events(self) -> list[Event]:
        return self.oom_events.drain()

    def watch(self, report: Report, seconds: float = WATCH_SECONDS) -> None:
        with self._lock:
            self._watch[report.key] = self._clock() + seconds

    def get(self, pid: int) -> Report | None:
        """The report of the process that has pid `pid` now; when none has, the last report of the
        process that had it (gone, kept a while for trace summaries). Never a former owner's report
        for the pid's new owner."""
        who = self._identify(pid)
        with self._lock:
            if who is not None:
                return self._reports.get((pid, who.start_time))
            gone = [r for r in self._reports.values() if r.pid == pid]
            return max(gone, key=lambda r: r.received) if gone else None

    def _alive(self, r: Report) -> bool:
        who = self._identify(r.pid)
        return who is not None and who.start_time == r.start_time

    def _prune(self, now: float) -> None:
        """Drop reports of processes gone for STALE seconds, or silent for KEEP_AFTER_EXIT. Lock held."""
        for key, r in list(self._reports.items()):
            age = now - r.received
            if age > KEEP_AFTER_EXIT or (age > STALE and not self._alive(r)):
                del self._reports[key]
                self._watch.pop(key, None)
                self._ooms.pop(key, None)
                self._tables.pop(key, None)

    def current(self) -> list[Report]:
        """Reports of processes alive (or gone for less than STALE), dropping the rest."""
        with self._lock:
            self._prune(self._wall())
            return list(self._reports.values())

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.refused), dict(self.memory_refused)


def _label(name: str) -> str:
    return name if len(name) <= MAX_LABEL else name[:MAX_LABEL - 1] + "…"


class InProcessProbe(Probe):
    """Samples from the in-process agents' reports. Reads memory only: never blocks on a process."""

    name = "cupti"

    def __init__(self, reports: InProcessReports, interval: float = 1.0, demangle=None) -> None:
        self.reports = reports
        self.interval = interval
        self._demangle = demangle

    def _names(self, names: Iterable[str]) -> dict[str, str]:
        names = list(names)
        if self._demangle is None:
            from gpuwatch.probes.ebpf.driver_names import demangle
            self._demangle = demangle
        return self._demangle(names)

    def events(self) -> list[Event]:
        """Out-of-memory errors the in-process agents reported ("framework.oom"), since the last call."""
        return self.reports.events()

    def collect(self) -> list[Sample]:
        wall = time.time()  # before the reports are read: a report received later is newer than it
        # Processes NVML vouches for first: their series feed the leak detector, and a busier claim
        # must not fold them away; then the busiest.
        reports = sorted(self.reports.current(), key=lambda r: (not r.verified, -r.gpu_seconds, r.pid))
        own, rest = reports[:MAX_PROCESSES], reports[MAX_PROCESSES:]
        names = self._names({k.name for r in own for k in r.kernels})
        out: list[Sample] = []
        for r in own:
            proc = {"pid": str(r.pid), "process": r.process}
            out += self._agent_samples(proc, {st: float(r.cupti.state == st) for st in STATES}, r.cupti, r.received)
            for m in r.memory:
                out += self._memory_samples(m.verified, m.uuid, proc, m.allocated, m.reserved, r.received)
            out += self._kernels(r, proc, names)
        # The rest folded: their states counted, their counters and bytes summed; verified bytes
        # stay per process (bounded by what NVML lists), the leak detector reads them.
        if rest:
            states = {st: float(sum(r.cupti.state == st for r in rest)) for st in STATES}
            total = wire.ReportCupti(state="idle", observed_seconds=sum(r.cupti.observed_seconds for r in rest),
                                     records=sum(r.cupti.records for r in rest),
                                     dropped=sum(r.cupti.dropped for r in rest),
                                     decode_seconds=sum(r.cupti.decode_seconds for r in rest))
            out += self._agent_samples(OTHER, states, total, wall)
            folded: dict[str, list[int]] = {}
            for r in rest:
                for m in r.memory:
                    if m.verified:
                        out += self._memory_samples(True, m.uuid, {"pid": str(r.pid), "process": r.process},
                                                    m.allocated, m.reserved, r.received)
                    else:
                        acc = folded.setdefault(m.uuid, [0, 0])
                        acc[0] += m.allocated
                        acc[1] += m.reserved
            for uuid, (allocated, reserved) in sorted(folded.items()):
                out += self._memory_samples(False, uuid, OTHER, allocated, reserved, wall)
            secs = sum(r.gpu_seconds for r in rest)
            launches = sum(sum(k.launches for k in r.kernels) + r.kernels_other.launches for r in rest)
            if launches:
                out += self._kernel_samples(dict(OTHER, kernel="other"), secs, launches, None, wall)
        refused, memory_refused = self.reports.counts()
        out += [Sample("gpuwatch.cupti.reports.refused", float(refused.get(c, 0)), "", {"reason": c}, wall)
                for c in REFUSED]
        out += [Sample("gpuwatch.cupti.memory.refused", float(memory_refused.get(c, 0)), "", {"reason": c}, wall)
                for c in MEMORY_REFUSED]
        out.append(Sample("gpuwatch.probe.events.dropped", float(self.reports.oom_events.dropped), "",
                          {"probe": self.name}, wall))
        return out

    @staticmethod
    def _agent_samples(proc: dict, states: dict[str, float], c: wire.ReportCupti, ts: float) -> list[Sample]:
        out = [Sample("gpuwatch.cupti.state", v, "", dict(proc, state=st), ts) for st, v in states.items()]
        return out + [Sample("gpuwatch.cupti.observed", c.observed_seconds, "", proc, ts),
                      Sample("gpuwatch.cupti.records", float(c.records), "", proc, ts),
                      Sample("gpuwatch.cupti.records.dropped", float(c.dropped), "", proc, ts),
                      Sample("gpuwatch.cupti.decode.duration", c.decode_seconds, "", proc, ts)]

    @staticmethod
    def _memory_samples(verified: bool, uuid: str, proc: dict, allocated: int, reserved: int,
                        ts: float) -> list[Sample]:
        # Self-reported bytes under metrics of their own: the leak detector and alert rules read
        # only what NVML vouches for.
        suffix = "" if verified else ".self_reported"
        return [Sample("gpuwatch.process.gpu.memory.allocated" + suffix, float(allocated), uuid, proc, ts),
                Sample("gpuwatch.process.gpu.memory.reserved" + suffix, float(reserved), uuid, proc, ts)]

    def _kernels(self, r: Report, proc: dict, names: dict[str, str]) -> list[Sample]:
        """One series per kernel name (variants of a name are summed), busiest first."""
        out: list[Sample] = []
        by_name: dict[str, list] = {}
        for k in r.kernels:
            acc = by_name.setdefault(_label(names.get(k.name, k.name)), [0.0, 0, None, None])
            acc[0] += k.gpu_seconds
            acc[1] += k.launches
            if k.occupancy is not None and (acc[2] is None or k.gpu_seconds > 0):
                acc[2] = k.occupancy if acc[2] is None else min(acc[2], k.occupancy)
            blocks = k.grid[0] * k.grid[1] * k.grid[2]
            if blocks:
                acc[3] = blocks if acc[3] is None else min(acc[3], blocks)
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
        rest = [r.kernels_other.gpu_seconds, r.kernels_other.launches]
        for i, (name, (secs, launches, occ, blocks)) in enumerate(ranked):
            if i >= KERNELS_PER_PROCESS:
                rest[0] += secs
                rest[1] += launches
                continue
            out += self._kernel_samples(dict(proc, kernel=name), secs, launches, occ, r.received)
            if blocks is not None:
                out.append(Sample("gpuwatch.process.kernel.grid_blocks", float(blocks), "",
                                  dict(proc, kernel=name), r.received))
        if rest[1]:
            out += self._kernel_samples(dict(proc, kernel="other"), rest[0], rest[1], None, r.received)
        return out

    @staticmethod
    def _kernel_samples(labels: dict, secs: float, launches: int, occ: float | None, ts: float) -> list[Sample]:
        out = [Sample("gpuwatch.process.kernel.duration", secs, "", labels, ts),
               Sample("gpuwatch.process.kernel.launches", float(launches), "", labels, ts)]
        if launches:
            out.append(Sample("gpuwatch.process.kernel.mean_duration", secs / launches, "", labels, ts))
        if occ is not None:
            out.append(Sample("gpuwatch.process.kernel.theoretical_occupancy", occ, "", labels, ts))
        return out
