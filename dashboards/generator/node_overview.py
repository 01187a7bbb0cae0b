"""gpuwatch / Node overview: the golden signals of every GPU on the selected nodes."""
from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders.dashboard import Row

from .common import (
    GPU, DOWN_STATES, Q, STEPPED, build_dashboard, dashed, datasource_var, gpu_var, increase, node_var, rate, sel, stat, steps,
    table, ts, value_texts, with_index,
)


def dashboard() -> grafana.Dashboard:
    util = sel("hw.gpu.utilization", task="general")
    margin = (f'{sel("hw.temperature.limit", threshold="slowdown")} - ignoring(threshold, sensor) '
              f'{sel("hw.temperature", sensor="gpu")}')
    ecc_per_interval = increase("hw.errors", "$__rate_interval", counter="volatile")
    power_share = f'{sel("hw.power")} / ignoring(limit) {sel("gpuwatch.gpu.power.limit", limit="enforced")}'
    return build_dashboard(
        "gpuwatch-node-overview", "gpuwatch / Node overview",
        "The golden signals of every GPU on the selected nodes: utilisation, memory, temperature against "
        "its slowdown threshold, power against its limit, throttling, errors, and the agent's health.",
        [datasource_var(), node_var(), gpu_var()],
        [
            Row("At a glance"),
            stat("GPUs", Q(f'count({sel("gpuwatch.gpu")})')).unit("none").thresholds(steps("blue")),
            stat("GPUs lost", Q(f'sum(1 - {sel("gpuwatch.gpu.up")})')).unit("none")
            .thresholds(steps("green", (1, "red")))
            .description("GPUs that stopped answering NVML (lost, fallen off the bus): they need a reset or "
                         "a reboot. Alert: GpuLost."),
            stat("Mean utilisation", Q(f"avg({util})")).unit("percentunit").min(0).max(1).thresholds(steps("blue"))
            .description("Mean over the GPUs of the fraction of time a kernel was running (NVML)."),
            stat("Memory used, all GPUs",
                 Q(f'sum({sel("hw.gpu.memory.usage")}) / sum({sel("hw.gpu.memory.limit")})')).unit("percentunit")
            .min(0).max(1).thresholds(steps("green", (0.9, "orange"), (0.97, "red"))),
            stat("Least thermal headroom", Q(f"min({margin})")).unit("celsius")
            .thresholds(steps("red", (5, "orange"), (10, "green")))
            .description("The smallest distance, over the GPUs, between the GPU temperature and its "
                         "slowdown threshold, where the driver cuts the clocks. Alert under 5 °C: "
                         "GpuNearThermalSlowdown."),
            stat("Power", Q(f'sum({sel("hw.power")})')).unit("watt").thresholds(steps("blue")),
            stat("XIDs in range", Q(f'sum({increase("gpuwatch.gpu.xid")}) or vector(0)')).unit("none")
            .thresholds(steps("green", (1, "red")))
            .description("Critical XID events the agents counted in the time range. Alert: GpuXidError."),
            stat("Probes down", Q(f'sum({sel("gpuwatch.probe.state", state=("=~", DOWN_STATES))}) or vector(0)')).unit("none")
            .thresholds(steps("green", (1, "red")))
            .description("gpuwatch probes that are unavailable, failing or late; their metrics are missing "
                         "or stale. `gpuwatch status` on the node says why. A disabled probe (its optional "
                         "extra not installed) is not counted."),
            table("GPU identities",
                  Q(f'{sel("gpuwatch.gpu")} * on(instance, gpu) group_left() {sel("gpuwatch.gpu.up")}'),
                  columns={"A": ("state", "none")}).span(24).height(6)
            .mappings(value_texts({"1": "up", "0": "lost"}))
            .description("Each GPU's identity (gpuwatch_gpu_info): the other panels name GPUs by node and "
                         "index; alerts name them by UUID (gpu)."),
            Row("Utilisation and memory"),
            ts("GPU utilisation", Q(with_index(util), GPU)).unit("percentunit").min(0).max(1)
            .description("Fraction of the sample period a kernel was running (NVML; busy even when one "
                         "kernel uses a few SMs: see SM activity on the GPU detail dashboard)."),
            ts("Memory used", Q(with_index(sel("hw.gpu.memory.utilization")), GPU)).unit("percentunit").min(0)
            .max(1).thresholds(steps("green", (0.97, "red"))).thresholds_style(dashed())
            .description("Device memory used / total."),
            Row("Temperature and power"),
            ts("GPU temperature", Q(with_index(sel("hw.temperature", sensor="gpu")), GPU)).unit("celsius"),
            ts("Headroom to thermal slowdown", Q(with_index(margin), GPU)).unit("celsius")
            .thresholds(steps("green", (5, "red"))).thresholds_style(dashed())
            .description("Slowdown threshold minus GPU temperature: at 0 the driver cuts the clocks. Alert "
                         "under 5 °C for 5 minutes: GpuNearThermalSlowdown."),
            ts("Power draw", Q(with_index(sel("hw.power")), GPU)).unit("watt"),
            ts("Power against the enforced limit", Q(with_index(power_share), GPU)).unit("percentunit").min(0)
            .description("Power draw / enforced power limit. At 100 % the GPU holds its clocks down to "
                         "stay within it (clock-event reason sw_power_cap), which is normal under full load."),
            Row("Throttling"),
            ts("Time clocks were held down, by reason",
               Q(with_index(rate("gpuwatch.gpu.clock_event.duration", reason=("!~", "total_.*"))),
                 GPU + " {{reason}}")).unit("percentunit").min(0)
            .description("Share of time the driver held the clocks below target, per reason (NVML violation "
                         "counters). power: at the power limit; thermal: too hot; low_utilization: idle."),
            ts("GPUs with an active clock-event reason",
               Q(f'sum by (reason) ({sel("gpuwatch.gpu.clock_event.active")})', "{{reason}}")).unit("none").min(0)
            .line_interpolation(STEPPED)
            .description("How many GPUs have each clock-event (throttle) reason active. sw_power_cap alone "
                         "is normal under full load; hw_slowdown, hw_thermal_slowdown, sw_thermal_slowdown "
                         "and hw_power_brake_slowdown for 10 minutes raise GpuThermalOrPowerBrakeThrottling."),
            Row("Errors"),
            ts("ECC errors", Q(with_index(f"sum by (instance, gpu, type) ({ecc_per_interval})"), GPU + " {{type}}"))
            .unit("short").span(8)
            .description("ECC errors per interval (the driver's volatile counters). Uncorrected ones "
                         "corrupt or kill the work that hit them. Alert: GpuEccUncorrectable."),
            ts("Remapped rows", Q(with_index(sel("gpuwatch.gpu.remapped_rows")), GPU + " {{cause}}")).unit("none")
            .span(8).description("Memory rows the GPU replaced with spare rows, by cause."),
            stat("Row remaps pending", Q(f'sum({sel("gpuwatch.gpu.remapped_rows.pending")})')).unit("none").span(4)
            .height(8).thresholds(steps("green", (1, "orange")))
            .description("GPUs with a row remap waiting for a GPU reset. Alert: GpuRowRemapPending."),
            stat("Row remap failures", Q(f'sum({sel("gpuwatch.gpu.remapped_rows.failure")})')).unit("none").span(4)
            .height(8).thresholds(steps("green", (1, "red")))
            .description("GPUs where a row remap failed: not safe to run work on. Alert: GpuRowRemapFailure."),
            table("XIDs by GPU and code",
                  Q(with_index(f'sum by (instance, gpu, xid) ({increase("gpuwatch.gpu.xid")}) > 0'), needs="xid"),
                  columns={"A": ("XIDs", "none")}).span(24).height(6)
            .description("XID events by GPU and code in the time range (the agent counts them from its "
                         "start)."),
            Row("Agent"),
            ts("Probes up", Q(sel("gpuwatch.probe.up"), "{{instance}} {{probe}}")).unit("none").min(0).max(1)
            .span(6).line_interpolation(STEPPED),
            ts("Late collections",
               Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.late")})',
                 "{{instance}} {{probe}}")).unit("cps").span(6),
            ts("Collection errors",
               Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.errors")})',
                 "{{instance}} {{probe}}")).unit("cps").span(6),
            ts("Events dropped",
               Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.events.dropped")})',
                 "{{instance}} {{probe}}")).unit("cps").span(6)
            .description("Events (XIDs) a probe dropped because its queue was full. Alert: GpuwatchEventsDropped."),
        ])
