"""gpuwatch / GPU memory and leaks: the three colors of GPU memory per process, and the leak findings."""
from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders.dashboard import Row

from .common import (
    GPU, Q, build_dashboard, colors, dashed, dashed_line, datasource_var, gpu_var, increase, node_var, process_var,
    quantile, sel, stat, steps, table, ts, with_index,
)


COLOR_OF = {"^white": "#E0E0E0", "^grey": "#8E8E8E", "^black": "#3D3D3D"}


def dashboard() -> grafana.Dashboard:
    proc = {"process": ("=~", "$process")}
    who = "{{process}} {{pid}} " + GPU
    return build_dashboard(
        "gpuwatch-gpu-memory", "gpuwatch / GPU memory and leaks",
        "GPU memory per process in three colors — white: bytes in live tensors, grey: what the framework's "
        "allocator holds, black: what the driver charges — and the leak detector's findings with their "
        "time to out of memory (docs/leaks.md).",
        [datasource_var(), node_var(), gpu_var(), process_var("gpuwatch.process.gpu.memory.usage")],
        [
            Row("GPUs"),
            ts("Memory used", Q(with_index(sel("hw.gpu.memory.usage")), GPU),
               Q(with_index(sel("hw.gpu.memory.limit")), GPU + " total")).unit("bytes").min(0)
            .override_by_regexp(" total$", dashed_line()),
            ts("Memory free", Q(with_index(sel("gpuwatch.gpu.memory.free")), GPU)).unit("bytes").min(0)
            .description("NVML's free memory: what a leak's time to out of memory counts down."),
            Row("Three colors per process"),
            ts("$process: white, grey, black",
               Q(with_index(sel("gpuwatch.process.gpu.memory.allocated", **proc)), "white (tensors) " + who,
                 needs="inprocess"),
               Q(with_index(sel("gpuwatch.process.gpu.memory.reserved", **proc)), "grey (allocator pool) " + who,
                 needs="inprocess"),
               Q(f'sum by (instance, pid, process) ({sel("gpuwatch.process.cuda.memory.pooled", **proc)})',
                 "grey (pooled driver allocations, eBPF) {{process}} {{pid}} {{instance}}", needs="ebpf_pool"),
               Q(with_index(sel("gpuwatch.process.gpu.memory.usage", **proc)), "black (driver) " + who))
            .unit("bytes").min(0).overrides(colors(COLOR_OF))
            # the whole line: Grafana splits it between the repeats, two to a line
            .span(24).repeat("process").max_per_row(2)
            .description("White rising steadily: tensors kept alive. Grey rising while white is flat: the "
                         "allocator's pool grows. Black rising while grey is flat: memory taken outside the "
                         "allocator (raw cudaMalloc, library workspaces). Grey from eBPF stands in when no "
                         "in-process agent reports: the driver allocations a pool allocator made, told by their "
                         "call stacks."),
            ts("White: bytes in live tensors",
               Q(with_index(sel("gpuwatch.process.gpu.memory.allocated", **proc)), who, needs="inprocess"))
            .unit("bytes").min(0).span(8)
            .description("torch.cuda.memory_allocated(), CuPy's pool used_bytes(), "
                         "JAX's bytes_in_use, from the in-process agent."),
            ts("Grey: the allocator's pool",
               Q(with_index(sel("gpuwatch.process.gpu.memory.reserved", **proc)), who, needs="inprocess"))
            .unit("bytes").min(0).span(8)
            .description("torch.cuda.memory_reserved(), CuPy's pool total_bytes(), "
                         "JAX's pool_bytes, from the in-process agent."),
            ts("Black: charged by the driver", Q(with_index(sel("gpuwatch.process.gpu.memory.usage", **proc)), who))
            .unit("bytes").min(0).span(8).description("NVML's per-process used memory."),
            ts("Self-reported white and grey (not judged)",
               Q(with_index(sel("gpuwatch.process.gpu.memory.allocated.self_reported", **proc)), "white " + who,
                 needs="self_reported"),
               Q(with_index(sel("gpuwatch.process.gpu.memory.reserved.self_reported", **proc)), "grey " + who,
                 needs="self_reported")).unit("bytes").min(0).span(24)
            .description("What in-process agents report for a GPU NVML cannot confirm them on: shown, never "
                         "judged by the leak detector or alert rules."),
            table("Kubernetes pods of GPU processes",
                  Q(sel("gpuwatch.process.kubernetes", **proc), needs="kubernetes"), hide=("Value",)).span(24)
            .height(6)
            .description("Namespace, pod and container of each GPU process, from its cgroup (docs/kubernetes.md); "
                         "join with the per-process series on instance and pid."),
            Row("Leaks"),
            stat("Leaks suspected", Q(f'sum({sel("gpuwatch.leak.suspected", **proc)}) or vector(0)')).unit("none")
            .span(4).height(8).thresholds(steps("green", (1, "red"))),
            stat("Soonest out of memory", Q(f'min({sel("gpuwatch.leak.time_to_oom", **proc)})', needs="leak"))
            .unit("s").span(4).height(8).thresholds(steps("red", (1800, "orange"), (3600, "green")))
            .description("Alert under 30 minutes: GpuMemoryLeakOutOfMemorySoon."),
            table("Suspected leaks", Q(with_index(sel("gpuwatch.leak.growth.rate", **proc)), needs="leak"),
                  Q(with_index(sel("gpuwatch.leak.time_to_oom", **proc)), needs="leak"),
                  columns={"A": ("growth", "binBps"), "B": ("out of memory in", "s")}).span(16).height(8)
            .description("Open leak findings: which color grows, how fast, and when the GPU runs out of "
                         "memory at that rate. `gpuwatch leaks` on the node shows the window and, with eBPF, "
                         "the allocating call stacks."),
            ts("Leak growth rate",
               Q(with_index(sel("gpuwatch.leak.growth.rate", **proc)), "{{color}} " + who,
                 needs="leak")).unit("binBps").min(0).overrides(colors(COLOR_OF)),
            ts("Time to out of memory",
               Q(with_index(sel("gpuwatch.leak.time_to_oom", **proc)), "{{color}} " + who,
                 needs="leak")).unit("s").min(0).thresholds(steps("green", (1800, "red")))
            .thresholds_style(dashed()),
            ts("Out-of-memory events",
               Q(f'sum by (instance, gpu, cause) ({increase("gpuwatch.oom.events", "1h")})',
                 "{{instance}} {{gpu}} {{cause}}", needs="oom")).unit("none").min(0)
            .description("OOMs in the last hour (`gpuwatch findings` lists each, with the forecast made for it)."),
            stat("How good the forecasts were",
                 Q(quantile(0.5, "gpuwatch.oom.forecast.error"), "median", needs="oom_forecast"),
                 Q(quantile(0.9, "gpuwatch.oom.forecast.error"), "90th percentile", needs="oom_forecast"))
            .unit("percentunit").span(6).height(8).thresholds(steps("green", (0.2, "orange"), (0.5, "red")))
            .description("OOMs that a leak finding forecast, in the range: how far off the forecast made when "
                         "the leak was first found was (|came / forecast - 1|), interpolated within the "
                         "histogram's buckets (0.05, 0.1, 0.2, 0.5, 1, 2)."),
            stat("OOMs sooner than forecast",
                 Q(f'sum({increase("gpuwatch.oom.forecast.error", series="count", came="early")}) / '
                   f'sum({increase("gpuwatch.oom.forecast.error", series="count")})', needs="oom_forecast"))
            .unit("percentunit").span(6).height(8).thresholds(steps("green", (0.5, "orange")))
            .description("Of the forecast OOMs in the range, the share that came before the forecast: those "
                         "left less time than their forecast said."),
        ])
