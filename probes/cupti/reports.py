"""The daemon's side of the in-process agents: their reports, checked, kept and turned into samples.

In-process agents (probes/cupti/inprocess.py) call the control method `cupti.report` every
interval with a report (probes/cupti/records.py describes it). The caller's process ID comes
from the kernel (SO_PEERCRED), never from the report, so a process can only speak for
itself; a report that does not parse is refused with the reason, and nothing else changes.
The reply tells the agent whether someone (`gpuwatch trace --pid`) wants continuous kernel
activity from it now.

`InProcessProbe` (name "cupti") exports what the reports say: per process the allocator's
white and grey bytes per GPU, per kernel the GPU time, launches, mean duration and
theoretical occupancy (the busiest kernels of the busiest processes; the rest folded into
"other"), and the agent's own health (records, drops, decode time, state).
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

from gpuwatch.agent.api import Probe, Sample

MAX_PROCESSES = 32
KERNELS_PER_PROCESS = 10
KEEP_AFTER_EXIT = 60.0  # seconds a finished process's last report stays readable (trace summaries)
STALE = 10.0  # a live process that stops reporting for this long is shown as not reporting
WATCH_SECONDS = 10.0  # continuous kernels are asked for this long after each trace poll
STATES = ("idle", "on", "yielded", "unavailable", "failed")
MAX_LABEL = 120


class ReportError(ValueError):
    """A report that does not parse; str() says what is wrong."""


def _num(obj: Any, key: str, where: str, integer: bool = False) -> float:
    v = obj.get(key, 0) if isinstance(obj, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ReportError(f"{where}.{key} must be a non-negative number, got {v!r}")
    return int(v) if integer else float(v)


def _process_label(name: str) -> str:
    """The name a process gave for itself, as the NVML and eBPF probes name the same process (its
    comm, sanitised): one `process` label value across probes, and nothing a client chose that
    could forge terminal output in `gpuwatch status` or break a label."""
    from gpuwatch.probes.nvml.probe import sanitise_process_name

    return sanitise_process_name(name) if name else "unknown"


def _printable(text: str) -> str:
    """A kernel name as the eBPF probe shows one: what is not printable (newlines, terminal escape
    sequences, lone surrogates) as "?", since it reaches findings and terminals."""
    return "".join(c if c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF else "?" for c in text)


def _str(obj: dict, key: str, where: str, limit: int = 512) -> str:
    v = obj.get(key, "")
    if not isinstance(v, str):
        raise ReportError(f"{where}.{key} must be a string, got {type(v).__name__}")
    return v[:limit]


def _list(obj: dict, key: str, limit: int) -> list:
    v = obj.get(key) or []
    if not isinstance(v, list):
        raise ReportError(f"{key} must be a list, got {type(v).__name__}")
    if len(v) > limit:
        raise ReportError(f"{key} has {len(v)} entries, at most {limit} are accepted")
    for i, item in enumerate(v):
        if not isinstance(item, dict):
            raise ReportError(f"{key}[{i}] must be an object")
    return v


@dataclass(frozen=True)
class Kernel:
    name: str
    device: int
    uuid: str
    launches: int
    gpu_seconds: float
    min_seconds: float
    max_seconds: float
    grid: tuple
    block: tuple
    registers: int
    static_shared_memory: int
    dynamic_shared_memory: int
    occupancy: float | None
    occupancy_limiter: str


@dataclass(frozen=True)
class Report:
    pid: int
    process: str
    uid: int  # the reporting process's user as the kernel said: who may read the report
    received: float
    started: float
    state: str
    reason: str
    mode: str
    observed_seconds: float
    records: int
    dropped: int
    decode_seconds: float
    kernels: tuple[Kernel, ...]
    other_launches: int
    other_gpu_seconds: float
    copies: tuple[dict, ...]
    memory: tuple[dict, ...]

    @classmethod
    def parse(cls, raw: Any, pid: int, received: float, uid: int = 0) -> "Report":
        if not isinstance(raw, dict):
            raise ReportError("a report must be a JSON object")
        if raw.get("version") != 1:
            raise ReportError(f"report version {raw.get('version')!r} is not supported (this agent reads 1)")
        cupti = raw.get("cupti")
        if not isinstance(cupti, dict):
            raise ReportError("report.cupti must be an object")
        state = _str(cupti, "state", "cupti")
        if state not in STATES:
            raise ReportError(f"cupti.state {state!r} is not one of {', '.join(STATES)}")
        kernels = []
        for i, k in enumerate(_list(raw, "kernels", 200)):
            where = f"kernels[{i}]"
            occ = k.get("occupancy")
            if occ is not None and (isinstance(occ, bool) or not isinstance(occ, (int, float))
                                    or not 0 <= occ <= 1):
                raise ReportError(f"{where}.occupancy must be a ratio from 0 to 1 or null, got {occ!r}")
            dims = []
            for key in ("grid", "block"):
                v = k.get(key) or [0, 0, 0]
                if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, int) and x >= 0 for x in v)):
                    raise ReportError(f"{where}.{key} must be three non-negative integers")
                dims.append(tuple(v))
            kernels.append(Kernel(
                _printable(_str(k, "name", where)), int(_num(k, "device", where, True)), _str(k, "uuid", where, 64),
                int(_num(k, "launches", where, True)), _num(k, "gpu_seconds", where),
                _num(k, "min_seconds", where), _num(k, "max_seconds", where), dims[0], dims[1],
                int(_num(k, "registers", where, True)), int(_num(k, "static_shared_memory", where, True)),
                int(_num(k, "dynamic_shared_memory", where, True)),
                None if occ is None else float(occ), _str(k, "occupancy_limiter", where, 32)))
        other = raw.get("kernels_other") or {}
        copies = tuple({"device": int(_num(c, "device", "copies", True)), "uuid": _str(c, "uuid", "copies", 64),
                        "kind": _str(c, "kind", "copies", 16), "count": int(_num(c, "count", "copies", True)),
                        "bytes": int(_num(c, "bytes", "copies", True)),
                        "gpu_seconds": _num(c, "gpu_seconds", "copies")}
                       for c in _list(raw, "copies", 64))
        memory = tuple({"device": int(_num(m, "device", "memory", True)), "uuid": _str(m, "uuid", "memory", 64),
                        "allocated": int(_num(m, "allocated", "memory", True)),
                        "reserved": int(_num(m, "reserved", "memory", True)), "ts": _num(m, "ts", "memory")}
                       for m in _list(raw, "memory", 64))
        return cls(pid=pid, uid=uid, process=_process_label(_str(raw, "process", "report", 64)), received=received,
                   started=_num(raw, "started", "report"), state=state, reason=_str(cupti, "reason", "cupti", 1024),
                   mode=_str(cupti, "mode", "cupti", 64), observed_seconds=_num(cupti, "observed_seconds", "cupti"),
                   records=int(_num(cupti, "records", "cupti", True)),
                   dropped=int(_num(cupti, "dropped", "cupti", True)),
                   decode_seconds=_num(cupti, "decode_seconds", "cupti"), kernels=tuple(kernels),
                   other_launches=int(_num(other, "launches", "kernels_other", True)),
                   other_gpu_seconds=_num(other, "gpu_seconds", "kernels_other"), copies=copies, memory=memory)

    def as_dict(self) -> dict:
        return {
            "pid": self.pid, "process": self.process, "received": self.received, "state": self.state,
            "reason": self.reason, "mode": self.mode, "observed_seconds": self.observed_seconds,
            "records": self.records, "dropped": self.dropped, "decode_seconds": self.decode_seconds,
            "kernels": [dict(k.__dict__, grid=list(k.grid), block=list(k.block)) for k in self.kernels],
            "kernels_other": {"launches": self.other_launches, "gpu_seconds": self.other_gpu_seconds},
            "copies": list(self.copies), "memory": list(self.memory),
        }


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


class InProcessReports:
    """The latest report of each in-process agent, and who is watching which process."""

    def __init__(self, clock=time.monotonic, alive=_alive) -> None:
        self._lock = threading.Lock()
        self._reports: dict[int, Report] = {}
        self._watch: dict[int, float] = {}  # pid -> monotonic time until which kernels are wanted
        self._clock = clock
        self._alive = alive
        self.refused = 0

    def accept(self, raw: Any, pid: int, uid: int = 0) -> dict:
        """Store a report from process `pid` of user `uid` (as the kernel named the caller).
        ReportError if bad."""
        try:
            report = Report.parse(raw, pid, time.time(), uid)
        except ReportError:
            self.refused += 1
            raise
        now = self._clock()
        with self._lock:
            self._reports[pid] = report
            until = self._watch.get(pid, 0.0)
        return {"detail_seconds": round(until - now, 1) if until > now else 0}

    def watch(self, pid: int, seconds: float = WATCH_SECONDS) -> None:
        with self._lock:
            self._watch[pid] = self._clock() + seconds

    def get(self, pid: int) -> Report | None:
        with self._lock:
            return self._reports.get(pid)

    def current(self) -> list[Report]:
        """Reports of processes alive (or gone for less than KEEP_AFTER_EXIT), dropping the rest."""
        now = time.time()
        with self._lock:
            for pid, r in list(self._reports.items()):
                if now - r.received > KEEP_AFTER_EXIT or (not self._alive(pid) and now - r.received > STALE):
                    del self._reports[pid]
                    self._watch.pop(pid, None)
            return list(self._reports.values())


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

    def collect(self) -> list[Sample]:
        reports = sorted(self.reports.current(),
                         key=lambda r: -(sum(k.gpu_seconds for k in r.kernels) + r.other_gpu_seconds))
        wall = time.time()
        names = self._names({k.name for r in reports for k in r.kernels})
        out: list[Sample] = []
        other = [0.0, 0]  # GPU seconds and launches folded into pid="other", kernel="other"
        for rank, r in enumerate(reports):
            proc = {"pid": str(r.pid), "process": r.process}
            for st in STATES:
                out.append(Sample("gpuwatch.cupti.state", 1.0 if r.state == st else 0.0, "", dict(proc, state=st), wall))
            out += [Sample("gpuwatch.cupti.observed", r.observed_seconds, "", proc, wall),
                    Sample("gpuwatch.cupti.records", float(r.records), "", proc, wall),
                    Sample("gpuwatch.cupti.records.dropped", float(r.dropped), "", proc, wall),
                    Sample("gpuwatch.cupti.decode.duration", r.decode_seconds, "", proc, wall)]
            for m in r.memory:
                if m["uuid"]:
                    out.append(Sample("gpuwatch.process.gpu.memory.allocated", float(m["allocated"]), m["uuid"],
                                      proc, m["ts"] or wall))
                    out.append(Sample("gpuwatch.process.gpu.memory.reserved", float(m["reserved"]), m["uuid"],
                                      proc, m["ts"] or wall))
            if rank >= MAX_PROCESSES:
                other[0] += sum(k.gpu_seconds for k in r.kernels) + r.other_gpu_seconds
                other[1] += sum(k.launches for k in r.kernels) + r.other_launches
                continue
            # One series per kernel name (variants of a name are summed), busiest first.
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
            rest = [r.other_gpu_seconds, r.other_launches]
            for i, (name, (secs, launches, occ, blocks)) in enumerate(ranked):
                if i >= KERNELS_PER_PROCESS:
                    rest[0] += secs
                    rest[1] += launches
                    continue
                out += self._kernel_samples(dict(proc, kernel=name), secs, launches, occ, wall)
                if blocks is not None:
                    out.append(Sample("gpuwatch.process.kernel.grid_blocks", float(blocks), "",
                                      dict(proc, kernel=name), wall))
            if rest[1]:
                out += self._kernel_samples(dict(proc, kernel="other"), rest[0], rest[1], None, wall)
        if other[1]:
            out += self._kernel_samples({"pid": "other", "process": "other", "kernel": "other"},
                                        other[0], other[1], None, wall)
        return out

    @staticmethod
    def _kernel_samples(labels: dict, secs: float, launches: int, occ: float | None, wall: float) -> list[Sample]:
        out = [Sample("gpuwatch.process.kernel.duration", secs, "", labels, wall),
               Sample("gpuwatch.process.kernel.launches", float(launches), "", labels, wall)]
        if launches:
            out.append(Sample("gpuwatch.process.kernel.mean_duration", secs / launches, "", labels, wall))
        if occ is not None:
            out.append(Sample("gpuwatch.process.kernel.theoretical_occupancy", occ, "", labels, wall))
        return out
