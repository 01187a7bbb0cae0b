"""gpuwatch / Infra health: an inference team's golden signals, and the host side of GPU processes."""
from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders.dashboard import Row

from .common import (
    GPU, Q, STEPPED, build_dashboard, dashed, datasource_var, foreign, gpu_var, keyed, node_var, rate, sel, stat,
    steps, table, ts, with_index,
)


def kv_cache_hit_ratio(window: str = "$__rate_interval") -> str:
    """Prefix-cache hits / queries per vLLM server and model, from whichever of the two names it exports."""
    def per_server(what: str) -> str:
        by = "sum by (instance, model_name)"
        return (f"{by} (rate({foreign(f'vllm:prefix_cache_{what}_total')}[{window}])) or "
                f"{by} (rate({foreign(f'vllm:gpu_prefix_cache_{what}_total')}[{window}]))")
    return f"({per_server('hits')}) / ({per_server('queries')})"


# The golden signals' thresholds, the same as the alert rules' (dashboards/prometheus).
SATURATED = 0.95  # GPU utilisation, for 5 min: GpuSaturated
KV_HIT_LOW = 0.7  # prefix-cache hit ratio, for 10 min: KvCacheHitRatioLow
HOT = 85  # °C, for 5 min: GpuTemperatureHigh
DISK_BUSY = 0.9  # io_time per second, for 10 min: NodeDiskIoBusy


