"""gpuwatch / CUDA API: the driver API calls the eBPF probe sees on libcuda, and NCCL's on libnccl."""
from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders.dashboard import Row

from .common import (
    COLLECTIVES, LAUNCHES, Q, build_dashboard, datasource_var, increase, keyed, node_var, process_var, rate, sel, stat,
    steps, table, ts, value_texts,
)

COMM_KEYS = ("instance", "pid", "process", "comm", "rank", "size")


def outside_allocators(**matchers) -> str:
    """Live driver bytes outside any pool allocator: live minus pooled (0 pooled where a process has
    no pooled series, so that it is not dropped)."""
    by = "sum by (instance, pid, process)"
    live = sel("gpuwatch.process.cuda.memory.live", **matchers)
    return (f"{live} - on(instance, pid, process) ({by} ({sel('gpuwatch.process.cuda.memory.pooled', **matchers)}) "
            f"or {by} (0 * {live}))")


def dashboard() -> grafana.Dashboard:
    proc = {"process": ("=~", "$process")}
    who = "{{process}} {{pid}} {{instance}}"
    calls = "gpuwatch.cuda.calls"
    return build_dashboard(
        "gpuwatch-cuda-api", "gpuwatch / CUDA API",
        "CUDA driver API calls of the processes on the selected nodes, seen by the eBPF probe on libcuda "
        "(runtime, cuBLAS and Triton work all arrive there): calls, latency, errors, launches and bytes.",
        [datasource_var(), node_var(), process_var(calls)],
        [
            Row("eBPF probe"),
            stat("eBPF probe", Q(sel("gpuwatch.probe.up", probe="ebpf"), "{{instance}}", needs="ebpf")).span(4)
            .thresholds(steps("red", (1, "green"))).mappings(value_texts({"1": "up", "0": "down"})),
            stat("Attached", Q(sel("gpuwatch.ebpf.attached"), "{{instance}} {{what}}", needs="ebpf")).unit("none")
            .span(8).thresholds(steps("blue"))
            .description("libcuda libraries the probe attached to, and its uprobes."),
            stat("Calls", Q(f"sum({rate(calls, **proc)})", needs="ebpf")).unit("ops").span(4)
            .thresholds(steps("blue")),
            stat("Errors", Q(f'sum({rate("gpuwatch.cuda.errors", **proc)})', needs="ebpf")).unit("ops").span(4)
            .thresholds(steps("green", (0.001, "orange"))),
            stat("Kernel launches", Q(f"sum({rate(calls, api=('=~', LAUNCHES), **proc)})", needs="ebpf"))
            .unit("ops").span(4).thresholds(steps("blue"))
            .description("Estimated from the launch duty cycle unless ebpf.launch_sampling is 1 (see the "
                         "agent dashboard's eBPF launch sampling)."),
            Row("Calls"),
            ts("Calls by API", Q(f"sum by (api) ({rate(calls, **proc)})", "{{api}}", needs="ebpf")).unit("ops"),
            ts("Calls by process", Q(f"sum by (instance, pid, process) ({rate(calls, **proc)})", who, needs="ebpf"))
            .unit("ops"),
            ts("Mean latency by API",
               Q(f'sum by (api) ({rate("gpuwatch.cuda.call.duration", **proc)}) / sum by (api) ({rate(calls, **proc)})',
                 "{{api}}", needs="ebpf")).unit("s")
            .description("Time inside the API function (entry to return) per call."),
            ts("Time inside the CUDA API, by process",
               Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cuda.call.duration", **proc)})', who,
                 needs="ebpf")).unit("percentunit").min(0)
            .description("Seconds spent in CUDA calls per second, all threads of the process together (over "
                         "100 % when several threads are in the API at once). High with synchronisation calls: "
                         "the CPU waits for the GPU."),
            ts("Errors by API", Q(f'sum by (api) ({rate("gpuwatch.cuda.errors", **proc)})', "{{api}}", needs="ebpf"))
            .unit("ops")
            .description("Calls that returned a CUresult other than CUDA_SUCCESS. "
                         "`gpuwatch trace --pid PID` shows the codes."),
            ts("Kernel launches by process",
               Q(f"sum by (instance, pid, process) ({rate(calls, api=('=~', LAUNCHES), **proc)})", who,
                 needs="ebpf")).unit("ops")
            .description("cuLaunchKernel*, cuLaunchCooperativeKernel* and cuGraphLaunch*. Thousands a second of "
                         "tiny kernels: the process is launch-bound (CUDA graphs, torch.compile)."),
            Row("CUDA graphs"),
            ts("Kernels run by graph replays, by process",
               Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cuda.graph.kernel.launches", **proc)})', who,
                 needs="ebpf")).unit("ops")
            .description("Each cuGraphLaunch runs every kernel node of its graph, with no launch call: counted "
                         "from how each graph was built (stream capture or explicit nodes)."),
            ts("Graph replays by what is known of their content",
               Q(f'sum by (content) ({rate("gpuwatch.cuda.graph.launches", **proc)})', "{{content}}",
                 needs="ebpf")).unit("ops")
            .description("known: every kernel node followed; partial: some missed (a capture while the launch "
                         "duty cycle was off), its kernels a lower bound; unknown: instantiated before the probe "
                         "attached, its kernels not counted."),
            Row("Memory"),
            ts("Bytes by API", Q(f'sum by (api) ({rate("gpuwatch.cuda.bytes", **proc)})', "{{api}}", needs="ebpf"))
            .unit("Bps").description("Bytes asked for by allocations, copies and sets."),
            ts("Live device memory by process",
               Q(sel("gpuwatch.process.cuda.memory.live", **proc), who, needs="ebpf")).unit("bytes").min(0)
            .description("Driver allocations (cuMemAlloc*, cuMemCreate) minus frees since the probe attached, "
                         "pooled or not."),
            ts("Live device memory by allocator",
               Q(sel("gpuwatch.process.cuda.memory.pooled", **proc), "{{process}} {{pid}} {{allocator}} {{instance}}",
                 needs="ebpf_pool"),
               Q(outside_allocators(**proc), "{{process}} {{pid}} outside any allocator {{instance}}", needs="ebpf"))
            .unit("bytes").min(0)
            .description("Who made the live driver allocations, told by the libraries on their call stacks: a "
                         "pool allocator (the grey color where no in-process agent reports) or plain "
                         "cuMemAlloc/cudaMalloc calls outside any allocator (black beyond grey)."),
            Row("NCCL"),
            ts("Collectives by function",
               Q(f'sum by (op) ({rate("gpuwatch.nccl.calls", op=("=~", COLLECTIVES), **proc)})', "{{op}}",
                 needs="nccl")).unit("ops")
            .description("ncclAllReduce, ncclAllGather, ncclReduceScatter, ncclBroadcast, ncclReduce calls, seen "
                         "by the eBPF probe on libnccl (PyTorch's copy included)."),
            ts("NCCL bytes by process",
               Q(f'sum by (instance, pid, process) ({rate("gpuwatch.nccl.bytes", **proc)})', who, needs="nccl"))
            .unit("Bps")
            .description("count x datatype size of each call: per rank, what it contributes (a send count for "
                         "all-gather, a receive count for reduce-scatter)."),
            ts("Mean host enqueue time by function",
               Q(f'sum by (op) ({rate("gpuwatch.nccl.call.duration", **proc)}) / '
                 f'sum by (op) ({rate("gpuwatch.nccl.calls", **proc)})', "{{op}}", needs="nccl")).unit("s")
            .description("Time inside the NCCL call on the host (enqueueing the collective, not running it): "
                         "long ones block the rank's Python between its kernels."),
            ts("Share of collectives entered last, by rank",
               Q(f'sum by (instance, comm, rank, pid, process) ({rate("gpuwatch.nccl.rank.last")}) / on(instance, comm) '
                 f'group_left sum by (instance, comm) ({rate("gpuwatch.nccl.collectives.compared")})',
                 "{{comm}} rank {{rank}} ({{process}} {{pid}}) {{instance}}", needs="nccl_ranks"))
            .unit("percentunit").min(0).max(1)
            .description("Of the collectives each communicator's ranks on the node entered, the share each rank "
                         "entered last: about 1/n each when balanced; one rank near 100 % keeps the others "
                         "waiting (the straggler detector names it)."),
            ts("Mean lateness when last, by rank",
               Q(f'sum by (instance, comm, rank, pid, process) ({rate("gpuwatch.nccl.rank.lateness")}) / '
                 f'sum by (instance, comm, rank, pid, process) ({rate("gpuwatch.nccl.rank.last")})',
                 "{{comm}} rank {{rank}} ({{process}} {{pid}}) {{instance}}", needs="nccl_ranks")).unit("s")
            .description("How long after the rank before it a rank entered the collectives it entered last: what "
                         "the others waited for it each time."),
            table("NCCL communicators by process",
                  Q(keyed(increase("gpuwatch.nccl.communicator.collectives", **proc), *COMM_KEYS), needs="nccl"),
                  Q(keyed(increase("gpuwatch.nccl.communicator.calls", **proc), *COMM_KEYS), needs="nccl"),
                  Q(keyed(increase("gpuwatch.nccl.communicator.bytes", **proc), *COMM_KEYS), needs="nccl"),
                  columns={"A": ("collectives", "none"), "B": ("calls", "none"), "C": ("bytes", "bytes")}).span(12)
            .description("Each process's communicators over the dashboard's range: comm is a hash of the "
                         "communicator's unique id (the same in every rank's process), rank and size from its "
                         "init (empty when the probe attached after it, or for a split)."),
            ts("NCCL errors by function",
               Q(f'sum by (op) ({rate("gpuwatch.nccl.errors", **proc)})', "{{op}}", needs="nccl")).unit("ops")
            .description("NCCL calls that returned an error (an ncclResult_t other than ncclSuccess and "
                         "ncclInProgress); `gpuwatch trace --pid PID` shows the codes."),
            Row("Launches per kernel (CUPTI)"),
            ts("Launches by kernel",
               Q(f'sum by (process, kernel) ({rate("gpuwatch.process.kernel.launches", **proc)})',
                 "{{process}} {{kernel}}", needs="inprocess")).unit("ops").span(24)
            .description("Kernel names come from the in-process CUPTI agent (`gpuwatch run`), counted while its "
                         "kernel activity was on (a duty cycle by default); the Kernels dashboard has more."),
        ])
