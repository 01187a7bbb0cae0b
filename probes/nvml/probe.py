"""The NVML probe: per-GPU identity, health, clocks, power, memory, processes and GPM activity.

Every value goes out in base units under a name from agent/metrics.py. Cadence follows what the
calls cost (measured on the H200): fast ops (~2-30 us) every tick; slow ones (PCIe throughput
samples for 20 ms, total energy ~4 ms, per-process utilisation ~2 ms, MIG mode 0.16 ms) every
slow_interval, their last samples re-emitted in between; static things (identity, thresholds,
maxima) at the first collection and every static_interval.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from gpuwatch.agent.api import Event, Probe, ProbeUnavailable, Sample
from gpuwatch.agent.events import EventQueue
from gpuwatch.probes.nvml.backend import (
    CLOCK_DOMAINS, ECC_COUNTERS, ECC_TYPES, NVLINK_ACTIVE, NVLINK_ERRORS, NVLINK_LINK_ERRORS,
    TEMPERATURE_THRESHOLDS, VIOLATION_POLICIES,
    NO_VALUE_ERRORS, NOT_SUPPORTED_ERRORS, Backend, GpuLost, LibraryUnavailable, NotSupported, NoValue,
    NvmlError, RealBackend, RecordingError,
)
from gpuwatch.probes.nvml.events import XidWatcher
from gpuwatch.probes.process.identity import comm, sanitise_process_name
from gpuwatch.probes.process.kubernetes import PodResolver

log = logging.getLogger("gpuwatch.nvml")

MHZ = 1e6
MILLI = 1e-3  # mW -> W, mJ -> J
NANO = 1e-9
PERCENT = 0.01
KIB = 1024  # NVML's PCIe "KB/s" and NVLink "KiB" are both 1024 bytes

# nvmlClocksEventReason* bits, named for people.
CLOCK_EVENT_REASONS = (
    ("gpu_idle", 0x1), ("applications_clocks_setting", 0x2), ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8), ("sync_boost", 0x10), ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40), ("hw_power_brake_slowdown", 0x80), ("display_clock_setting", 0x100),
)
DIRECTIONS = (("tx", "transmit"), ("rx", "receive"))
GPM_SERIES = {  # gpm_metrics answer key -> (metric, labels)
    "sm_util": ("gpuwatch.gpu.sm.activity", {}),
    "sm_occupancy": ("gpuwatch.gpu.sm.occupancy", {}),
    "any_tensor_util": ("gpuwatch.gpu.pipe.activity", {"pipe": "tensor"}),
    "fp16_util": ("gpuwatch.gpu.pipe.activity", {"pipe": "fp16"}),
    "fp32_util": ("gpuwatch.gpu.pipe.activity", {"pipe": "fp32"}),
    "fp64_util": ("gpuwatch.gpu.pipe.activity", {"pipe": "fp64"}),
    "dram_bw_util": ("gpuwatch.gpu.dram.activity", {}),
}
MAX_QUEUED_EVENTS = 256
PSTATE_UNKNOWN = 32  # NVML_PSTATE_UNKNOWN


def cuda_version_string(version: int) -> str:
    """NVML's 13000 -> "13.0"."""
    return f"{version // 1000}.{version % 1000 // 10}"


class _Out:
    """Collects one GPU's samples; a value of None (no answer) makes no sample."""

    def __init__(self, uuid: str, ts: float) -> None:
        self.uuid = uuid
        self.ts = ts
        self.samples: list[Sample] = []

    def add(self, metric: str, value: float | None, scale: float = 1.0, **labels: str) -> None:
        if value is not None:
            self.samples.append(Sample(metric, float(value) * scale, self.uuid, labels, self.ts))


@dataclass
class _Gpu:
    index: int
    uuid: str | None = None
    info: Sample | None = None  # the identity series, still emitted while the GPU is lost
    static: list[Sample] | None = None
    slow: list[Sample] | None = None
    num_fans: int = 0
    nvlink_links: int = 0
    gpm: bool = False
    kept_processes: dict[int, str] = field(default_factory=dict)  # pid -> name, the series kept this tick
    lost: bool = False


