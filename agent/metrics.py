"""The metric registry: every metric gpuwatch exports is defined here, once.

Each entry gives the OpenTelemetry name (hardware semantic conventions where one
exists, `gpuwatch.*` otherwise), the UCUM unit, the instrument kind, the help
text and the label names. Prometheus names are derived from these by the rules
of OpenTelemetry's Prometheus compatibility spec, so no exporter invents a name:
dots become underscores, the unit becomes a suffix (bytes, seconds, ...),
counters end in `_total`. Values are always in base units.

Per-GPU metrics have `gpu` as their first label; its value is the GPU UUID,
which travels in Sample.resource.
"""
from __future__ import annotations

import bisect
import enum
import math
import re
from dataclasses import dataclass

from gpuwatch.agent.api import HistogramValue


class Kind(enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"  # monotonic; Prometheus name gets `_total`
    INFO = "info"  # constant 1 carrying identity labels; Prometheus name ends in `_info`
    # Observations in buckets (Metric.buckets), cumulative: Prometheus `_bucket{le}`, `_sum` and
    # `_count` series; an OpenTelemetry explicit-bucket histogram.
    HISTOGRAM = "histogram"


# UCUM unit -> Prometheus suffix. "" means no suffix (states, counts of things).
_UNIT_SUFFIX = {
    "By": "bytes",
    "By/s": "bytes_per_second",
    "s": "seconds",
    "W": "watts",
    "J": "joules",
    "Cel": "celsius",
    "Hz": "hertz",
    "1": "ratio",
    "{flop}/s": "flops_per_second",
    "{flop}/{cycle}": "flops_per_cycle",
    "": "",
}


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, ascending (+Inf is implied)

    @property
    def per_gpu(self) -> bool:
        return bool(self.labels) and self.labels[0] == "gpu"

    @property
    def prom_name(self) -> str:
        base = re.sub(r"[^a-zA-Z0-9_]", "_", self.name)
        suffix = _UNIT_SUFFIX[self.unit]
        if suffix and not base.endswith("_" + suffix):
            base = f"{base}_{suffix}"
        if self.kind is Kind.INFO and not base.endswith("_info"):
            base += "_info"
        # The `_total` is added by the Prometheus client for counters; this is the family name.
        return base

    @property
    def prom_exposed_name(self) -> str:
        """The name as it appears in the exposition (with `_total` for counters)."""
        return self.prom_name + ("_total" if self.kind is Kind.COUNTER else "")

    @property
    def prom_series_names(self) -> tuple[str, ...]:
        """The names of its series in the exposition (a histogram has three)."""
        if self.kind is Kind.HISTOGRAM:
            return tuple(f"{self.prom_name}_{s}" for s in ("bucket", "sum", "count"))
        return (self.prom_exposed_name,)


class Histogram:
    """Counts observations into a histogram metric's buckets; value() is the immutable state a
    Sample carries. Not thread-safe: one owner (the runner's thread) observes and reads it."""

    def __init__(self, name: str, start: float) -> None:
        m = get(name)
        if m.kind is not Kind.HISTOGRAM:
            raise ValueError(f"{name} is a {m.kind.value}, not a histogram")
        self.bounds = m.buckets
        self.counts = [0] * (len(m.buckets) + 1)
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.start = start

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1  # le: a value on a bound is in that bucket
        self.sum += v
        self.min = min(self.min, v)
        self.max = max(self.max, v)

    def value(self) -> HistogramValue:
        return HistogramValue(tuple(self.counts), self.sum, self.min, self.max, self.start)


_G = ("gpu",)

# `NAME := "..."` in a definition below makes a constant for code that names the metric (detectors):
# the name is written once, here, and a misspelt one is an ImportError, not a series never found.
METRICS: tuple[Metric, ...] = (
    # --- agent itself -------------------------------------------------------------------
    Metric("gpuwatch.build", "", Kind.INFO, "gpuwatch build: version and Python.", ("version", "python")),
    Metric("gpuwatch.probe.up", "", Kind.GAUGE,
           "1 when the probe's last collection succeeded in time, 0 when it is disabled, unavailable, failing "
           "or late (gpuwatch_probe_state says which).", ("probe",)),
    Metric("gpuwatch.probe.state", "", Kind.GAUGE,
           "1 for the probe's current state: starting, up, late, disabled (an optional extra it needs is "
           "not installed: off, not down), unavailable (cannot run here now), failing (raised an error).",
           ("probe", "state")),
    Metric("gpuwatch.probe.duration", "s", Kind.GAUGE, "Wall time of the probe's last collection.", ("probe",)),
    Metric("gpuwatch.probe.late", "", Kind.COUNTER,
           "Collections that overran the probe's deadline.", ("probe",)),
    Metric("gpuwatch.probe.errors", "", Kind.COUNTER, "Collections that raised an error.", ("probe",)),
    Metric("gpuwatch.probe.events.dropped", "", Kind.COUNTER,
           "Events a probe dropped because its queue was full.", ("probe",)),
    Metric("gpuwatch.history.series", "", Kind.GAUGE, "Series the agent holds in memory for its detectors."),
    Metric("gpuwatch.history.series.evicted", "", Kind.COUNTER,
           "Series forgotten: expired (no point for an hour, or for 10 minutes for a process's series) or cap "
           "(the oldest, beyond the cap on series held).", ("reason",)),
    Metric("gpuwatch.history.points.future", "", Kind.COUNTER,
           "Points a probe dated more than a minute ahead of the agent's clock: not kept for detectors.",
           ("probe",)),
    Metric("gpuwatch.findings.dropped", "", Kind.COUNTER,
           "Findings not opened because the most the agent keeps open at once (256) were open."),
    Metric("gpuwatch.nvml.call.errors", "", Kind.COUNTER,
           "NVML calls that returned an error other than not-supported, by NVML error name.",
           ("error",)),
    # --- GPU identity and health --------------------------------------------------------------
    Metric("gpuwatch.gpu", "", Kind.INFO,
           "GPU identity: one series per GPU, value 1.",
           ("gpu", "gpu_index", "name", "pci_bus_id", "driver_version", "cuda_driver_version",
            "vbios_version", "serial")),
    Metric(GPU_UP := "gpuwatch.gpu.up", "", Kind.GAUGE,
           "1 when the GPU answers NVML, 0 when it is lost or fell off the bus.", _G),
    # --- temperature ------------------------------------------------------------------------
    Metric(HW_TEMPERATURE := "hw.temperature", "Cel", Kind.GAUGE, "Temperature by sensor (gpu core or memory).",
           ("gpu", "sensor")),
    Metric(HW_TEMPERATURE_LIMIT := "hw.temperature.limit", "Cel", Kind.GAUGE,
           "Temperature thresholds: slowdown, shutdown, max_operating (GPU), max_memory.",
           ("gpu", "threshold")),
    # --- clocks -------------------------------------------------------------------------------
    Metric("gpuwatch.gpu.clock.frequency", "Hz", Kind.GAUGE, "Current clock by domain.", ("gpu", "clock")),
    Metric("gpuwatch.gpu.clock.max_frequency", "Hz", Kind.GAUGE, "Maximum clock by domain.", ("gpu", "clock")),
    Metric("gpuwatch.gpu.clock_event.active", "", Kind.GAUGE,
           "1 while the clock-event (throttle) reason is active.", ("gpu", "reason")),
    Metric(GPU_CLOCK_EVENT_DURATION := "gpuwatch.gpu.clock_event.duration", "s", Kind.COUNTER,
           "Cumulative time the driver held clocks below target for this reason (NVML violation counters).",
           ("gpu", "reason")),
    # --- power and energy ---------------------------------------------------------------------
    Metric("hw.power", "W", Kind.GAUGE, "Power draw.", _G),
    Metric("gpuwatch.gpu.power.limit", "W", Kind.GAUGE,
           "Power limits: enforced (what the GPU holds now), default, min and max settable.",
           ("gpu", "limit")),
    Metric("hw.energy", "J", Kind.COUNTER, "Energy consumed since the driver was loaded.", _G),
    # --- utilisation -------------------------------------------------------------------------
    Metric("hw.gpu.utilization", "1", Kind.GAUGE,
           "Fraction of the sample period a kernel (general), the encoder or the decoder was busy.",
           ("gpu", "task")),
    Metric("gpuwatch.gpu.memory_controller.utilization", "1", Kind.GAUGE,
           "Fraction of the sample period device memory was being read or written.", _G),
    # --- memory ---------------------------------------------------------------------------------
    Metric(HW_GPU_MEMORY_USAGE := "hw.gpu.memory.usage", "By", Kind.GAUGE, "Device memory used.", _G),
    Metric(HW_GPU_MEMORY_LIMIT := "hw.gpu.memory.limit", "By", Kind.GAUGE, "Device memory total.", _G),
    Metric("hw.gpu.memory.utilization", "1", Kind.GAUGE, "Device memory used / total.", _G),
    Metric(GPU_MEMORY_FREE := "gpuwatch.gpu.memory.free", "By", Kind.GAUGE, "Device memory free.", _G),
    Metric("gpuwatch.gpu.memory.reserved", "By", Kind.GAUGE,
           "Device memory reserved by the driver and firmware.", _G),
    Metric("gpuwatch.gpu.bar1_memory.usage", "By", Kind.GAUGE, "BAR1 memory used.", _G),
    Metric(GPU_PROCESSES := "gpuwatch.gpu.processes", "", Kind.GAUGE, "Processes with a context on the GPU, by type.",
           ("gpu", "type")),
    Metric(PROCESS_GPU_MEMORY_USAGE := "gpuwatch.process.gpu.memory.usage", "By", Kind.GAUGE,
           "Device memory the driver charges to the process (the 'black' color of the leak detector). "
           "The top processes by memory are kept; the rest are folded into pid=\"other\".",
           ("gpu", "pid", "process")),
    Metric(PROCESS_GPU_UTILIZATION := "gpuwatch.process.gpu.utilization", "1", Kind.GAUGE,
           "Fraction of the last sample period the process had a kernel running (NVML process utilisation).",
           ("gpu", "pid", "process")),
    Metric("gpuwatch.process.kubernetes", "", Kind.INFO,
           "The Kubernetes pod and container of a GPU process (one of the processes with series of their "
           "own), from its cgroup and the kubelet's log layout (/var/log/pods, /var/log/containers); "
           "namespace, pod and container are empty when those are not mounted. Join on pid.",
           ("pid", "process", "namespace", "pod", "pod_uid", "container")),
    # --- the host side of GPU processes (probes/process/host.py) -------------------------------
    # For each process with series of its own on a GPU (NVML's kept processes, eBPF's); the same
    # pid/process labels as the GPU series, so one row of a dashboard joins them.
    Metric(PROCESS_CPU_TIME := "gpuwatch.process.cpu.time", "s", Kind.COUNTER,
           "CPU time of a GPU process (all its threads), by mode (user, system).", ("pid", "process", "mode")),
    Metric("gpuwatch.process.cpu.utilization", "1", Kind.GAUGE,
           "CPU time of a GPU process over the last interval, per second of wall time: 1 is one core busy, "
           "so a process may read above 1.", ("pid", "process")),
    Metric(PROCESS_THREAD_CPU_UTILIZATION := "gpuwatch.process.thread.cpu.utilization", "1", Kind.GAUGE,
           "The busiest threads of a GPU process (at most 3): CPU time over the last interval per second "
           "(1: the thread kept one core busy, as a saturated data-loading thread does).",
           ("pid", "process", "tid", "thread")),
    Metric("gpuwatch.process.memory.rss", "By", Kind.GAUGE, "Resident host memory of a GPU process.",
           ("pid", "process")),
    Metric(PROCESS_MEMORY_SWAP := "gpuwatch.process.memory.swap", "By", Kind.GAUGE,
           "Host memory of a GPU process swapped out (VmSwap).", ("pid", "process")),
    Metric(PROCESS_PAGING_FAULTS := "gpuwatch.process.paging.faults", "", Kind.COUNTER,
           "Page faults of a GPU process by type: major (the page was read from disk: a file evicted from "
           "the page cache, or swap) or minor.", ("pid", "process", "type")),
    Metric(PROCESS_DISK_IO := "gpuwatch.process.disk.io", "By", Kind.COUNTER,
           "Bytes a GPU process read from or wrote to storage (direction: read, write; page-cache hits "
           "are not counted).", ("pid", "process", "direction")),
    Metric("gpuwatch.process.context_switches", "", Kind.COUNTER,
           "Context switches of a GPU process by type (voluntary, involuntary).", ("pid", "process", "type")),
    Metric("gpuwatch.process.threads.blocked", "", Kind.GAUGE,
           "Threads of a GPU process in uninterruptible sleep (D state: waiting on disk I/O) when read.",
           ("pid", "process")),
    Metric(PROCESS_CGROUP_CPU_THROTTLED_TIME := "gpuwatch.process.cgroup.cpu.throttled.time", "s", Kind.COUNTER,
           "Time the cgroup of a GPU process was throttled by its CPU quota (cpu.stat throttled_usec).",
           ("pid", "process")),
    Metric(PROCESS_CGROUP_CPU_THROTTLED_PERIODS := "gpuwatch.process.cgroup.cpu.throttled.periods", "", Kind.COUNTER,
           "Enforcement periods in which the cgroup of a GPU process was throttled (cpu.stat nr_throttled).",
           ("pid", "process")),
    Metric(PROCESS_CGROUP_PRESSURE_STALL_TIME := "gpuwatch.process.cgroup.pressure.stall.time", "s", Kind.COUNTER,
           "Time tasks of the cgroup of a GPU process stalled on a resource (PSI: resource cpu, io, memory; "
           "scope some: at least one task, full: all of them).", ("pid", "process", "resource", "scope")),
    Metric(PROCESS_FILE_SIZE := "gpuwatch.process.file.size", "By", Kind.GAUGE,
           "Size of a large file a GPU process maps or holds open (model weights, datasets, shards; the "
           "largest few per process).", ("pid", "process", "file")),
    Metric(PROCESS_FILE_CACHE_RESIDENT := "gpuwatch.process.file.cache.resident", "By", Kind.GAUGE,
           "Bytes of that file in the page cache (cachestat(2) on Linux 6.5+, else mincore(2)).",
           ("pid", "process", "file")),
    Metric("gpuwatch.process.file.cache.evicted", "By", Kind.GAUGE,
           "Bytes of that file evicted from the page cache whose eviction the kernel still remembers "
           "(cachestat(2) nr_evicted; absent with mincore(2)).", ("pid", "process", "file")),
    Metric(NODE_PROCESS_DISK_READ_RATE := "gpuwatch.node.process.disk.read.rate", "By/s", Kind.GAUGE,
           "The processes of the node reading most from storage over the last interval (at most 5, any "
           "process, GPU or not): who may be evicting a GPU process's files from the page cache.",
           ("pid", "process")),
    # --- PCIe and NVLink ------------------------------------------------------------------------
    Metric("gpuwatch.gpu.pcie.throughput", "By/s", Kind.GAUGE,
           "PCIe throughput over a 20 ms NVML sample window.", ("gpu", "direction")),
    Metric("gpuwatch.gpu.pcie.replays", "", Kind.COUNTER, "PCIe replay counter.", _G),
    Metric("gpuwatch.gpu.pcie.link.generation", "", Kind.GAUGE, "PCIe link generation.", ("gpu", "state")),
    Metric("gpuwatch.gpu.pcie.link.width", "", Kind.GAUGE, "PCIe link width (lanes).", ("gpu", "state")),
    Metric(GPU_NVLINK_UP := "gpuwatch.gpu.nvlink.up", "", Kind.GAUGE,
           "1 when the NVLink link is active, 0 when it is not.",
           ("gpu", "link")),
    Metric("gpuwatch.gpu.nvlink.io", "By", Kind.COUNTER, "NVLink data bytes by direction, all links.",
           ("gpu", "direction")),
    # Its own metric, not a `link` label on the one above: sum() over either stays right.
    Metric("gpuwatch.gpu.nvlink.link.io", "By", Kind.COUNTER, "NVLink data bytes by link and direction.",
           ("gpu", "link", "direction")),
    Metric(GPU_NVLINK_ERRORS := "gpuwatch.gpu.nvlink.errors", "", Kind.COUNTER,
           "NVLink error counters by link and type: dl_replay, dl_recovery, dl_crc (what `nvidia-smi nvlink "
           "-e` shows; since the driver loaded); drivers without per-link field values give dl_crc_flit, "
           "dl_crc_data and dl_ecc_data instead of dl_crc.", ("gpu", "link", "type")),
    # --- errors -------------------------------------------------------------------------------
    Metric(HW_ERRORS := "hw.errors", "", Kind.COUNTER,
           "ECC errors: type corrected|uncorrected, counter volatile (since driver load) or aggregate (lifetime).",
           ("gpu", "type", "counter")),
    Metric(GPU_REMAPPED_ROWS := "gpuwatch.gpu.remapped_rows", "", Kind.GAUGE,
           "Rows remapped by cause.", ("gpu", "cause")),
    Metric(GPU_REMAPPED_ROWS_PENDING := "gpuwatch.gpu.remapped_rows.pending", "", Kind.GAUGE,
           "1 when a row remap waits for a GPU reset.", _G),
    Metric(GPU_REMAPPED_ROWS_FAILURE := "gpuwatch.gpu.remapped_rows.failure", "", Kind.GAUGE,
           "1 when a row remap failed.", _G),
    Metric(GPU_XID := "gpuwatch.gpu.xid", "", Kind.COUNTER,
           "Critical XID events seen by the agent since it started, by XID code.", ("gpu", "xid")),
    # --- state --------------------------------------------------------------------------------
    Metric("gpuwatch.gpu.performance_state", "", Kind.GAUGE, "Performance state P0 (fastest) .. P15.", _G),
    Metric("gpuwatch.gpu.fan.speed", "1", Kind.GAUGE, "Fan speed as a fraction of its maximum.", ("gpu", "fan")),
    Metric("gpuwatch.gpu.mig.mode", "", Kind.GAUGE, "MIG mode: 1 enabled, 0 disabled.", ("gpu", "state")),
    # --- CUDA API, from eBPF uprobes on libcuda ---------------------------------------------
    # Per process and driver API function; the busiest processes are kept, the rest folded
    # into pid="other" (see probes/ebpf).
    Metric(CUDA_CALLS := "gpuwatch.cuda.calls", "", Kind.COUNTER,
           "CUDA driver API calls seen by the eBPF probe on libcuda (runtime, cuBLAS and Triton work "
           "all arrive here). Kernel launch APIs (cuLaunch*) are ESTIMATED from a duty cycle "
           "when gpuwatch_ebpf_launch_sampled_ratio < 1 (ebpf.launch_sampling); every other API "
           "(cuGraphLaunch included) is exact.",
           ("pid", "process", "api")),
    Metric(CUDA_ERRORS := "gpuwatch.cuda.errors", "", Kind.COUNTER,
           "CUDA driver API calls that returned an error (a CUresult other than CUDA_SUCCESS).",
           ("pid", "process", "api")),
    Metric("gpuwatch.cuda.call.duration", "s", Kind.COUNTER,
           "Total time spent inside the API function (entry to return); divide by calls for the mean.",
           ("pid", "process", "api")),
    Metric("gpuwatch.cuda.bytes", "By", Kind.COUNTER,
           "Bytes asked for by allocations, copies and sets, by API function.", ("pid", "process", "api")),
    Metric("gpuwatch.cuda.graph.launches", "", Kind.COUNTER,
           "CUDA graph replays (cuGraphLaunch) by what the eBPF probe knows of the graph's content: "
           "known (every kernel node followed from its capture or construction), partial (some nodes "
           "missed: its kernels in gpuwatch_cuda_graph_kernel_launches_total are a lower bound), unknown "
           "(instantiated before the probe attached).", ("pid", "process", "content")),
    Metric("gpuwatch.cuda.graph.kernel.launches", "", Kind.COUNTER,
           "Kernels run by CUDA graph replays (each replay runs every kernel node of its graph), from "
           "the graphs' known content; direct launches are gpuwatch_cuda_calls_total{api=~\"cuLaunch.*\"}.",
           ("pid", "process")),
    # --- NCCL, from eBPF uprobes on libnccl -------------------------------------------------
    # Per process and NCCL function (op), and per communicator (comm: a hash of its unique id, the
    # same in every rank's process; rank and size from its init, "" when the init was not seen;
    # a process's communicators past its 32 busiest are summed as comm="other").
    Metric("gpuwatch.nccl.calls", "", Kind.COUNTER,
           "NCCL API calls seen by the eBPF probe on libnccl (collectives, send/recv, group and "
           "communicator calls).", ("pid", "process", "op")),
    Metric("gpuwatch.nccl.errors", "", Kind.COUNTER,
           "NCCL calls that returned an error (an ncclResult_t other than ncclSuccess or ncclInProgress).",
           ("pid", "process", "op")),
    Metric("gpuwatch.nccl.call.duration", "s", Kind.COUNTER,
           "Host time spent inside the NCCL call (entry to return): enqueueing the collective, not "
           "running it on the GPU; divide by calls for the mean.", ("pid", "process", "op")),
    Metric("gpuwatch.nccl.bytes", "By", Kind.COUNTER,
           "Bytes given to NCCL calls: count x the datatype's size (per rank: a send count for "
           "all-gather, a receive count for reduce-scatter).", ("pid", "process", "op")),
    Metric("gpuwatch.nccl.communicator.calls", "", Kind.COUNTER,
           "NCCL calls on one communicator of the process (collectives and send/recv); comm=\"other\": "
           "the process's communicators past its 32 busiest, summed.",
           ("pid", "process", "comm", "rank", "size")),
    Metric("gpuwatch.nccl.communicator.bytes", "By", Kind.COUNTER,
           "Bytes of the NCCL calls on one communicator of the process.", ("pid", "process", "comm", "rank", "size")),
    Metric("gpuwatch.nccl.communicator.collectives", "", Kind.COUNTER,
           "Collectives on one communicator of the process: its sequence number, by which the ranks "
           "of a node are lined up.", ("pid", "process", "comm", "rank", "size")),
    Metric(NCCL_COLLECTIVES_COMPARED := "gpuwatch.nccl.collectives.compared", "", Kind.COUNTER,
           "Collectives of a communicator whose entry times were compared across all its ranks on this "
           "node (two or more processes).", ("comm",)),
    Metric(NCCL_RANK_LAST := "gpuwatch.nccl.rank.last", "", Kind.COUNTER,
           "Compared collectives this rank entered last of the node's ranks.", ("comm", "rank", "pid", "process")),
    Metric(NCCL_RANK_LATENESS := "gpuwatch.nccl.rank.lateness", "s", Kind.COUNTER,
           "Sum, over the compared collectives this rank entered last, of how long after the rank "
           "before it: divided by gpuwatch_nccl_rank_last_total, the mean wait it caused.",
           ("comm", "rank", "pid", "process")),
    Metric(PROCESS_CUDA_MEMORY_LIVE := "gpuwatch.process.cuda.memory.live", "By", Kind.GAUGE,
           "Device memory the process holds through driver allocations seen since the probe attached "
           "(cuMemAlloc*, cuMemCreate; minus frees), pooled or not: gpuwatch_process_cuda_memory_pooled_bytes "
           "says how much of it a pool allocator holds.",
           ("pid", "process")),
    Metric(PROCESS_CUDA_MEMORY_POOLED := "gpuwatch.process.cuda.memory.pooled", "By", Kind.GAUGE,
           "Of the process's live driver allocations, the bytes a pool allocator made, told by the libraries "
           "on each allocating call stack (allocator: pytorch, cupy, xla, rmm, tensorflow, or a name from "
           "ebpf.pool_libraries): the grey color when no in-process agent reports. Live minus pooled is "
           "memory taken outside any allocator (plain cuMemAlloc/cudaMalloc calls).",
           ("pid", "process", "allocator")),
    Metric("gpuwatch.ebpf.attached", "", Kind.GAUGE,
           "CUDA driver libraries the eBPF probe has attached to, and the uprobes on them.", ("what",)),
    Metric("gpuwatch.ebpf.launch.sampled", "1", Kind.GAUGE,
           "Fraction of the time since the eBPF probe started during which launch calls were counted; "
           "below 1 the launch APIs' gpuwatch_cuda_calls_total are estimates (calls in the windows scaled "
           "by the cycle).", ()),
    Metric("gpuwatch.ebpf.launch.rate", "", Kind.GAUGE,
           "Kernel launches per second on the node as the eBPF probe last measured them (what=\"measured\"), "
           "and the budget (what=\"budget\", ebpf.launch_budget) under which every launch is probed: above "
           "it the launch duty cycle (ebpf.launch_sampling) applies, except while a process is in its first "
           "ebpf.new_process_exact seconds, a graph capture began in the last 60 s or a trace asks. Exported "
           "while launch_sampling < 1.", ("what",)),
    # --- CUPTI, from in-process agents (`gpuwatch run`) ---------------------------------------
    # Kernel series count only while activity was on in that process (a duty cycle by default):
    # divide by gpuwatch.cupti.observed for the fraction of time. The busiest kernels
    # of the busiest processes are kept, the rest folded into kernel="other" / pid="other".
    Metric(PROCESS_GPU_MEMORY_ALLOCATED := "gpuwatch.process.gpu.memory.allocated", "By", Kind.GAUGE,
           "Bytes in live tensors or arrays (torch.cuda.memory_allocated, CuPy's pool used_bytes, JAX's "
           "bytes_in_use; summed when a program uses several), from the in-process agent, for a GPU NVML "
           "lists the process on: the 'white' color of the leak detector.", ("gpu", "pid", "process")),
    Metric(PROCESS_GPU_MEMORY_RESERVED := "gpuwatch.process.gpu.memory.reserved", "By", Kind.GAUGE,
           "Bytes the framework's caching allocator holds from the driver (torch.cuda.memory_reserved, "
           "CuPy's pool total_bytes, JAX's pool_bytes), from the in-process agent, for a GPU NVML lists the "
           "process on: the 'grey' color.",
           ("gpu", "pid", "process")),
    # Bytes an in-process agent reports for a GPU whose processes NVML cannot list (not supported,
    # folded beyond its cap, another PID namespace): shown, never judged.
    Metric(PROCESS_GPU_MEMORY_ALLOCATED_SELF_REPORTED := "gpuwatch.process.gpu.memory.allocated.self_reported",
           "By", Kind.GAUGE,
           "Bytes in live tensors as the in-process agent reports them for a GPU NVML cannot confirm the "
           "process on: not read by the leak detector or alert rules.", ("gpu", "pid", "process")),
    Metric(PROCESS_GPU_MEMORY_RESERVED_SELF_REPORTED := "gpuwatch.process.gpu.memory.reserved.self_reported",
           "By", Kind.GAUGE,
           "Bytes the allocator holds as the in-process agent reports them for a GPU NVML cannot confirm the "
           "process on: not read by the leak detector or alert rules.", ("gpu", "pid", "process")),
    Metric("gpuwatch.cupti.reports.refused", "", Kind.COUNTER,
           "In-process reports not kept: too_often (more than one per process every 0.1 s), user_limit "
           "(16 reporting processes per user), total_limit (256 in all), unknown_process (gone).",
           ("reason",)),
    Metric("gpuwatch.cupti.memory.refused", "", Kind.COUNTER,
           "Memory entries of in-process reports dropped: unknown_gpu (a GPU NVML does not know), "
           "not_on_gpu (NVML lists that GPU's processes and the reporter is not among them).", ("reason",)),
    Metric(PROCESS_KERNEL_DURATION := "gpuwatch.process.kernel.duration", "s", Kind.COUNTER,
           "GPU time of the kernel (CUPTI kernel activity, start to end on the GPU) while kernel "
           "activity was on.", ("pid", "process", "kernel")),
    Metric(PROCESS_KERNEL_LAUNCHES := "gpuwatch.process.kernel.launches", "", Kind.COUNTER,
           "Kernel executions seen by CUPTI while kernel activity was on.", ("pid", "process", "kernel")),
    Metric("gpuwatch.process.kernel.mean_duration", "s", Kind.GAUGE,
           "Mean GPU time per execution of the kernel.", ("pid", "process", "kernel")),
    Metric(PROCESS_KERNEL_THEORETICAL_OCCUPANCY := "gpuwatch.process.kernel.theoretical_occupancy", "1", Kind.GAUGE,
           "Theoretical occupancy of the kernel's launch configuration (warps that fit on an SM as a "
           "fraction of the maximum; the lowest of its configurations).", ("pid", "process", "kernel")),
    Metric(PROCESS_KERNEL_GRID_BLOCKS := "gpuwatch.process.kernel.grid_blocks", "", Kind.GAUGE,
           "Blocks in the kernel's last grid (the smallest over its configurations): 1 is a degenerate "
           "launch that uses one SM.", ("pid", "process", "kernel")),
    Metric("gpuwatch.cupti.state", "", Kind.GAUGE,
           "1 for the in-process agent's current CUPTI state: idle (no CUDA yet), on, yielded (another "
           "profiler has CUPTI), unavailable, failed.", ("pid", "process", "state")),
    Metric("gpuwatch.cupti.observed", "s", Kind.COUNTER,
           "Time kernel, copy and set activity was on in the process (the denominator of the kernel series).",
           ("pid", "process")),
    Metric("gpuwatch.cupti.records", "", Kind.COUNTER,
           "CUPTI activity records the in-process agent decoded.", ("pid", "process")),
    Metric("gpuwatch.cupti.records.dropped", "", Kind.COUNTER,
           "CUPTI activity records dropped for want of buffer space.", ("pid", "process")),
    Metric("gpuwatch.cupti.decode.duration", "s", Kind.COUNTER,
           "CPU time the in-process agent spent decoding records (its main cost to the program).",
           ("pid", "process")),
    # --- detectors ---------------------------------------------------------------------------
    Metric(LEAK_SUSPECTED := "gpuwatch.leak.suspected", "", Kind.GAUGE,
           "1 while the leak detector sees the process's memory of this color grow steadily: white "
           "(tensors), grey (the allocator's pool), black (outside the allocator).",
           ("gpu", "pid", "process", "color")),
    Metric(LEAK_GROWTH_RATE := "gpuwatch.leak.growth.rate", "By/s", Kind.GAUGE,
           "How fast the leaking color grows (slope of its floor over the detector's window).",
           ("gpu", "pid", "process", "color")),
    Metric(LEAK_TIME_TO_OOM := "gpuwatch.leak.time_to_oom", "s", Kind.GAUGE,
           "Seconds until the GPU runs out of memory at the leak's rate (free memory, other processes "
           "included, over the growth rate).", ("gpu", "pid", "process", "color")),
    Metric(HOST_BOUND_SUSPECTED := "gpuwatch.host_bound.suspected", "", Kind.GAUGE,
           "1 while the host_bound detector sees a GPU process's GPU work fall while a host-side cause "
           "holds (cause: page_cache_eviction, input_thread, cpu_throttled, swapping, memory_pressure, "
           "io_pressure).", ("gpu", "pid", "process", "cause")),
    Metric(NCCL_STRAGGLER_LATENESS := "gpuwatch.nccl.straggler.lateness", "s", Kind.GAUGE,
           "While the straggler detector names a rank (it entered most collectives of its communicator "
           "last on this node): how long after the rank before it, on average.",
           ("gpu", "comm", "rank", "pid", "process")),
    Metric("gpuwatch.oom.events", "", Kind.COUNTER,
           "Out-of-memory events since the agent started: the driver returned CUDA_ERROR_OUT_OF_MEMORY "
           "(cause=\"driver\", eBPF), the program's framework raised its out-of-memory error "
           "(cause=\"out_of_memory_error\", the in-process agent of `gpuwatch run`), or a process with a leak "
           "finding exited with its GPU >= 95 % full (cause=\"gpu_full_at_exit\"). gpu is the leak's GPU, or "
           "the GPU the in-process agent named (one NVML lists the process on); empty when neither is known.",
           ("gpu", "cause")),
    Metric("gpuwatch.oom.forecast.error", "1", Kind.HISTOGRAM,
           "OOMs a leak finding had forecast, by how far off the forecast made when the leak was first found "
           "was: |came / forecast - 1| (0.05: 5 % off), came=early (before the forecast) or late. "
           "histogram_quantile() over its buckets gives the typical error.",
           ("gpu", "came"), buckets=(0.05, 0.1, 0.2, 0.5, 1.0, 2.0)),
    # --- GPM (Hopper and newer) ----------------------------------------------------------
    Metric("gpuwatch.gpu.sm.activity", "1", Kind.GAUGE,
           "GPM: fraction of time at least one warp was active on an SM, averaged over SMs.", _G),
    Metric("gpuwatch.gpu.sm.occupancy", "1", Kind.GAUGE,
           "GPM: warps resident on SMs as a fraction of the maximum, averaged over SMs.", _G),
    Metric("gpuwatch.gpu.pipe.activity", "1", Kind.GAUGE,
           "GPM: fraction of cycles a pipe was active (tensor, fp16, fp32, fp64).", ("gpu", "pipe")),
    Metric("gpuwatch.gpu.dram.activity", "1", Kind.GAUGE,
           "GPM: DRAM bandwidth utilisation as a fraction of peak.", _G),
    # --- control socket (agent/control.py) ---------------------------------------------------
    Metric("gpuwatch.control.requests", "", Kind.COUNTER,
           "Control socket requests by method and result: ok; refused (bad params, not the caller's, "
           "malformed or too large); error (the agent failed); busy (refused at connect: the caller's, "
           "ordinary users' or every connection slot taken); gone (the process that opened the connection "
           "has exited); idle (closed with no request); timeout (a request that did not arrive whole). "
           "method is a control method, unknown (none could be read, or no such method) or none (no request "
           "was read).", ("method", "result")),
    # --- budgets (agent/budget.py) ------------------------------------------------------------
    Metric("gpuwatch.budget.used", "", Kind.GAUGE,
           "What users' processes make the agent keep now, all users together, in the budget's unit: graphs "
           "(bytes of CUDA graph state), libraries (libcuda/libnccl files attached), uprobes, stacks (bytes of "
           "symbolised frames), files (followed in the page cache). Limits per user and node-wide: [budget].",
           ("budget",)),
    Metric("gpuwatch.budget.refusals", "", Kind.COUNTER,
           "Charges to a budget refused: limit=user (that user's share was full: only their processes lose "
           "detail) or node (all users together were at the node-wide limit). Said once per user and budget in "
           "the log.", ("budget", "limit")),
    # --- /metrics server (exporters/prometheus.py) -------------------------------------------
    Metric("gpuwatch.http.connections", "", Kind.COUNTER,
           "Connections to /metrics by how they ended: served (its request arrived whole and was answered, "
           "an error of its own parse included); busy (answered 503: prometheus.max_requests requests were being "
           "answered); evicted (closed before its request arrived, for a newer connection: "
           "prometheus.max_unfinished in all, 16 per remote address); over_budget (closed before its request "
           "arrived: the request heads being read reached 1 MiB in all, and it had sent the most); too_large "
           "(request line and headers over 64 KiB: 414 or 431); timeout (no whole request, TLS handshake "
           "included, within prometheus.header_timeout); tls_failed (a failed TLS handshake, plain HTTP to the "
           "TLS port, a client certificate not allowed); closed (the client closed before sending a request).",
           ("result",)),
    # --- config reloads (agent/reload.py) ----------------------------------------------------
    Metric("gpuwatch.config.last_reload.success", "", Kind.GAUGE,
           "1 when the last SIGHUP reload of the config was accepted (or none was asked since the start), 0 when "
           "it was rejected and the agent runs on the config it had (the log and `gpuwatch status` say why). As "
           "Prometheus' prometheus_config_last_reload_successful."),
    Metric("gpuwatch.config.last_reload.success_timestamp", "s", Kind.GAUGE,
           "Unix time of the last successful load of the config: the start, or the last accepted reload."),
    # --- OTLP export (exporters/otlp.py) -----------------------------------------------------
    Metric("gpuwatch.otlp.items", "", Kind.COUNTER,
           "OTLP export, from the OpenTelemetry SDK's own counters: signal=metrics (data points) or logs "
           "(events); result=exported, failed (the receiver refused, was down or too slow, after retries) or "
           "dropped_queue_full (the log queue was full: the receiver could not keep up).", ("signal", "result")),
    Metric("gpuwatch.otlp.up", "", Kind.GAUGE,
           "1 when the last OTLP export of metrics (one every otlp.interval) reached the receiver, 0 when it "
           "failed (refused, down or too slow, after retries); absent before the first export. The agent logs "
           "one line when it goes down, with why, and one when it is back."),
    Metric("gpuwatch.otlp.export.failures", "", Kind.COUNTER,
           "OTLP exports (batches) that failed after retries, by signal (metrics, logs).", ("signal",)),
    # --- reference workload (probes/baseline) and its judgement (detectors/health) ------------
    # Values of each GPU's latest run; a GPU that never ran the workload has none.
    Metric("gpuwatch.baseline.gemm.throughput", "{flop}/s", Kind.GAUGE,
           "Reference workload, 8192^3 bf16 GEMM + bias + GELU: kernel=fused (gpuwatch's Triton kernel), "
           "cublas (the GEMM alone, torch.matmul), cublaslt_fused (cuBLASLt's GELU epilogue), unfused "
           "(matmul, + bias, GELU), in the same run.", ("gpu", "kernel")),
    Metric("gpuwatch.baseline.gemm.efficiency", "{flop}/{cycle}", Kind.GAUGE,
           "Reference workload: the fused kernel's FLOP per SM clock cycle (each timed block at the clock "
           "NVML read during it; median of blocks). What the health judgement compares.", _G),
    Metric("gpuwatch.baseline.memory.throughput", "By/s", Kind.GAUGE,
           "Reference workload: a 1 GiB device-to-device copy kernel, bytes read + written per second.", _G),
    Metric(BASELINE_RELATIVE_THROUGHPUT := "gpuwatch.baseline.relative_throughput", "1", Kind.GAUGE,
           "Latest run against a reference: reference=own (median of this GPU's recent normal runs of the "
           "same shape, kernel and software) or sku (what a healthy GPU of the model reaches); "
           "workload=gemm (per SM cycle) or memory.", ("gpu", "workload", "reference")),
    Metric(BASELINE_THRESHOLD := "gpuwatch.baseline.threshold", "1", Kind.GAUGE,
           "relative_throughput{reference=\"own\"} below this is a slower GPU: 1 - max(baseline.k_spread (2.5) x "
           "the baseline's measured spread, baseline.min_drop (1.5 %; memory: min_drop_memory, 1 %)); a run "
           "judged slower is taken twice more and the median decides (baseline.retakes).",
           ("gpu", "workload", "reference")),
    Metric(BASELINE_WRONG_ANSWERS := "gpuwatch.baseline.wrong_answers", "", Kind.GAUGE,
           "Latest run: output elements beyond tolerance of the float64 reference, plus 1 when the output's "
           "digest changed on unchanged inputs and software. Above 0 is silent data corruption.", _G),
    Metric("gpuwatch.baseline.last_run.timestamp", "s", Kind.GAUGE,
           "Unix time of the GPU's latest reference-workload run.", _G),
    Metric("gpuwatch.baseline.runs", "", Kind.COUNTER,
           "Reference-workload runs by result: ok, slower, below_sku, wrong (judged), skipped (the GPU had "
           "compute processes), failed (the run did not complete; the log says why).", ("gpu", "result")),
    # --- CUPTI PM sampling, device-wide (a supervised child of the daemon) ----------------------
    # One metric at a time (GH100 takes no two in one pass): each value is the mean over the last
    # window of its group (cupti.group_seconds), refreshed once per rotation; withdrawn after three
    # rotations without one, and while another profiler has the counters.
    Metric("gpuwatch.gpu.achieved_occupancy", "1", Kind.GAUGE,
           "CUPTI PM sampling: warps active per active SM cycle as a fraction of the SM's maximum "
           "(sm__warps_active.avg.pct_of_peak_sustained_active, Nsight Compute's achieved occupancy), "
           "device-wide. Only cycles with work count, so idle time does not lower it; "
           "gpuwatch.gpu.sm.occupancy (GPM) averages over all cycles.", _G),
    Metric("gpuwatch.gpu.cache.hit_ratio", "1", Kind.GAUGE,
           "CUPTI PM sampling: fraction of L1 sector requests that hit, device-wide: cache=l1 "
           "(l1tex__t_sector_hit_rate; within 5 points of Nsight Compute on the H200). No cache=l2: "
           "PM sampling offers no L2 hit rate (its lts__average_t_sector_hit_rate_realtime read 50 % "
           "on a copy Nsight Compute saw hit 99.8 %, docs/cupti.md). Absent when the window saw no "
           "traffic.", ("gpu", "cache")),
    Metric("gpuwatch.gpu.dram.throughput.utilization", "1", Kind.GAUGE,
           "CUPTI PM sampling: DRAM throughput as a fraction of its peak sustained rate "
           "(dram__throughput.avg.pct_of_peak_sustained_elapsed, the busiest of the DRAM unit's "
           "throughput sub-metrics, so it can read higher than bytes moved / peak bandwidth), over its "
           "window in the rotation. gpuwatch.gpu.dram.activity (GPM) is bytes-based, over every "
           "interval.", _G),
    Metric("gpuwatch.profiling.state", "", Kind.GAUGE,
           "1 for the device-wide counter sampler's current state: sampling (or starting), yielded "
           "(another profiler - ncu, nsys, DCGM, an injected tool - has or may have the counters), "
           "backoff (restarting after the sampler hung or crashed), paused (stepped aside, its context "
           "released, while the agent's own reference workload holds a GPU), unavailable (CUPTI cannot "
           "run here; then the probe is down, gpuwatch_probe_up{probe=\"cupti_sampler\"} 0).", ("state",)),
    Metric("gpuwatch.agent.gpu_process", "", Kind.GAUGE,
           "1 for each process of the agent's own that may hold a CUDA context: role=cupti_sampler (the "
           "device-wide counter sampler, titled gpuwatch-sampler) or baseline (the reference workload). "
           "The baseline's busy check, the leak detector and top do not count them as users' processes.",
           ("pid", "role")),
    Metric("gpuwatch.cupti.sampler.restarts", "", Kind.COUNTER,
           "Restarts of the CUPTI PM sampling child: reason=hang (silent past its timeout, killed) or "
           "crash (exited unexpectedly).", ("reason",)),
    Metric("gpuwatch.cupti.sampler.invalid_lines", "", Kind.COUNTER,
           "Lines the CUPTI PM sampling child printed that are not its JSON protocol (ignored).", ()),
)

REGISTRY: dict[str, Metric] = {m.name: m for m in METRICS}


def get(name: str) -> Metric:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"metric {name!r} is not in the registry (agent/metrics.py)") from None


def _check_registry() -> None:
    seen: dict[str, str] = {}
    for m in METRICS:
        assert m.unit in _UNIT_SUFFIX, f"{m.name}: unit {m.unit!r} has no Prometheus suffix rule"
        if m.kind is Kind.HISTOGRAM:
            assert m.buckets and list(m.buckets) == sorted(set(m.buckets)) and math.isfinite(m.buckets[-1]), \
                f"{m.name}: a histogram's buckets are finite bounds, ascending"
            assert "le" not in m.labels, f"{m.name}: le is the bucket's label"
        else:
            assert not m.buckets, f"{m.name}: only histograms have buckets"
        assert m.prom_name not in seen, f"{m.name} and {seen[m.prom_name]} derive the same Prometheus name"
        seen[m.prom_name] = m.name


_check_registry()