def dashboard() -> grafana.Dashboard:
    util = sel("hw.gpu.utilization", task="general")
    temp = sel("hw.temperature", sensor="gpu")
    disk_busy = f'rate({foreign("node_disk_io_time_seconds_total")}[$__rate_interval])'
    pending = f'sum({foreign("kube_pod_status_phase", phase="Pending")})'
    who = "{{instance}} {{process}} ({{pid}})"
    by_proc = "sum by (instance, pid, process"
    host = {"needs": "host"}
    return build_dashboard(
        "gpuwatch-infra-health", "gpuwatch / Infra health",
        "The five golden signals an inference team watches — GPU saturation, KV-cache hit ratio, GPU "
        "temperature, disk I/O wait, pending pods — with the alert thresholds, gpuwatch's host-bound "
        "findings, and the host side of each GPU process: CPU, memory, faults, disk, cgroup throttling and "
        "pressure, and how much of its files the page cache holds.",
        [datasource_var(), node_var(), gpu_var()],
        [
            Row("Golden signals"),
            stat("GPUs saturated", Q(f"count(min_over_time({util}[5m]) >= {SATURATED}) or vector(0)")).unit("none")
            .span(4).thresholds(steps("green", (1, "red")))
            .description(f"GPUs at {SATURATED:.0%} utilisation or more for the last 5 minutes: more work "
                         "queues than the GPU can run. Alert: GpuSaturated."),
            stat("Lowest KV-cache hit ratio", Q(f"min({kv_cache_hit_ratio()})", needs="vllm")).unit("percentunit")
            .min(0).max(1).span(4).thresholds(steps("red", (KV_HIT_LOW, "green")))
            .description(f"The lowest prefix-cache hit ratio over the vLLM servers and models (under "
                         f"{KV_HIT_LOW:g}: prompts are recomputed that could be reused). Alert: KvCacheHitRatioLow."),
            stat("Hottest GPU", Q(f"max({temp})")).unit("celsius").span(4).thresholds(steps("green", (HOT, "red")))
            .description(f"The highest GPU temperature; above {HOT} °C for 5 minutes: GpuTemperatureHigh."),
            stat("Busiest disk", Q(f"max({disk_busy})", needs="node_exporter")).unit("percentunit").min(0).max(1)
            .span(4).thresholds(steps("green", (DISK_BUSY, "red")))
            .description("The largest fraction of time a disk had I/O in flight, over all node_exporter "
                         f"targets; above {DISK_BUSY:.0%} for 10 minutes: NodeDiskIoBusy."),
            stat("Pending pods", Q(pending, needs="kube_state_metrics")).unit("none").span(4)
            .thresholds(steps("green", (1, "red")))
            .description("Pods in phase Pending, cluster-wide; above 0 for 15 minutes: PodsPending."),
            stat("Host-bound findings", Q(f'sum({sel("gpuwatch.host_bound.suspected")}) or vector(0)')).unit("none")
            .span(4).thresholds(steps("green", (1, "red")))
            .description("GPU processes whose GPU work fell while a host-side cause held. Alert: GpuHostBound."),
            ts("GPU utilisation", Q(with_index(util), GPU)).unit("percentunit").min(0).max(1)
            .thresholds(steps("green", (SATURATED, "red"))).thresholds_style(dashed())
            .description(f"Fraction of the sample period a kernel was running (NVML). At {SATURATED:.0%} or more "
                         "for 5 minutes the GPU is saturated: GpuSaturated."),
            ts("KV-cache hit ratio", Q(kv_cache_hit_ratio(), "{{instance}} {{model_name}}", needs="vllm"))
            .unit("percentunit").min(0).max(1).thresholds(steps("red", (KV_HIT_LOW, "green")))
            .thresholds_style(dashed())
            .description("vLLM's prefix-cache hits / queries per server and model (vllm:prefix_cache_*_total, "
                         "or vllm:gpu_prefix_cache_*_total from older servers). Under "
                         f"{KV_HIT_LOW:g} for 10 minutes: KvCacheHitRatioLow."),
            ts("GPU temperature", Q(with_index(temp), GPU)).unit("celsius").thresholds(steps("green", (HOT, "red")))
            .thresholds_style(dashed())
            .description(f"GPU core temperature (NVML). Above {HOT} °C for 5 minutes: GpuTemperatureHigh."),
            ts("Disk I/O busy", Q(disk_busy, "{{instance}} {{device}}", needs="node_exporter")).unit("percentunit")
            .min(0).max(1).thresholds(steps("green", (DISK_BUSY, "red"))).thresholds_style(dashed())
            .description("Fraction of time each disk had I/O in flight (node_exporter's "
                         "node_disk_io_time_seconds_total per second), on every node_exporter target. Above "
                         f"{DISK_BUSY:.0%} for 10 minutes: NodeDiskIoBusy."),
            ts("Pods pending", Q(pending, "pending", needs="kube_state_metrics")).unit("none").min(0).span(24)
            .thresholds(steps("green", (1, "red"))).thresholds_style(dashed())
            .description("Pods in phase Pending, cluster-wide (kube-state-metrics). Above 0 for 15 minutes: "
                         "PodsPending."),
            Row("Host-bound findings"),
            table("Host-bound GPU processes",
                  Q(with_index(f'{sel("gpuwatch.host_bound.suspected")} == 1'), needs="host_bound"), hide=("Value",))
            .span(12)
            .description("Open host_bound findings: the GPU process, and the host-side cause its GPU work "
                         "fell with (page_cache_eviction, input_thread, cpu_throttled, swapping, "
                         "memory_pressure, io_pressure). `gpuwatch findings` on the node has the evidence."),
            ts("Host-bound findings over time",
               Q(with_index(sel("gpuwatch.host_bound.suspected")), GPU + " {{process}} ({{pid}}) {{cause}}",
                 needs="host_bound")).unit("none").min(0).max(1).line_interpolation(STEPPED)
            .description("1 while a finding is open. Alert after 2 minutes: GpuHostBound."),
            table("Late NCCL ranks",
                  Q(with_index(sel("gpuwatch.nccl.straggler.lateness")), needs="straggler"),
                  columns={"A": ("lateness", "s")}).span(24)
            .description("Open straggler_rank findings: the rank of an NCCL communicator that enters most "
                         "collectives last on its node, with its pid, GPU and mean lateness (how long the other "
                         "ranks wait for it each time). Alert after 2 minutes: GpuNcclStragglerRank; `gpuwatch "
                         "findings --kind straggler_rank` says what its host side was doing."),
            Row("Host side of GPU processes"),
            ts("Process CPU", Q(sel("gpuwatch.process.cpu.utilization"), who, **host)).unit("percentunit").min(0)
            .description("CPU time of each GPU process per second (100 %: one core busy; above is several)."),
            ts("CPU time by mode",
               Q(f'{by_proc}, mode) ({rate("gpuwatch.process.cpu.time")})', who + " {{mode}}", **host))
            .unit("percentunit").min(0).description("user and system CPU time per second."),
            ts("Busiest threads",
               Q(sel("gpuwatch.process.thread.cpu.utilization"), who + " {{thread}} ({{tid}})",
                 **host)).unit("percentunit").min(0).thresholds(steps("green", (0.9, "red")))
            .thresholds_style(dashed())
            .description("The busiest 3 threads of each GPU process. One near 100 % is a single thread the GPU "
                         "waits on, such as a data loader (cause input_thread)."),
            ts("Host memory", Q(sel("gpuwatch.process.memory.rss"), who + " resident", **host),
               Q(sel("gpuwatch.process.memory.swap"), who + " swapped", **host)).unit("bytes").min(0)
            .description("Resident and swapped-out host memory (swap in use: cause swapping)."),
            ts("Page faults",
               Q(f'{by_proc}, type) ({rate("gpuwatch.process.paging.faults")})', who + " {{type}}",
                 **host)).unit("cps").min(0)
            .description("Major faults read a page from disk (an evicted file page, or swap); minor ones do not."),
            ts("Process disk I/O",
               Q(f'{by_proc}, direction) ({rate("gpuwatch.process.disk.io")})',
                 who + " {{direction}}", **host)).unit("Bps").min(0)
            .description("Bytes each GPU process read from and wrote to storage (page-cache hits excluded)."),
            ts("Context switches",
               Q(f'{by_proc}, type) ({rate("gpuwatch.process.context_switches")})',
                 who + " {{type}}", **host)).unit("cps").min(0).span(8)
            .description("Voluntary (waits) and involuntary (preempted: too few cores) switches per second."),
            ts("Threads in D state", Q(sel("gpuwatch.process.threads.blocked"), who, **host)).unit("none").min(0)
            .span(8).description("Threads in uninterruptible sleep, mostly waiting on disk."),
            ts("CPU quota throttling",
               Q(f'{by_proc}) ({rate("gpuwatch.process.cgroup.cpu.throttled.time")})', who + " throttled s/s",
                 **host),
               Q(f'{by_proc}) ({rate("gpuwatch.process.cgroup.cpu.throttled.periods")})', who + " periods/s",
                 **host)).unit("short").min(0).span(8)
            .description("Time per second the process's cgroup was held by its CPU quota, and the throttled "
                         "periods per second (cause cpu_throttled: raise the pod's CPU limit)."),
            ts("Pressure stall",
               Q(f'{by_proc}, resource, scope) ({rate("gpuwatch.process.cgroup.pressure.stall.time")})',
                 who + " {{resource}} {{scope}}", **host)).unit("percentunit").min(0)
            .description("Share of time tasks of the process's cgroup stalled on cpu, io or memory (PSI; some: "
                         "at least one task, full: all). Causes memory_pressure, io_pressure."),
            ts("Node top readers", Q(sel("gpuwatch.node.process.disk.read.rate"), who, **host)).unit("Bps").min(0)
            .description("The 5 processes of the node reading most from storage, GPU or not: who may be "
                         "evicting a GPU process's files from the page cache."),
            table("File page-cache residency",
                  Q(keyed(f'{sel("gpuwatch.process.file.cache.resident")} / {sel("gpuwatch.process.file.size")}',
                          "instance", "pid", "process", "file"), needs="host_files"),
                  Q(keyed(sel("gpuwatch.process.file.size"), "instance", "pid", "process", "file"),
                    needs="host_files"),
                  Q(keyed(sel("gpuwatch.process.file.cache.evicted"), "instance", "pid", "process", "file"),
                    needs="host_evicted"),
                  columns={"A": ("resident", "percentunit"), "B": ("size", "bytes"),
                           "C": ("evicted", "bytes")}).span(24)
            .description("The large files each GPU process maps or holds open (weights, datasets): how much "
                         "of each the page cache holds, and how much it evicted that the kernel remembers. "
                         "Low residency with major faults: cause page_cache_eviction."),
            ts("Page-cache residency over time",
               Q(f'{sel("gpuwatch.process.file.cache.resident")} / {sel("gpuwatch.process.file.size")}',
                 who + " {{file}}", needs="host_files")).unit("percentunit").min(0).max(1).span(24)
            .description("Resident bytes / size of each large file of a GPU process."),
        ])