class NvmlProbe(Probe):
    name = "nvml"

    def __init__(self, backend_factory: Callable[[], Backend] = RealBackend, interval: float = 1.0,
                 slow_interval: float = 10.0, static_interval: float = 300.0,
                 max_processes_per_gpu: int = 16, xid_events: bool = True,
                 clock: Callable[[], float] = time.monotonic, pods: PodResolver | None = None) -> None:
        self.interval = interval
        self.slow_interval = slow_interval
        self.static_interval = static_interval
        self.max_processes_per_gpu = max_processes_per_gpu
        self.xid_events = xid_events
        self.pods = pods  # names the Kubernetes pod of each GPU process kept; None: not asked
        self._backend_factory = backend_factory
        self._clock = clock
        self._backend: Backend | None = None
        self._watcher: XidWatcher | None = None
        self._gpus: list[_Gpu] = []
        self._unsupported: set[tuple] = set()
        self._nvlink_said: set[tuple] = set()  # (gpu, field key, error) already logged
        self._names: dict[int, tuple[str, str | None]] = {}  # pid -> (name, the comm it was read at)
        self._pids_seen: set[int] = set()
        self._system = {"driver_version": "", "cuda_driver_version": ""}
        self._next_static = self._next_slow = 0.0
        # Shared with the XID thread; kept across restarts, like the counters they feed.
        self._lock = threading.Lock()
        self._events = EventQueue(MAX_QUEUED_EVENTS, drop_oldest=True)
        self._xid_counts: Counter = Counter()
        self._errors: Counter = Counter()

    # ---- Probe API -------------------------------------------------------------------------
    def start(self) -> None:
        self.shutdown()
        try:
            backend = self._backend = self._backend_factory()
        except RecordingError as e:
            raise ProbeUnavailable(str(e)) from None
        self._unsupported = set()
        try:
            count = backend.call("device_count")
        except LibraryUnavailable as e:
            self.shutdown()
            raise ProbeUnavailable(str(e)) from None
        except NvmlError as e:
            self.shutdown()
            raise ProbeUnavailable(f"NVML could not count the GPUs ({e.name}): look for NVIDIA "
                                   f"driver errors in dmesg") from None
        if count == 0:
            self.shutdown()
            raise ProbeUnavailable("NVML sees no GPUs: check `nvidia-smi -L`; in a container, pass the "
                                   "GPUs in (NVIDIA container toolkit, NVIDIA_VISIBLE_DEVICES)")
        self._gpus = [_Gpu(i) for i in range(count)]
        self._next_static = self._next_slow = self._clock()  # both due at the first collection
        if self.xid_events:
            self._watcher = XidWatcher(backend, count, self._uuid_of, self._on_event, self._count_error)
            self._watcher.start()

    def collect(self) -> list[Sample]:
        backend = self._backend
        if backend is None:
            raise ProbeUnavailable("the NVML probe is not started")
        backend.begin_tick()
        now, wall = self._clock(), time.time()
        static_due, slow_due = now >= self._next_static, now >= self._next_slow
        if static_due:
            self._next_static = now + self.static_interval
        if slow_due:
            self._next_slow = now + self.slow_interval
        samples: list[Sample] = []
        self._pids_seen = set()
        try:
            if static_due:
                self._read_system()
            for gpu in self._gpus:
                samples.extend(self._collect_gpu(gpu, static_due, slow_due, wall))
        except LibraryUnavailable as e:
            raise ProbeUnavailable(str(e)) from None
        for pid in self._names.keys() - self._pids_seen:
            del self._names[pid]  # the pid may be reused by another program
        if self.pods is not None:
            samples.extend(self._pod_samples(wall))
        samples.extend(self._own_counters(wall))
        return samples

    def events(self) -> list[Event]:
        return self._events.drain()

    def shutdown(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.stop():
            # Closing NVML under a thread stuck inside it is asking for a crash: leave it be.
            log.warning("the XID thread is stuck in an NVML call; leaving NVML initialised")
            self._backend = None
            return
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()

    # ---- one GPU -----------------------------------------------------------------------------
    def _collect_gpu(self, gpu: _Gpu, static_due: bool, slow_due: bool, wall: float) -> list[Sample]:
        try:
            if (slow_due and not static_due and gpu.static is not None
                    and self._ask(gpu.index, "uuid") not in (None, gpu.uuid)):
                # Index i names another GPU now (MIG reconfigured, GPU reset or swapped): read its
                # identity afresh, not at the next static read minutes later, so the old UUID's
                # series go and the new one's come. Checked at the slow cadence: one cheap call.
                log.warning("GPU %d changed UUID (was %s): reading it afresh", gpu.index, gpu.uuid)
                gpu.static = gpu.slow = None
            if static_due or gpu.static is None:
                self._read_static(gpu, wall)
            if gpu.uuid is None or gpu.static is None:
                return []  # it has not told us its UUID yet: nothing to name its series by
            out = _Out(gpu.uuid, wall)
            out.add("gpuwatch.gpu.up", 1)
            self._read_fast(gpu, out)
            if slow_due or gpu.slow is None:
                gpu.slow = self._read_slow(gpu, wall)
        except GpuLost as e:
            self._count_error(e.name)
            gpu.static = gpu.slow = None  # read everything afresh once it answers again
            if not gpu.lost:
                log.warning("GPU %d (%s) is lost (%s): reporting it down, retrying every tick",
                            gpu.index, gpu.uuid or "UUID unknown", e.name)
                gpu.lost = True
            if gpu.uuid is None or gpu.info is None:
                return []
            return [gpu.info, Sample("gpuwatch.gpu.up", 0.0, gpu.uuid, ts=wall)]
        if gpu.lost:
            log.warning("GPU %d (%s) answers again", gpu.index, gpu.uuid)
            gpu.lost = False
        return [*gpu.static, *out.samples, *gpu.slow]

    def _read_system(self) -> None:
        self._system["driver_version"] = self._ask(None, "driver_version") or ""
        cuda = self._ask(None, "cuda_driver_version")
        self._system["cuda_driver_version"] = cuda_version_string(cuda) if cuda else ""

    def _read_static(self, gpu: _Gpu, wall: float) -> None:
        i = gpu.index
        uuid = self._ask(i, "uuid")
        if uuid is None:
            return
        gpu.uuid = uuid
        out = _Out(uuid, wall)
        out.add("gpuwatch.gpu", 1, gpu_index=str(i), name=self._ask(i, "name") or "",
                pci_bus_id=self._ask(i, "pci_bus_id") or "",
                driver_version=self._system["driver_version"],
                cuda_driver_version=self._system["cuda_driver_version"],
                vbios_version=self._ask(i, "vbios_version") or "", serial=self._ask(i, "serial") or "")
        gpu.info = out.samples[0]
        for threshold in TEMPERATURE_THRESHOLDS:
            out.add("hw.temperature.limit", self._ask(i, "temperature_threshold", threshold), threshold=threshold)
        for domain in CLOCK_DOMAINS:
            out.add("gpuwatch.gpu.clock.max_frequency", self._ask(i, "max_clock", domain), MHZ, clock=domain)
        out.add("gpuwatch.gpu.power.limit", self._ask(i, "power_default_limit"), MILLI, limit="default")
        constraints = self._ask(i, "power_limit_constraints") or {}
        for limit in ("min", "max"):
            out.add("gpuwatch.gpu.power.limit", constraints.get(limit), MILLI, limit=limit)
        out.add("gpuwatch.gpu.pcie.link.generation", self._ask(i, "pcie_link_generation", "max"), state="max")
        out.add("gpuwatch.gpu.pcie.link.width", self._ask(i, "pcie_link_width", "max"), state="max")
        gpu.num_fans = self._ask(i, "num_fans") or 0
        gpu.nvlink_links = self._ask(i, "nvlink_link_count") or 0
        gpu.gpm = bool(self._ask(i, "gpm_support"))
        gpu.static = out.samples

    def _read_fast(self, gpu: _Gpu, out: _Out) -> None:
        i = gpu.index
        out.add("hw.temperature", self._ask(i, "temperature"), sensor="gpu")
        out.add("hw.temperature", self._ask(i, "memory_temperature"), sensor="memory")
        for domain in CLOCK_DOMAINS:
            out.add("gpuwatch.gpu.clock.frequency", self._ask(i, "clock", domain), MHZ, clock=domain)
        reasons = self._ask(i, "clocks_event_reasons")
        if reasons is not None:
            for reason, bit in CLOCK_EVENT_REASONS:
                out.add("gpuwatch.gpu.clock_event.active", 1 if reasons & bit else 0, reason=reason)
        out.add("hw.power", self._ask(i, "power_usage"), MILLI)
        out.add("gpuwatch.gpu.power.limit", self._ask(i, "enforced_power_limit"), MILLI, limit="enforced")
        utilization = self._ask(i, "utilization")
        if utilization is not None:
            out.add("hw.gpu.utilization", utilization["gpu"], PERCENT, task="general")
            out.add("gpuwatch.gpu.memory_controller.utilization", utilization["memory"], PERCENT)
        for task in ("encoder", "decoder"):
            codec = self._ask(i, f"{task}_utilization")
            if codec is not None:
                out.add("hw.gpu.utilization", codec["util"], PERCENT, task=task)
        self._read_memory(gpu, out)
        self._read_processes(gpu, out)
        self._read_nvlink(gpu, out)
        pstate = self._ask(i, "performance_state")
        if pstate is not None and pstate != PSTATE_UNKNOWN:
            out.add("gpuwatch.gpu.performance_state", pstate)
        for fan in range(gpu.num_fans):
            out.add("gpuwatch.gpu.fan.speed", self._ask(i, "fan_speed", fan), PERCENT, fan=str(fan))
        if gpu.gpm:
            metrics = self._ask(i, "gpm_metrics") or {}
            for key, (metric, labels) in GPM_SERIES.items():
                out.add(metric, metrics.get(key), PERCENT, **labels)

    def _read_memory(self, gpu: _Gpu, out: _Out) -> None:
        memory = self._ask(gpu.index, "memory_info_v2")
        if memory is None and ("memory_info_v2", gpu.index, ()) in self._unsupported:
            memory = self._ask(gpu.index, "memory_info")  # drivers before v2: used includes reserved
        if memory is None:
            return
        out.add("hw.gpu.memory.usage", memory["used"])
        out.add("hw.gpu.memory.limit", memory["total"])
        out.add("gpuwatch.gpu.memory.free", memory["free"])
        out.add("gpuwatch.gpu.memory.reserved", memory.get("reserved"))
        if memory["total"]:
            out.add("hw.gpu.memory.utilization", memory["used"] / memory["total"])

    def _read_processes(self, gpu: _Gpu, out: _Out) -> None:
        memory: dict[int, int] = {}
        for kind in ("compute", "graphics"):
            processes = self._ask(gpu.index, f"{kind}_processes")
            if processes is None:
                continue
            out.add("gpuwatch.gpu.processes", len(processes), type=kind)
            for p in processes:
                if p["used_memory"] is not None:  # a process in both lists is charged once
                    memory[p["pid"]] = max(memory.get(p["pid"], 0), p["used_memory"])
        ranked = sorted(memory.items(), key=lambda item: (-item[1], item[0]))
        kept, rest = ranked[:self.max_processes_per_gpu], ranked[self.max_processes_per_gpu:]
        gpu.kept_processes = {pid: self._process_name(pid) for pid, _ in kept}
        for pid, used in kept:
            out.add("gpuwatch.process.gpu.memory.usage", used, pid=str(pid), process=gpu.kept_processes[pid])
        if rest:
            out.add("gpuwatch.process.gpu.memory.usage", sum(used for _, used in rest), pid="other",
                    process="other")

    def _read_nvlink(self, gpu: _Gpu, out: _Out) -> None:
        """Per link: state, error counters and data bytes, in one field-value batch per GPU (it was
        18 links x 5 counters calls on an H200); drivers without the batch: one call per value."""
        i, links = gpu.index, gpu.nvlink_links
        if not links:
            return
        fields = self._ask(i, "nvlink_fields", links)
        if fields is None:
            if ("nvlink_fields", i, (links,)) in self._unsupported:
                self._read_nvlink_per_call(gpu, out)
            return
        for link in range(links):
            state = self._nvlink_value(gpu, fields, f"{link} state")
            if state is not None:
                out.add("gpuwatch.gpu.nvlink.up", 1 if state == NVLINK_ACTIVE else 0, link=str(link))
            for kind in NVLINK_LINK_ERRORS:
                out.add("gpuwatch.gpu.nvlink.errors", self._nvlink_value(gpu, fields, f"{link} {kind}"),
                        link=str(link), type=kind)
            for direction, label in DIRECTIONS:
                out.add("gpuwatch.gpu.nvlink.link.io", self._nvlink_value(gpu, fields, f"{link} {direction}"),
                        KIB, link=str(link), direction=label)
        for direction, label in DIRECTIONS:
            out.add("gpuwatch.gpu.nvlink.io", self._nvlink_value(gpu, fields, f"all {direction}"), KIB,
                    direction=label)

    def _nvlink_value(self, gpu: _Gpu, fields: dict, key: str) -> int | None:
        """A number from the batch, or None: a field NVML answered with an error is said once per GPU."""
        value = fields.get(key)
        if isinstance(value, str):
            if value not in NOT_SUPPORTED_ERRORS and value not in NO_VALUE_ERRORS:
                self._count_error(value)  # as the chokepoint counts a failed call
            said = (gpu.index, key, value)
            if said not in self._nvlink_said:
                self._nvlink_said.add(said)
                log.info("GPU %d (%s): NVLink field %s answers %s: no series for it", gpu.index, gpu.uuid,
                         key, value)
            return None
        return value

    def _read_nvlink_per_call(self, gpu: _Gpu, out: _Out) -> None:
        i = gpu.index
        for link in range(gpu.nvlink_links):
            state = self._ask(i, "nvlink_state", link)
            if state is None:
                continue
            out.add("gpuwatch.gpu.nvlink.up", 1 if state == 1 else 0, link=str(link))
            if state == 1:
                for kind in NVLINK_ERRORS:
                    out.add("gpuwatch.gpu.nvlink.errors", self._ask(i, "nvlink_error_counter", link, kind),
                            link=str(link), type=kind)
        for direction, label in DIRECTIONS:
            out.add("gpuwatch.gpu.nvlink.io", self._ask(i, "nvlink_throughput", direction), KIB, direction=label)

    def _read_slow(self, gpu: _Gpu, wall: float) -> list[Sample]:
        i = gpu.index
        out = _Out(gpu.uuid, wall)  # type: ignore[arg-type]  # known by now
        for direction, label in DIRECTIONS:
            out.add("gpuwatch.gpu.pcie.throughput", self._ask(i, "pcie_throughput", direction), KIB, direction=label)
        out.add("hw.energy", self._ask(i, "total_energy"), MILLI)
        # Cumulative counters and slowly changing state: 10 s resolution is plenty, and it keeps
        # the per-second tick to the calls whose values move every second.
        times = self._ask(i, "violation_times")
        if times is None and ("violation_times", i, ()) in self._unsupported:
            # Drivers without the field values: one (slower) call per policy.
            for reason in VIOLATION_POLICIES:
                violation = self._ask(i, "violation_status", reason)
                if violation is not None:
                    times = times or {}
                    times[reason] = violation["violation_time"]
        for reason, ns in (times or {}).items():
            out.add("gpuwatch.gpu.clock_event.duration", ns, NANO, reason=reason)
        for kind in ECC_TYPES:
            for counter in ECC_COUNTERS:
                out.add("hw.errors", self._ask(i, "ecc_errors", kind, counter), type=kind, counter=counter)
        rows = self._ask(i, "remapped_rows")
        if rows is not None:
            out.add("gpuwatch.gpu.remapped_rows", rows["corrected"], cause="correctable")
            out.add("gpuwatch.gpu.remapped_rows", rows["uncorrected"], cause="uncorrectable")
            out.add("gpuwatch.gpu.remapped_rows.pending", rows["pending"])
            out.add("gpuwatch.gpu.remapped_rows.failure", rows["failure"])
        out.add("gpuwatch.gpu.pcie.link.generation", self._ask(i, "pcie_link_generation", "current"), state="current")
        out.add("gpuwatch.gpu.pcie.link.width", self._ask(i, "pcie_link_width", "current"), state="current")
        out.add("gpuwatch.gpu.pcie.replays", self._ask(i, "pcie_replay_counter"))
        bar1 = self._ask(i, "bar1_memory")
        if bar1 is not None:
            out.add("gpuwatch.gpu.bar1_memory.usage", bar1["used"])
        self._read_process_utilization(gpu, out)
        mig = self._ask(i, "mig_mode")
        if mig is not None:
            out.add("gpuwatch.gpu.mig.mode", mig["current"], state="current")
            out.add("gpuwatch.gpu.mig.mode", mig["pending"], state="pending")
        return out.samples

    def _read_process_utilization(self, gpu: _Gpu, out: _Out) -> None:
        # NOT_FOUND (nothing ran since the last call) arrives as None: no sample, not an error.
        samples = self._ask(gpu.index, "process_utilization")
        if not samples:
            return
        latest: dict[int, dict] = {}
        for s in samples:
            if s["pid"] not in latest or s["time_stamp"] > latest[s["pid"]]["time_stamp"]:
                latest[s["pid"]] = s
        other = None
        for pid, s in sorted(latest.items()):
            if pid in gpu.kept_processes:
                out.add("gpuwatch.process.gpu.utilization", s["sm_util"], PERCENT, pid=str(pid),
                        process=gpu.kept_processes[pid])
            else:
                other = (other or 0.0) + s["sm_util"] * PERCENT
        if other is not None:
            # Summed, so an upper bound on "any of the rest had a kernel running".
            out.add("gpuwatch.process.gpu.utilization", min(1.0, other), pid="other", process="other")

    # ---- helpers -----------------------------------------------------------------------------
    def _ask(self, gpu: int | None, op: str, *args: Any) -> Any:
        """One NVML call; None where it gives no sample. Lost GPU and library errors propagate."""
        key = (op, gpu, args)
        if key in self._unsupported:
            return None
        try:
            return self._backend.call(op, gpu, *args)  # type: ignore[union-attr]
        except NotSupported:
            self._unsupported.add(key)
            return None
        except NoValue:
            return None
        except (GpuLost, LibraryUnavailable):
            raise
        except NvmlError as e:
            self._count_error(e.name)
            return None

    def _process_name(self, pid: int) -> str:
        """NVML's name for the process, asked again when its /proc comm changes (it exec'd another
        program); the comm itself where NVML has none (a replay listing a local process)."""
        self._pids_seen.add(pid)
        live = comm(pid)  # None: not on this host (a replayed pid), or gone
        cached = self._names.get(pid)
        if cached is None or (live is not None and cached[1] != live):
            name = sanitise_process_name(self._ask(None, "process_name", pid) or live or "")
            self._names[pid] = (name, live)
        return self._names[pid][0]

    def _pod_samples(self, wall: float) -> list[Sample]:
        """gpuwatch.process.kubernetes for each kept GPU process in a pod: one series per pid, not
        per GPU, so that per-process series join on pid. Only new pids read files (cached)."""
        out = []
        for pid in sorted(self._pids_seen):
            found = self.pods.lookup(pid)
            if found is not None:
                out.append(Sample("gpuwatch.process.kubernetes", 1.0, "", {
                    "pid": str(pid), "process": self._names[pid][0], "namespace": found.namespace,
                    "pod": found.pod, "pod_uid": found.pod_uid, "container": found.container}, wall))
        self.pods.retain(self._pids_seen)
        return out

    def _uuid_of(self, index: int) -> str | None:
        gpus = self._gpus
        return gpus[index].uuid if 0 <= index < len(gpus) else None

    def _count_error(self, name: str) -> None:
        with self._lock:
            self._errors[name] += 1

    def _on_event(self, event: Event) -> None:
        with self._lock:  # the event and its count together
            if not self._events.put(event):
                log.warning("NVML event queue full: dropped %d events so far", self._events.dropped)
            if event.kind == "gpu.xid" and event.resource:
                self._xid_counts[(event.resource, event.attrs["xid"])] += 1

    def _own_counters(self, wall: float) -> list[Sample]:
        with self._lock:
            errors, xids, dropped = dict(self._errors), dict(self._xid_counts), self._events.dropped
        samples = [Sample("gpuwatch.nvml.call.errors", float(n), "", {"error": name}, wall)
                   for name, n in sorted(errors.items())]
        samples.append(Sample("gpuwatch.probe.events.dropped", float(dropped), "", {"probe": self.name}, wall))
        samples += [Sample("gpuwatch.gpu.xid", float(n), uuid, {"xid": str(xid)}, wall)
                    for (uuid, xid), n in sorted(xids.items())]
        return samples


def inventory(backend: Backend) -> list[dict]:
    """One row per GPU for `gpuwatch gpus`; keys carry their unit, None where unknown:
    index, uuid, name, up, temperature_celsius, power_watts, memory_used_bytes,
    memory_total_bytes, utilization (0..1), processes [{pid, name, memory_bytes}].

    Raises LibraryUnavailable (str() says what to do) when NVML cannot be used. The caller owns
    and closes the backend.
    """
    def ask(gpu: int | None, op: str, *args: Any) -> Any:
        try:
            return backend.call(op, gpu, *args)
        except (GpuLost, LibraryUnavailable):
            raise
        except NvmlError:
            return None

    rows = []
    for index in range(backend.call("device_count")):
        row: dict[str, Any] = {"index": index, "uuid": None, "name": None, "up": True,
                               "temperature_celsius": None, "power_watts": None, "memory_used_bytes": None,
                               "memory_total_bytes": None, "utilization": None, "processes": []}
        try:
            row["uuid"] = ask(index, "uuid")
            row["name"] = ask(index, "name")
            row["temperature_celsius"] = ask(index, "temperature")
            power = ask(index, "power_usage")
            row["power_watts"] = None if power is None else power * MILLI
            memory = ask(index, "memory_info_v2") or ask(index, "memory_info")
            if memory is not None:
                row["memory_used_bytes"], row["memory_total_bytes"] = memory["used"], memory["total"]
            utilization = ask(index, "utilization")
            row["utilization"] = None if utilization is None else utilization["gpu"] * PERCENT
            charged: dict[int, int] = {}
            for kind in ("compute", "graphics"):
                for p in ask(index, f"{kind}_processes") or []:
                    charged[p["pid"]] = max(charged.get(p["pid"], 0), p["used_memory"] or 0)
            row["processes"] = [
                {"pid": pid, "name": sanitise_process_name(ask(None, "process_name", pid) or ""),
                 "memory_bytes": used}
                for pid, used in sorted(charged.items(), key=lambda item: (-item[1], item[0]))]
        except GpuLost:
            row["up"] = False
        rows.append(row)
    return rows
