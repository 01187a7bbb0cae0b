"""gpuwatch / Agent: the agent itself, its probes and helpers."""
from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders.dashboard import Row

from .common import (
    DOWN_STATES, Q, STEPPED, build_dashboard, datasource_var, node_var, rate, sel, stat, steps, table, ts, value_texts,
)


def dashboard() -> grafana.Dashboard:
    probe = "{{instance}} {{probe}}"
    return build_dashboard(
        "gpuwatch-agent", "gpuwatch / Agent",
        "The gpuwatch agent itself: its build, scrapes, each probe's state, collection time, late and "
        "failed collections, dropped events, and the eBPF and CUPTI helpers.",
        [datasource_var(), node_var()],
        [
            Row("Agent"),
            table("Build", Q(sel("gpuwatch.build")), hide=("Value",)).span(12).height(5),
            stat("Scraped", Q('up{job=~".*gpuwatch.*",instance=~"$instance"}', "{{instance}}")).span(4).height(5)
            .thresholds(steps("red", (1, "green"))).mappings(value_texts({"1": "up", "0": "down"}))
            .description("Prometheus' own `up` for scrape jobs whose name contains gpuwatch (as the "
                         "GpuwatchAgentDown alert assumes)."),
            stat("Probes down", Q(f'sum({sel("gpuwatch.probe.state", state=("=~", DOWN_STATES))}) or vector(0)')).unit("none").span(4).height(5)
            .thresholds(steps("green", (1, "red"))),
            stat("Config reload", Q(sel("gpuwatch.config.last_reload.success"), "{{instance}}")).span(4).height(5)
            .thresholds(steps("red", (1, "green"))).mappings(value_texts({"1": "ok", "0": "rejected"}))
            .description("Whether the last SIGHUP reload of the config was accepted (1) or rejected (0: the agent "
                         "runs on its old config; `gpuwatch status` says why). Alert: GpuwatchConfigReloadFailed."),
            stat("Config loaded", Q(f'time() - {sel("gpuwatch.config.last_reload.success_timestamp")}',
                                    "{{instance}}")).unit("s").span(12).height(5)
            .description("How long ago the config last loaded: the start, or the last accepted reload."),
            Row("Probes"),
            ts("Probe up", Q(sel("gpuwatch.probe.up"), probe)).unit("none").min(0).max(1)
            .line_interpolation(STEPPED)
            .description("0: disabled, unavailable, failing or late (`gpuwatch status` says why). Alert: "
                         "GpuwatchProbeDown (not for disabled)."),
            ts("Collection time", Q(sel("gpuwatch.probe.duration"), probe)).unit("s").min(0)
            .description("Wall time of each probe's last collection."),
            table("Probe states", Q(f'{sel("gpuwatch.probe.state")} == 1'), hide=("Value",)).span(24).height(6)
            .description("Each probe's state now: up, starting, late, disabled (an optional extra it needs is not "
                         "installed: off, not down), unavailable or failing."),
            ts("Late collections", Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.late")})', probe))
            .unit("cps").span(8).description("Collections that overran their deadline (a hung NVML call, say)."),
            ts("Collection errors", Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.errors")})', probe))
            .unit("cps").span(8),
            ts("Events dropped", Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.events.dropped")})', probe))
            .unit("cps").span(8),
            ts("NVML call errors",
               Q(f'sum by (instance, error) ({rate("gpuwatch.nvml.call.errors")})',
                 "{{instance}} {{error}}", needs="nvml_errors")).unit("cps")
            .description("NVML calls that failed (other than not-supported), by NVML error."),
            ts("eBPF attachments", Q(sel("gpuwatch.ebpf.attached"), "{{instance}} {{what}}", needs="ebpf"))
            .unit("none").min(0),
            ts("eBPF launch sampling", Q(sel("gpuwatch.ebpf.launch.sampled"), "{{instance}}", needs="ebpf"))
            .unit("percentunit").min(0)
            .description("Fraction of the time launches were counted (ebpf.launch_sampling); below 100 % the "
                         "launch APIs' call counts are estimates. Every other API is exact."),
            ts("eBPF launch rate and budget", Q(sel("gpuwatch.ebpf.launch.rate"), "{{instance}} {{what}}", needs="ebpf"))
            .unit("ops").min(0)
            .description("Kernel launches per second on the node as the eBPF probe measured them, and the budget "
                         "(ebpf.launch_budget) under which every launch is probed; above it the duty cycle "
                         "samples, except in a process's first minutes, after a graph capture begins, and during "
                         "a trace."),
            Row("Bounds"),
            ts("History series", Q(sel("gpuwatch.history.series"), "{{instance}}"),
               Q(f'sum by (instance, reason) ({rate("gpuwatch.history.series.evicted")})',
                 "{{instance}} evicted ({{reason}}) /s")).unit("none").min(0).span(8)
            .description("Series held for the detectors (at most 16384; a process's are forgotten 10 min after "
                         "it ends), and the rate they are forgotten at."),
            ts("In-process reports refused",
               Q(f'sum by (instance, reason) ({rate("gpuwatch.cupti.reports.refused")})',
                 "{{instance}} report {{reason}}"),
               Q(f'sum by (instance, reason) ({rate("gpuwatch.cupti.memory.refused")})',
                 "{{instance}} memory {{reason}}")).unit("cps").span(8)
            .description("Reports over the bounds (16 processes per user, 256 in all, one per 0.1 s) and memory "
                         "entries for GPUs NVML does not know or list the process on."),
            ts("Dropped by the agent",
               Q(f'sum by (instance) ({rate("gpuwatch.findings.dropped")})', "{{instance}} findings"),
               Q(f'sum by (instance, probe) ({rate("gpuwatch.history.points.future")})',
                 "{{instance}} {{probe}} points from the future")).unit("cps").span(8)
            .description("Findings beyond the 256 open at once; points dated over a minute ahead."),
            ts("Control socket requests",
               Q(f'sum by (instance, method, result) ({rate("gpuwatch.control.requests")})',
                 "{{instance}} {{method}} {{result}}")).unit("cps")
            .description("Control socket requests by method and result. refused: bad params, not the caller's "
                         "process, too large; busy: over the connections one user may hold (4) or all (16); "
                         "gone: the process that opened the connection exited; idle: closed without a request."),
            ts("/metrics connections",
               Q(f'sum by (instance, result) ({rate("gpuwatch.http.connections")})',
                 "{{instance}} {{result}}")).unit("cps").span(12)
            .description("Connections to /metrics by how they ended: served, busy (503), evicted (an unfinished "
                         "connection closed for a newer one), over_budget, too_large, timeout (no whole request "
                         "within prometheus.header_timeout), tls_failed, closed."),
            ts("Budgets in use", Q(sel("gpuwatch.budget.used"), "{{instance}} {{budget}}")).unit("none").min(0).span(12)
            .description("What all users' processes make the agent keep, per budget (graphs and stacks in bytes; "
                         "libraries, uprobes, files in count). Limits per user and node-wide: [budget] "
                         "(docs/security.md#budgets)."),
            ts("Budget refusals",
               Q(f'sum by (instance, budget, limit) ({rate("gpuwatch.budget.refusals")})',
                 "{{instance}} {{budget}} ({{limit}})")).unit("cps").span(12)
            .description("Charges refused: limit=user, one user's share was full (only their processes lose "
                         "detail); limit=node, all users together reached the node-wide limit."),
            Row("CUPTI PM sampler"),
            table("The agent's own GPU processes", Q(sel("gpuwatch.agent.gpu_process"), needs="pm_sampling"),
                  hide=("Value",)).span(24).height(4)
            .description("Processes of the agent that hold a GPU context (the CUPTI sampler child, a baseline "
                         "run): never counted as users' work, leak suspects or a reason to skip a baseline."),
            table("Sampler state", Q(f'{sel("gpuwatch.profiling.state")} == 1', needs="pm_sampling"),
                  hide=("Value",)).span(8),
            ts("Sampler restarts",
               Q(f'sum by (instance, reason) ({rate("gpuwatch.cupti.sampler.restarts")})',
                 "{{instance}} {{reason}}", needs="pm_sampling")).unit("cps").span(8)
            .description("hang: silent past its timeout and killed; crash: exited unexpectedly."),
            ts("Sampler protocol errors",
               Q(f'sum by (instance) ({rate("gpuwatch.cupti.sampler.invalid_lines")})',
                 "{{instance}}", needs="pm_sampling")).unit("cps").span(8)
            .description("Lines the sampler child printed that are not its protocol (ignored)."),
            Row("OTLP export"),
            ts("OTLP items",
               Q(f'sum by (instance, signal, result) ({rate("gpuwatch.otlp.items")})',
                 "{{instance}} {{signal}} {{result}}", needs="otlp")).unit("cps").span(12)
            .description("Data points and log records exported, failed (refused, down or too slow after retries) "
                         "and dropped (the queue was full), from the OpenTelemetry SDK's own counters "
                         "(docs/otlp.md)."),
            stat("OTLP export", Q(sel("gpuwatch.otlp.up"), "{{instance}}", needs="otlp")).span(6)
            .thresholds(steps("red", (1, "green"))).mappings(value_texts({"1": "up", "0": "down"}))
            .description("The agent's periodic metrics export reached the receiver last time (1) or not (0). "
                         "Alert: GpuwatchOtlpExportDown."),
            ts("OTLP failed batches", Q(f'sum by (instance, signal) ({rate("gpuwatch.otlp.export.failures")})',
                                        "{{instance}} {{signal}}", needs="otlp")).unit("cps").span(6)
            .description("Export batches the receiver did not take, by signal."),
        ])
