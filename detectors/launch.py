"""Launch anomalies per process: launch-bound processes, degenerate grids, low-occupancy kernels
that take a large share of the GPU time.

From the eBPF probe's launch counts (gpuwatch.cuda.calls), NVML's per-process utilisation and the
in-process agent's kernel series (GPU time, launches, grid, theoretical occupancy). Counters are
read as their rises over the last `window` seconds; kernel GPU time counts only while CUPTI
activity was on, so shares are computed within the same series and window. Each finding works with
the data that is there: without CUPTI there are no kernel findings, without eBPF no launch rate.

Pure: observe(history) reads series and returns findings.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from gpuwatch.agent.api import Detector, Finding
from gpuwatch.agent.history import History
from gpuwatch.agent.metrics import (
    CUDA_CALLS, PROCESS_GPU_UTILIZATION, PROCESS_KERNEL_DURATION, PROCESS_KERNEL_GRID_BLOCKS, PROCESS_KERNEL_LAUNCHES,
    PROCESS_KERNEL_THEORETICAL_OCCUPANCY,
)
from gpuwatch.agent.registry import DetectorEntry

# Launch calls that start one kernel each (a graph launch starts many: it is the cure, not the disease).
KERNEL_LAUNCH_APIS = ("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel")


def _launch_api(api: str) -> bool:
    return api.removesuffix("_ptsz") in KERNEL_LAUNCH_APIS


class LaunchDetector(Detector):
    name = "launch"
    interval = 10.0
    kinds = ("launch_bound", "low_occupancy", "degenerate_grid")
    needs = ("ebpf", "cupti")

    def __init__(self, window: float = 60.0, launch_rate: float = 5000.0, short_kernel: float = 20e-6,
                 busy: float = 0.6, low_occupancy: float = 0.25, occupancy_share: float = 0.3,
                 degenerate_share: float = 0.1) -> None:
        self.window = window
        self.launch_rate = launch_rate          # kernel launches per second that make a process launch-heavy
        self.short_kernel = short_kernel        # mean GPU time per kernel under this: the launches dominate
        self.busy = busy                        # NVML process utilisation under this: the GPU waits
        self.low_occupancy = low_occupancy
        self.occupancy_share = occupancy_share  # of the process's kernel GPU time
        self.degenerate_share = degenerate_share

    def observe(self, history: History) -> Iterable[Finding]:
        # The newest point of any input says what "now" is (history holds the probes' timestamps).
        now = history.newest(CUDA_CALLS, PROCESS_KERNEL_DURATION)
        if now is None:
            return []
        since = now - self.window
        procs: dict[tuple[str, str], dict] = defaultdict(lambda: {"launches": 0.0, "span": 0.0, "kernels": {}})
        for s in history.select(CUDA_CALLS, since=since):
            lab = s.labels
            if lab.get("pid") in (None, "other") or not _launch_api(lab.get("api", "")) or now - s.latest_ts > 15:
                continue
            recent = s.window(since)
            if len(recent) < 2:
                continue
            p = procs[(lab["pid"], lab.get("process", ""))]
            p["launches"] += recent.increase(since)
            p["span"] = max(p["span"], recent.span)
        busy: dict[tuple[str, str], list[float]] = defaultdict(list)
        for s in history.select(PROCESS_GPU_UTILIZATION, since=since):
            busy[(s.labels.get("pid", ""), s.labels.get("process", ""))] += [v for _, v in s.window(since).points]
        for metric, field in ((PROCESS_KERNEL_DURATION, "seconds"), (PROCESS_KERNEL_LAUNCHES, "launches"),
                              (PROCESS_KERNEL_THEORETICAL_OCCUPANCY, "occupancy"),
                              (PROCESS_KERNEL_GRID_BLOCKS, "blocks")):
            counter = field in ("seconds", "launches")  # else a gauge: its newest value is enough
            for s in history.select(metric, since=since if counter else float("inf")):
                lab = s.labels
                if lab.get("pid") in (None, "other") or lab.get("kernel") == "other" or now - s.latest_ts > 15:
                    continue
                k = procs[(lab["pid"], lab.get("process", ""))]["kernels"].setdefault(lab["kernel"], {})
                k[field] = s.increase(since) if counter else s.latest
        out: list[Finding] = []
        for (pid, process), p in procs.items():
            out += self._launch_bound(pid, process, p, busy.get((pid, process)), now)
            out += self._kernels(pid, process, p["kernels"], now)
        return out

    def _launch_bound(self, pid: str, process: str, p: dict, busy: list[float] | None, now: float) -> list[Finding]:
        if p["span"] < self.window / 2:
            return []
        rate = p["launches"] / p["span"]
        if rate < self.launch_rate:
            return []
        gpu_seconds = sum(k.get("seconds", 0.0) for k in p["kernels"].values())
        kernels = sum(k.get("launches", 0.0) for k in p["kernels"].values())
        mean = gpu_seconds / kernels if kernels else None
        util = sum(busy) / len(busy) if busy else None
        why = []
        if mean is not None and mean <= self.short_kernel:
            why.append(f"its kernels run {mean * 1e6:.1f} µs on average (CUPTI)")
        if util is not None and util <= self.busy:
            why.append(f"the GPU is busy with it {util:.0%} of the time (NVML)")
        if not why:
            return []
        return [Finding("launch_bound", "", "warning",
                        f"process {pid} ({process}) launches {rate:,.0f} kernels a second and "
                        + " and ".join(why) + ": the CPU's launches are the bottleneck; capture the steady "
                        "part in a CUDA graph (torch.compile(mode='reduce-overhead'), torch.cuda.graphs) or fuse "
                        "small ops", {"id": "launch_bound", "pid": pid, "process": process,
                                      "launches_per_second": rate, "mean_kernel_seconds": mean,
                                      "gpu_utilization": util}, ts=now)]

    def _kernels(self, pid: str, process: str, kernels: dict[str, dict], now: float) -> list[Finding]:
        total = sum(k.get("seconds", 0.0) for k in kernels.values())
        if total <= 0:
            return []
        out = []
        for name, k in kernels.items():
            share = k.get("seconds", 0.0) / total
            occ = k.get("occupancy")
            if occ is not None and occ <= self.low_occupancy and share >= self.occupancy_share:
                out.append(Finding("low_occupancy", "", "info",
                                   f"kernel {name} of process {pid} ({process}) takes {share:.0%} of its GPU "
                                   f"time at a theoretical occupancy of {occ:.0%}: its launch configuration "
                                   f"(registers, shared memory, block size) keeps SMs under-filled",
                                   {"id": name, "pid": pid, "process": process, "kernel": name, "share": share,
                                    "occupancy": occ}, ts=now))
            if k.get("blocks") == 1 and share >= self.degenerate_share and k.get("launches", 0) > 0:
                out.append(Finding("degenerate_grid", "", "warning",
                                   f"kernel {name} of process {pid} ({process}) is launched with a grid of one "
                                   f"block and takes {share:.0%} of its GPU time: one SM works, the rest idle",
                                   {"id": name, "pid": pid, "process": process, "kernel": name, "share": share},
                                   ts=now))
        return out


DETECTOR = DetectorEntry(LaunchDetector.name, "", LaunchDetector.kinds, 30, lambda ctx: LaunchDetector())
