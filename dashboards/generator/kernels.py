"""gpuwatch / Kernels: what the GPU ran, per kernel (CUPTI) and device-wide (PM sampling, GPM)."""
from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders.dashboard import Row

from .common import (
    GPU, Q, build_dashboard, datasource_var, gpu_var, increase, keyed, node_var, process_var, rate, sel, table, ts,
    with_index,
)


def dashboard() -> grafana.Dashboard:
    proc = {"process": ("=~", "$process")}
    kernel = "{{process}} {{pid}} {{kernel}}"
    observed = f'sum by (instance, pid, process) ({rate("gpuwatch.cupti.observed", **proc)})'
    per_observed = f") / on(instance, pid, process) group_left() {observed}"
    per_kernel = ("instance", "pid", "process", "kernel")
    return build_dashboard(
        "gpuwatch-kernels", "gpuwatch / Kernels",
        "What the GPU ran: per kernel GPU time, launches, duration and theoretical occupancy from the in-process "
        "CUPTI agent (`gpuwatch run`), and device-wide achieved occupancy, cache hit ratios and DRAM throughput "
        "from CUPTI PM sampling (NVML GPM beside them).",
        [datasource_var(), node_var(), gpu_var(), process_var("gpuwatch.process.kernel.launches")],
        [
            Row("Kernels (in-process CUPTI agent)"),
            ts("GPU time by kernel",
               Q(f'sum by (instance, pid, process, kernel) ({rate("gpuwatch.process.kernel.duration", **proc)}'
                 + per_observed, kernel, needs="inprocess")).unit("percentunit").min(0)
            .description("Seconds of GPU time per second of observed time (kernel activity is on for a duty "
                         "cycle by default): over 100 % when kernels overlap on streams."),
            ts("Launches by kernel",
               Q(f'sum by (instance, pid, process, kernel) ({rate("gpuwatch.process.kernel.launches", **proc)}'
                 + per_observed, kernel, needs="inprocess")).unit("ops")
            .description("Executions per second of observed time."),
            table("Kernels",
                  Q(f'sum by (instance, pid, process, kernel) ({increase("gpuwatch.process.kernel.duration", **proc)})',
                    needs="inprocess"),
                  Q(f'sum by (instance, pid, process, kernel) ({increase("gpuwatch.process.kernel.launches", **proc)})',
                    needs="inprocess"),
                  Q(keyed(sel("gpuwatch.process.kernel.mean_duration", **proc), *per_kernel), needs="inprocess"),
                  Q(keyed(sel("gpuwatch.process.kernel.theoretical_occupancy", **proc), *per_kernel),
                    needs="inprocess"),
                  Q(keyed(sel("gpuwatch.process.kernel.grid_blocks", **proc), *per_kernel), needs="inprocess"),
                  columns={"A": ("GPU time in range", "s"), "B": ("launches in range", "short"),
                           "C": ("mean duration", "s"), "D": ("theoretical occupancy", "percentunit"),
                           "E": ("grid blocks", "none")}).span(24).height(10)
            .description("Low theoretical occupancy on a kernel that takes much GPU time, or a grid of one "
                         "block, is worth a look (`gpuwatch findings`: low_occupancy, degenerate_grid)."),
            ts("Mean duration", Q(sel("gpuwatch.process.kernel.mean_duration", **proc), kernel, needs="inprocess"))
            .unit("s").min(0),
            ts("Theoretical occupancy",
               Q(sel("gpuwatch.process.kernel.theoretical_occupancy", **proc), kernel, needs="inprocess"))
            .unit("percentunit").min(0).max(1)
            .description("Warps of the launch configuration that fit on an SM, as a fraction of the maximum "
                         "(the lowest of the kernel's configurations)."),
            Row("Device-wide counters"),
            ts("Occupancy",
               Q(with_index(sel("gpuwatch.gpu.achieved_occupancy")), GPU + " achieved (CUPTI)",
                 needs="pm_sampling"),
               Q(with_index(sel("gpuwatch.gpu.sm.occupancy")), GPU + " SM occupancy (GPM)")).unit("percentunit")
            .min(0).max(1)
            .description("Achieved occupancy (CUPTI PM sampling) counts only cycles with work; GPM's SM "
                         "occupancy averages over all cycles, idle ones included."),
            ts("L1 hit ratio",
               Q(with_index(sel("gpuwatch.gpu.cache.hit_ratio", cache="l1")), GPU + " L1",
                 needs="pm_sampling")).unit("percentunit").min(0).max(1)
            .description("L1 sector hit ratio (CUPTI PM sampling; within 5 points of Nsight Compute on the "
                         "H200); absent when a window saw no traffic. No L2: PM sampling offers no L2 hit "
                         "rate (docs/cupti.md)."),
            ts("DRAM",
               Q(with_index(sel("gpuwatch.gpu.dram.throughput.utilization")), GPU + " throughput (CUPTI)",
                 needs="pm_sampling"),
               Q(with_index(sel("gpuwatch.gpu.dram.activity")), GPU + " activity (GPM)")).unit("percentunit").min(0)
            .max(1)
            .description("CUPTI: the busiest DRAM throughput sub-metric against its peak; GPM: bytes moved "
                         "against peak bandwidth."),
            table("Counter sampler", Q(f'{sel("gpuwatch.profiling.state")} == 1', needs="pm_sampling"),
                  hide=("Value",))
            .description("sampling; yielded: another profiler (ncu, nsys, DCGM) has the counters; backoff: "
                         "restarting after a hang or crash; unavailable: CUPTI cannot run here."),
            Row("In-process agents"),
            table("In-process agents", Q(f'{sel("gpuwatch.cupti.state", **proc)} == 1', needs="inprocess"),
                  hide=("Value",))
            .description("Programs started with `gpuwatch run` and their CUPTI state: on, idle (no CUDA "
                         "yet), yielded (another profiler has CUPTI), unavailable, failed."),
            ts("Observed time",
               Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cupti.observed", **proc)})',
                 "{{process}} {{pid}}", needs="inprocess")).unit("percentunit").min(0).max(1)
            .description("Share of time kernel activity was on: the denominator of the kernel series."),
            ts("Records",
               Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cupti.records", **proc)})',
                 "{{process}} {{pid}} decoded", needs="inprocess"),
               Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cupti.records.dropped", **proc)})',
                 "{{process}} {{pid}} dropped", needs="inprocess")).unit("ops"),
            ts("Decoding cost",
               Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cupti.decode.duration", **proc)})',
                 "{{process}} {{pid}}", needs="inprocess")).unit("percentunit").min(0)
            .description("CPU time the in-process agent spent decoding records, per second: its main cost to "
                         "the program."),
        ])
