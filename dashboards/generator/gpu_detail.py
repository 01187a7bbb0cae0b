"""gpuwatch / GPU detail: one GPU in depth."""
from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders.dashboard import Row

from .common import (
    Q, STEPPED, build_dashboard, dashed_line, datasource_var, gpu_var, increase, keyed, node_var, rate, sel, stat,
    steps, table, ts, value_texts,
)


def dashboard() -> grafana.Dashboard:
    return build_dashboard(
        "gpuwatch-gpu-detail", "gpuwatch / GPU detail",
        "One GPU in depth: state, clocks and throttling, utilisation and GPM, memory, power and energy, "
        "temperatures, PCIe and NVLink, errors, and the processes on it.",
        [datasource_var(), node_var(), gpu_var(multi=False)],
        [
            Row("Identity and state"),
            table("Identity", Q(sel("gpuwatch.gpu")), hide=("Value",)).span(24).height(4),
            stat("State", Q(sel("gpuwatch.gpu.up"))).span(4).thresholds(steps("red", (1, "green")))
            .mappings(value_texts({"1": "up", "0": "lost"})),
            stat("Performance state", Q(sel("gpuwatch.gpu.performance_state"))).unit("prefix:P").span(4)
            .thresholds(steps("blue")).description("P0 is the fastest, P15 the slowest."),
            stat("MIG mode", Q(sel("gpuwatch.gpu.mig.mode"), "{{state}}")).span(4).thresholds(steps("blue"))
            .mappings(value_texts({"1": "enabled", "0": "disabled"})),
            stat("PCIe link generation", Q(sel("gpuwatch.gpu.pcie.link.generation"), "{{state}}")).unit("none")
            .span(4).thresholds(steps("blue")),
            stat("PCIe link width", Q(sel("gpuwatch.gpu.pcie.link.width"), "{{state}}")).unit("prefix:x").span(4)
            .thresholds(steps("blue")),
            stat("Processes", Q(sel("gpuwatch.gpu.processes"), "{{type}}")).unit("none").span(4)
            .thresholds(steps("blue")),
            Row("Clocks and throttling"),
            ts("Clocks", Q(sel("gpuwatch.gpu.clock.frequency"), "{{clock}}"),
               Q(sel("gpuwatch.gpu.clock.max_frequency"), "{{clock}} max")).unit("hertz")
            .override_by_regexp(" max$", dashed_line()),
            ts("Active clock-event reasons", Q(sel("gpuwatch.gpu.clock_event.active"), "{{reason}}")).unit("none")
            .min(0).max(1).line_interpolation(STEPPED)
            .description("1 while the reason holds the clocks down. sw_power_cap alone is normal under load."),
            ts("Time clocks were held down, by reason", Q(rate("gpuwatch.gpu.clock_event.duration"), "{{reason}}"))
            .unit("percentunit").min(0)
            .description("Share of time per reason (NVML violation counters); total_app_clocks and "
                         "total_base_clocks: below the application or base clocks for any reason."),
            ts("Utilisation", Q(sel("hw.gpu.utilization"), "{{task}}"),
               Q(sel("gpuwatch.gpu.memory_controller.utilization"), "memory controller")).unit("percentunit").min(0)
            .max(1)
            .description("Fraction of the sample period a kernel (general), the encoder, the decoder or "
                         "the memory controller was busy (NVML)."),
            Row("GPM (Hopper and newer)"),
            ts("SM and DRAM activity", Q(sel("gpuwatch.gpu.sm.activity"), "SM activity"),
               Q(sel("gpuwatch.gpu.sm.occupancy"), "SM occupancy"),
               Q(sel("gpuwatch.gpu.dram.activity"), "DRAM activity")).unit("percentunit").min(0).max(1)
            .description("NVML GPM, device-wide: SM activity is the time at least one warp was active on an "
                         "SM, occupancy the warps resident as a fraction of the maximum, both averaged over "
                         "SMs; DRAM activity is bandwidth used as a fraction of peak."),
            ts("Pipe activity", Q(sel("gpuwatch.gpu.pipe.activity"), "{{pipe}}")).unit("percentunit").min(0).max(1)
            .description("NVML GPM: fraction of cycles each pipe (tensor, fp16, fp32, fp64) was active."),
            Row("Memory"),
            ts("Device memory", Q(sel("hw.gpu.memory.usage"), "used"), Q(sel("gpuwatch.gpu.memory.free"), "free"),
               Q(sel("gpuwatch.gpu.memory.reserved"), "reserved by the driver"),
               Q(sel("hw.gpu.memory.limit"), "total")).unit("bytes").min(0)
            .override_by_regexp("^total$", dashed_line()),
            ts("BAR1 memory used", Q(sel("gpuwatch.gpu.bar1_memory.usage"), "BAR1")).unit("bytes").min(0),
            Row("Power, energy and temperature"),
            ts("Power against its limits", Q(sel("hw.power"), "draw"),
               Q(sel("gpuwatch.gpu.power.limit"), "{{limit}} limit")).unit("watt").min(0)
            .override_by_regexp("limit$", dashed_line()),
            ts("Temperatures and thresholds", Q(sel("hw.temperature"), "{{sensor}}"),
               Q(sel("hw.temperature.limit"), "{{threshold}}")).unit("celsius")
            .override_by_regexp("^(slowdown|shutdown|max_operating|max_memory)$", dashed_line()),
            stat("Energy in range", Q(f'sum({increase("hw.energy")})')).unit("joule").span(6)
            .thresholds(steps("blue"))
            .description("Energy the GPU consumed in the time range (its counter since the driver loaded)."),
            stat("Fan speed", Q(sel("gpuwatch.gpu.fan.speed"), "fan {{fan}}", needs="fan")).unit("percentunit")
            .min(0).max(1).span(6),
            Row("PCIe and NVLink"),
            ts("PCIe throughput", Q(sel("gpuwatch.gpu.pcie.throughput"), "{{direction}}")).unit("Bps").span(8)
            .description("Over a 20 ms NVML sample window, once per collection."),
            ts("PCIe replays", Q(rate("gpuwatch.gpu.pcie.replays"), "replays")).unit("cps").span(8)
            .description("Link-level retransmissions: a steady rate points at a bad riser, cable or slot."),
            ts("NVLink traffic",
               Q(f'sum by (direction) ({rate("gpuwatch.gpu.nvlink.io")})', "{{direction}}",
                 needs="nvlink")).unit("Bps").span(8),
            ts("NVLink links up", Q(f'sum({sel("gpuwatch.gpu.nvlink.up")})', "links up", needs="nvlink"))
            .unit("none").min(0),
            ts("NVLink errors",
               Q(f'sum by (type) ({rate("gpuwatch.gpu.nvlink.errors")})', "{{type}}",
                 needs="nvlink")).unit("cps"),
            ts("NVLink state per link", Q(sel("gpuwatch.gpu.nvlink.up"), "link {{link}}", needs="nvlink"))
            .unit("none").min(0).max(1).line_interpolation(STEPPED).span(8)
            .description("1 while the link is active, 0 while it is down; a link that was up and went down "
                         "is an nvlink_down finding and the GpuNvlinkDown alert."),
            ts("NVLink traffic per link",
               Q(rate("gpuwatch.gpu.nvlink.link.io"), "link {{link}} {{direction}}", needs="nvlink"))
            .unit("Bps").min(0).span(8)
            .description("Data bytes per link (NVML per-link field values). The links of a GPU carry alike "
                         "under NCCL; one far below the others is degraded or routed around."),
            ts("NVLink error rate per link and type",
               Q(f'{rate("gpuwatch.gpu.nvlink.errors")} > 0', "link {{link}} {{type}}", needs="nvlink"))
            .unit("cps").min(0).span(8)
            .description("Only links whose counters move. dl_recovery is the link retraining (critical); "
                         "dl_replay and dl_crc are retried transfers (GpuNvlinkErrors)."),
            Row("Errors"),
            table("ECC error counters", Q(sel("hw.errors")), columns={"A": ("errors", "none")}).span(8)
            .description("volatile: since the driver loaded; aggregate: over the GPU's life."),
            ts("Row remapping", Q(sel("gpuwatch.gpu.remapped_rows"), "{{cause}} rows"),
               Q(sel("gpuwatch.gpu.remapped_rows.pending"), "pending"),
               Q(sel("gpuwatch.gpu.remapped_rows.failure"), "failed")).unit("none").min(0).span(8),
            table("XIDs in range", Q(f'sum by (xid) ({increase("gpuwatch.gpu.xid")}) > 0', needs="xid"),
                  columns={"A": ("XIDs", "none")}).span(8),
            Row("Processes"),
            table("Processes on the GPU",
                  Q(keyed(sel("gpuwatch.process.gpu.memory.usage"), "instance", "gpu", "pid", "process")),
                  Q(keyed(sel("gpuwatch.process.gpu.utilization"), "instance", "gpu", "pid", "process")),
                  columns={"A": ("memory (black)", "bytes"), "B": ("utilisation", "percentunit")}).span(24)
            .height(6)
            .description("Device memory the driver charges each process, and the share of time it had a "
                         "kernel running (NVML). The busiest are kept; the rest are folded into pid=other."),
            ts("Process memory", Q(sel("gpuwatch.process.gpu.memory.usage"), "{{process}} {{pid}}")).unit("bytes")
            .min(0),
            ts("Process utilisation", Q(sel("gpuwatch.process.gpu.utilization"), "{{process}} {{pid}}"))
            .unit("percentunit").min(0).max(1),
        ])
