"""A GPU process waiting on its host: its GPU work fell (or stays low) while a host-side cause holds.

GPU work per GPU and process: NVML's process utilisation (gpuwatch.process.gpu.utilization), else
the rate of its CUDA driver calls (eBPF's gpuwatch.cuda.calls, summed over api). The last `recent`
seconds are judged against the `baseline` seconds before them. A fall alone is no finding (the job
may have finished a phase); a host-side cause alone is none either (a job whose files are evicted
while its GPU stays busy does not wait on them). Both at once are:

  page_cache_eviction  one of its large files lost its page-cache residency and it reads from storage
                       again (its disk reads, or its major faults, rose: a sequential reader of an
                       mmapped file makes few major faults, readahead brings the rest)
  swapping             its swapped-out memory grows and its major faults are high
  cpu_throttled        its cgroup's CPU quota throttles it
  input_thread         one of its threads keeps a core busy while the GPU waits (also with no fall:
                       GPU utilisation low all window long, the input-pipeline-bound training loop)
  memory_pressure      its cgroup's tasks stall on memory (PSI some)
  io_pressure          its cgroup's tasks stall on I/O (PSI some)

Each cause needs its own series: with fewer probes running, fewer findings, never wrong ones.
Host series have resource "" and the labels pid, process (probes/process/host.py). Counters are
read as rates over consecutive points; a drop (a reset) is skipped, not counted.

Pure: observe(history) reads series and returns findings; nothing here does I/O.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from gpuwatch.agent.api import Detector, Finding, Sample
from gpuwatch.agent.history import History, Series
from gpuwatch.agent.metrics import (
    CUDA_CALLS, HOST_BOUND_SUSPECTED, NODE_PROCESS_DISK_READ_RATE, PROCESS_CGROUP_CPU_THROTTLED_PERIODS,
    PROCESS_CGROUP_CPU_THROTTLED_TIME, PROCESS_CGROUP_PRESSURE_STALL_TIME, PROCESS_DISK_IO,
    PROCESS_FILE_CACHE_RESIDENT, PROCESS_FILE_SIZE, PROCESS_GPU_MEMORY_USAGE, PROCESS_GPU_UTILIZATION,
    PROCESS_MEMORY_SWAP, PROCESS_PAGING_FAULTS, PROCESS_THREAD_CPU_UTILIZATION,
)
from gpuwatch.agent.registry import DetectorEntry
from gpuwatch.agent.logs import fmt_bytes

KIND = "host_bound"
MIB = 1 << 20

# The order a finding names its causes in: the most specific first (an eviction also shows as
# I/O pressure, a throttled process as a busy thread).
CAUSES = ("page_cache_eviction", "swapping", "cpu_throttled", "input_thread", "memory_pressure", "io_pressure")
ADVICE = {
    "page_cache_eviction": "put the models on their own disk or in tmpfs, or lock them in memory (vmtouch -l, mlock)",
    "swapping": "give the job more host memory, or lower its host memory use (smaller prefetch, fewer workers)",
    "cpu_throttled": "raise the cgroup's CPU limit (the container's cpu limit, CPUQuota=)",
    "input_thread": "use more data-loader workers, pinned memory and prefetching",
    "memory_pressure": "raise the cgroup's memory limit or lower the job's host memory use",
    "io_pressure": "move its data to faster or less shared storage, or cache it in memory",
}


@dataclass(frozen=True)
class HostBoundSettings:
    recent: float = 30.0              # seconds judged (an eviction must be named within 30 s)...
    baseline: float = 300.0           # ...against the seconds before them
    stale: float = 30.0               # a GPU the process has had no memory on this long is not its GPU
    min_recent_points: int = 2        # NVML's per-process utilisation comes every 10 s (nvml.slow_interval)
    min_baseline_points: int = 6      # a minute of baseline at least
    # recent median under this x the baseline's: the GPU work fell (so a GPU still busy now, at 60 %
    # of its best or more, does not count as waiting on its host, whatever else holds)
    fall_ratio: float = 0.6
    min_busy_util: float = 0.3        # a baseline below this cannot fall far enough to tell
    # input_thread with no fall: utilisation under this all window long, the GPU mostly idle. A
    # serving loop copying pageable weights ran at 35-40 % on the H200 with its one thread at 100 %
    # (CUDA's copies and synchronisations spin on the CPU): a busy thread there is not an input pipeline.
    low_util: float = 0.25
    alive_util: float = 0.05          # ...but still running kernels (recent median at least this)
    min_call_rate: float = 10.0       # CUDA calls/s: a baseline under this says nothing about a fall
    resident_before: float = 0.8      # a file this resident in the baseline (fraction of its size)...
    resident_now: float = 0.5         # ...and this little now was evicted
    min_major_faults: float = 50.0    # major faults/s recently: pages read back from disk
    min_reread_rate: float = 16 * MIB  # bytes/s read from storage recently: an evicted file read again...
    reread_rise: float = 4.0          # ...at least this x the baseline's rate
    major_fault_rise: float = 2.0     # ...and at least this x the baseline's rate
    thread_busy: float = 0.9          # of one core: a saturated thread (recent median)
    throttled_rate: float = 0.1       # s/s throttled by the CPU quota
    throttled_periods_rate: float = 5.0  # periods/s throttled: more than half of the default 100 ms periods
    pressure_rate: float = 0.1        # s/s stalled (PSI some) on memory or I/O
    min_swap_growth: float = 64 * MIB # swapped out over the recent window
    probe_interval: float = 10.0      # seconds a node reader's rate stands for when it has no point before


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %"


def _count(x: float) -> str:
    return f"{x / 1000:.0f}k" if x >= 10_000 else f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


@dataclass(frozen=True)
class GpuWork:
    signal: str          # "utilization" or "cuda_calls"
    before: float        # baseline median utilisation, or calls/s
    now: float
    fell: bool
    steady_low: bool = False  # utilisation under low_util all window long, still running kernels


class HostBoundDetector(Detector):
    name = "host_bound"
    kinds = (KIND,)
    needs = ("nvml", "ebpf")
    interval = 5.0  # seconds between judgements: cheap, and a 30 s window needs a quick look

    def __init__(self, settings: HostBoundSettings | None = None) -> None:
        self.s = settings or HostBoundSettings()

    # --- reading the history ----------------------------------------------------------------

    @staticmethod
    def _by_pid(history: History, metric: str, since: float) -> dict[str, list[Series]]:
        """pid -> its series of a per-process host metric."""
        out: dict[str, list[Series]] = {}
        for ser in history.select(metric, since=since):
            if ser.labels.get("pid"):  # History's series always hold a point
                out.setdefault(ser.labels["pid"], []).append(ser)
        return out

    def _gpu_work(self, util: Series | None, calls: list[Series] | None, now: float) -> GpuWork | None:
        s = self.s
        r0, b0 = now - s.recent, now - s.recent - s.baseline
        if util:
            recent, base = util.values(r0, now), util.values(b0, r0)
            if len(recent) < s.min_recent_points or len(base) < s.min_baseline_points:
                return None
            before, cur = statistics.median(base), statistics.median(recent)
            fell = before >= s.min_busy_util and cur < s.fall_ratio * before
            steady = max(recent + base) < s.low_util and cur >= s.alive_util
            return GpuWork("utilization", before, cur, fell, steady)
        if calls:
            # the calls of every api, summed per point time (one eBPF collection writes them all)
            summed: defaultdict[float, float] = defaultdict(float)
            for ser in calls:
                for t, v in ser.points:
                    summed[t] += v
            total = Series(sorted(summed.items()))
            if len(total.values(r0, now)) < s.min_recent_points or len(total.values(b0, r0)) < s.min_baseline_points:
                return None
            before, cur = total.rate(b0, r0), total.rate(r0, now)
            if before is None or cur is None:
                return None
            fell = before >= s.min_call_rate and cur < s.fall_ratio * before
            return GpuWork("cuda_calls", before, cur, fell)
        return None

    # --- the causes ---------------------------------------------------------------------------

    def _eviction(self, pid: str, host: dict, now: float, major: tuple[float | None, float],
                  reads: tuple[float | None, float]) -> dict | None:
        s = self.s
        r0, b0 = now - s.recent, now - s.recent - s.baseline
        recent_faults, base_faults = major
        faulting = (recent_faults is not None and recent_faults >= s.min_major_faults
                    and recent_faults >= s.major_fault_rise * base_faults)
        recent_reads, base_reads = reads
        rereading = (recent_reads is not None and recent_reads >= s.min_reread_rate
                     and recent_reads >= s.reread_rise * base_reads)
        if not (faulting or rereading):
            return None
        sizes = {ser.labels["file"]: ser.latest for ser in host["size"].get(pid, [])}
        worst = None
        for ser in host["resident"].get(pid, []):
            lab = ser.labels
            size = sizes.get(lab["file"])
            base, recent = ser.values(b0, r0), ser.values(r0, now)
            if not size or not base or not recent:
                continue
            # the least resident it was in the window: the process refills what it reads, the evictor
            # takes it again, and a sample lands anywhere between the two
            before, cur = min(1.0, max(base) / size), min(recent) / size  # (resident counts whole pages)
            lost = (before - cur) * size
            if before >= s.resident_before and cur <= s.resident_now and (worst is None or lost > worst["lost_bytes"]):
                worst = {"file": lab["file"], "resident_before": before, "resident_now": cur,
                         "file_bytes": size, "lost_bytes": lost, "major_faults_per_second": recent_faults or 0.0,
                         "disk_read_bytes_per_second": recent_reads}
        if worst is None:
            return None
        # The likely evictor: the node's top reader over the same window, not the process itself.
        readers = []
        for ser in (item for items in host["readers"].values() for item in items):
            lab = ser.labels
            if lab["pid"] == pid:
                continue
            read, prev = 0.0, None
            for t, v in ser.points:
                if r0 < t <= now:
                    read += v * (t - prev if prev is not None else s.probe_interval)  # (a series' times rise)
                prev = t
            if read > 0:
                readers.append((read, lab["pid"], lab.get("process", "")))
        if readers:
            read, rpid, rname = max(readers)
            worst["evictor"] = {"pid": rpid, "process": rname, "read_bytes": read}
        return worst

    def _causes(self, pid: str, host: dict, work: GpuWork, now: float) -> dict[str, dict]:
        s = self.s
        r0, b0 = now - s.recent, now - s.recent - s.baseline
        found: dict[str, dict] = {}

        def rate(metric: str, want: Mapping[str, str] | None = None, t0: float = r0, t1: float = now) -> float | None:
            rates = [ser.rate(t0, t1) for ser in host[metric].get(pid, [])
                     if all(ser.labels.get(k) == v for k, v in (want or {}).items())]
            rates = [r for r in rates if r is not None]
            return sum(rates) if rates else None

        def usual(metric: str, want: Mapping[str, str]) -> float:
            """0 with no baseline: then any recent rate is a rise."""
            rates = [ser.typical_rate(b0, r0) for ser in host[metric].get(pid, [])
                     if all(ser.labels.get(k) == v for k, v in want.items())]
            return sum(r for r in rates if r is not None)

        # Recent: the mean rate (a rise shows as soon as it starts); before: the usual rate. On the
        # H200 a mean over the baseline that held the server's warm-up read (8 GiB) put an eviction's
        # 600 MiB/s under 4x it until the window held only eviction: named 30 s late, not 20 s.
        major = (rate("faults", {"type": "major"}), usual("faults", {"type": "major"}))
        reads = (rate("io", {"direction": "read"}), usual("io", {"direction": "read"}))
        if work.fell:
            ev = self._eviction(pid, host, now, major, reads)
            if ev is not None:
                found["page_cache_eviction"] = ev
            swaps = host["swap"].get(pid)
            if swaps and major[0] is not None and major[0] >= s.min_major_faults:
                pts = swaps[0].points
                start = [v for t, v in pts if t <= r0] or [pts[0][1]]
                growth = pts[-1][1] - start[-1]
                if growth >= s.min_swap_growth:
                    found["swapping"] = {"swap_growth_bytes": growth, "swap_bytes": pts[-1][1],
                                         "major_faults_per_second": major[0]}
            thr, periods = rate("throttled"), rate("periods")
            if (thr is not None and thr >= s.throttled_rate) or (periods is not None and periods >= s.throttled_periods_rate):
                found["cpu_throttled"] = {"throttled_seconds_per_second": thr, "throttled_periods_per_second": periods}
            for res in ("memory", "io"):
                stall = rate("pressure", {"resource": res, "scope": "some"})
                if stall is not None and stall >= s.pressure_rate:
                    found[f"{res}_pressure"] = {"stall_seconds_per_second": stall}
        if work.fell or work.steady_low:  # the GPU waits: is a thread of the process saturated meanwhile?
            busiest = None
            for ser in host["threads"].get(pid, []):
                lab, vals = ser.labels, ser.values(r0, now)
                if len(vals) >= s.min_recent_points:  # (a thread that has ended has no recent points)
                    m = statistics.median(vals)
                    if m >= s.thread_busy and (busiest is None or m > busiest["thread_cpu"]):
                        busiest = {"tid": lab["tid"], "thread": lab.get("thread", ""), "thread_cpu": m}
            if busiest is not None:
                found["input_thread"] = busiest
        return found

    # --- judging --------------------------------------------------------------------------------

    def observe(self, history: History) -> Iterable[Finding]:
        s = self.s
        # since=inf: each series' newest point only, not a copy of it all (as the leak detector reads "now")
        now = history.newest(PROCESS_GPU_UTILIZATION, CUDA_CALLS)
        if now is None:
            return []
        since = now - s.recent - s.baseline
        # per (gpu, pid): NVML's utilisation; per pid: eBPF's call counters (their GPU from NVML's memory)
        util: dict[tuple[str, str], tuple[str, Series]] = {}
        for ser in history.select(PROCESS_GPU_UTILIZATION, since=since):
            lab = ser.labels
            if ser.gpu and lab.get("pid") not in (None, "", "other"):
                util[(ser.gpu, lab["pid"])] = (lab.get("process", ""), ser)
        calls: dict[str, tuple[str, list[Series]]] = {}
        for ser in history.select(CUDA_CALLS, since=since):
            lab = ser.labels
            if lab.get("pid") not in (None, "", "other"):
                calls.setdefault(lab["pid"], (lab.get("process", ""), []))[1].append(ser)
        gpus_of: dict[str | None, set[str]] = {}
        for ser in history.select(PROCESS_GPU_MEMORY_USAGE, since=now - s.stale):
            # since= still hands over a series' newest point when it is older: a GPU it has left is not its GPU
            if ser.gpu and ser.latest_ts > now - s.stale:
                gpus_of.setdefault(ser.labels.get("pid"), set()).add(ser.gpu)
        targets: dict[tuple[str, str], tuple[str, Series | None, list[Series] | None]] = {
            key: (name, ser, None) for key, (name, ser) in util.items()}
        for pid, (name, series) in calls.items():
            for gpu in sorted(gpus_of.get(pid, ())):
                if (gpu, pid) not in targets:
                    targets[(gpu, pid)] = (name, None, series)
        if not targets:
            return []
        host = {key: self._by_pid(history, metric, since) for key, metric in (
            ("faults", PROCESS_PAGING_FAULTS), ("io", PROCESS_DISK_IO), ("size", PROCESS_FILE_SIZE),
            ("resident", PROCESS_FILE_CACHE_RESIDENT), ("swap", PROCESS_MEMORY_SWAP),
            ("throttled", PROCESS_CGROUP_CPU_THROTTLED_TIME), ("periods", PROCESS_CGROUP_CPU_THROTTLED_PERIODS),
            ("pressure", PROCESS_CGROUP_PRESSURE_STALL_TIME), ("threads", PROCESS_THREAD_CPU_UTILIZATION),
            ("readers", NODE_PROCESS_DISK_READ_RATE))}
        out = []
        for (gpu, pid), (name, upts, cpts) in sorted(targets.items()):
            work = self._gpu_work(upts, cpts, now)
            if work is None:
                continue  # too young to judge, or gone (no recent points)
            if not (work.fell or work.steady_low):
                continue
            causes = self._causes(pid, host, work, now)
            if not causes:
                continue
            cause = next(c for c in CAUSES if c in causes)
            out.append(self._finding(gpu, pid, name, work, cause, causes, now))
        return out

    def _finding(self, gpu: str, pid: str, name: str, work: GpuWork, cause: str, causes: dict, now: float) -> Finding:
        n = causes[cause]
        who = f"{name or 'process'} (pid {pid})"
        if cause == "page_cache_eviction":
            what = (f"page cache eviction of {n['file']}: {_pct(n['resident_before'])} -> {_pct(n['resident_now'])} "
                    "resident, " + (f"reading {fmt_bytes(n['disk_read_bytes_per_second'])}/s from storage, "
                                    if n.get("disk_read_bytes_per_second") else "")
                    + f"{_count(n['major_faults_per_second'])} major faults/s")
            if "evictor" in n:
                e = n["evictor"]
                what += (f"; {e['process'] or 'a process'} (pid {e['pid']}) read {fmt_bytes(e['read_bytes'])} "
                         f"in the last {self.s.recent:.0f} s")
        elif cause == "swapping":
            what = (f"swapping: {fmt_bytes(n['swap_growth_bytes'])} more swapped out in the last {self.s.recent:.0f} s "
                    f"({fmt_bytes(n['swap_bytes'])} in all), {_count(n['major_faults_per_second'])} major faults/s")
        elif cause == "cpu_throttled":
            thr, per = n["throttled_seconds_per_second"], n["throttled_periods_per_second"]
            what = "CPU quota throttling: " + ", ".join(
                x for x in ((f"{thr:.2f} s/s throttled" if thr is not None else ""),
                            (f"{per:.0f} throttled periods/s" if per is not None else "")) if x)
        elif cause == "input_thread":
            what = f"thread {n['thread'] or '?'} (tid {n['tid']}) keeps {_pct(n['thread_cpu'])} of a core busy"
        else:
            what = f"{cause.replace('_', ' ')}: its cgroup stalls {n['stall_seconds_per_second']:.2f} s/s"
        if work.signal == "utilization" and not work.fell:
            gpu_text = f"GPU utilisation of {who} stays at {_pct(work.now)}"
        elif work.signal == "utilization":
            gpu_text = f"GPU utilisation of {who} fell {_pct(work.before)} -> {_pct(work.now)}"
        else:
            gpu_text = f"CUDA calls of {who} fell {_count(work.before)}/s -> {_count(work.now)}/s"
        also = [c for c in CAUSES if c in causes and c != cause]
        summary = f"{what}; {gpu_text} on GPU {gpu}" + (f" (also {', '.join(also)})" if also else "") \
            + f": {ADVICE[cause]}"
        numbers = dict(n, gpu_work_signal=work.signal, gpu_work_before=work.before, gpu_work_now=work.now)
        return Finding(KIND, gpu, "warning", summary, {
            "id": cause, "pid": pid, "process": name, "cause": cause, "numbers": numbers,
            "advice": ADVICE[cause], "causes": {c: causes[c] for c in CAUSES if c in causes},
            "window_seconds": self.s.recent, "baseline_seconds": self.s.baseline}, ts=now)

    @staticmethod
    def samples(findings: Sequence[Finding]) -> list[Sample]:
        """The findings as metrics, for alert rules."""
        return [Sample(HOST_BOUND_SUSPECTED, 1.0, f.resource,
                       {"pid": str(f.attrs["pid"]), "process": f.attrs["process"], "cause": f.attrs["cause"]}, f.ts)
                for f in findings if f.kind == KIND]


DETECTOR = DetectorEntry(HostBoundDetector.name, "", HostBoundDetector.kinds, 50, lambda ctx: HostBoundDetector())
