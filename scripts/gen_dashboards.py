#!/usr/bin/env python3
"""Generate the Grafana dashboards in dashboards/grafana/ from the metric registry (agent/metrics.py).

    scripts/gen_dashboards.py            write dashboards/grafana/*.json
    scripts/gen_dashboards.py --check    exit 1 with a diff when a committed dashboard is stale

Run it with the project's venv (.venv/bin/python), where gpuwatch is installed. Every query names
its metrics through the registry (sel(), rate(), increase()), so renaming a metric breaks this
script, not a dashboard somebody imported. The JSON is written deterministically and committed;
tests/unit/test_dashboards.py fails when it differs from what this script writes.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpuwatch.agent.metrics import Kind, get
from gpuwatch.detectors.health import HealthSettings

OUT = Path(__file__).resolve().parent.parent / "dashboards" / "grafana"
SCHEMA_VERSION = 39  # Grafana 11.0; newer versions migrate it on load
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
TAG = "gpuwatch"

# What a node must have or do before a query can return series. Queries marked with one of these
# keys say so in their panel's description; the end-to-end test runs them all, and requires
# series only from the queries whose needs it can meet on the replayed H200.
NEEDS = {
    "ebpf": "the eBPF probe (the agent as root, with Debian's python3-bpfcc) and CUDA processes on the node",
    "ebpf_pool": "the eBPF probe and a process whose driver allocations a pool allocator makes (PyTorch, CuPy, JAX, "
                 "RMM, TensorFlow, or a library named in ebpf.pool_libraries)",
    "inprocess": "a program started with `gpuwatch run -- CMD` (the in-process CUPTI agent; white and grey "
                 "need PyTorch, CuPy or JAX)",
    "pm_sampling": "CUPTI PM sampling in the daemon (cupti-python installed, GPU counters readable, no other "
                   "profiler holding them)",
    "leak": "an open leak finding",
    "oom": "an out-of-memory event since the agent started (CUDA_ERROR_OUT_OF_MEMORY seen by eBPF, a framework's "
           "out-of-memory error seen by an in-process agent, or a leaking process gone with its GPU nearly full)",
    "oom_forecast": "an out-of-memory event that a leak finding had forecast",
    "baseline": "runs of the reference workload (`gpuwatch baseline run`, or the daemon's schedule on idle GPUs)",
    "xid": "an XID error since the agent started",
    "nvlink": "GPUs with NVLink",
    "fan": "GPUs with fans (passively cooled boards have none)",
    "nvml_errors": "NVML calls that failed",
    "self_reported": "in-process agents reporting memory for GPUs NVML cannot list their processes on (per-process "
                     "information not supported, or the agent in another PID namespace)",
    "kubernetes": "GPU processes in Kubernetes pods (their cgroups name the pod; /var/log/pods names it)",
    "otlp": "OTLP export switched on (otlp.enabled)",
    "host": "the host probe (host.enabled) and GPU processes on the node",
    "host_files": "the host probe's page-cache readings (host.page_cache) and GPU processes that map or hold open "
                  "files of at least host.page_cache_min_bytes",
    "host_evicted": "the host probe's page-cache readings on Linux 6.5 or newer (cachestat(2); mincore(2) cannot "
                    "tell evicted pages)",
    "host_bound": "an open host_bound finding",
    # Other exporters, scraped by the same Prometheus: their panels also say so where the data would be.
    "node_exporter": "node_exporter scraped by this Prometheus",
    "kube_state_metrics": "kube-state-metrics scraped by this Prometheus",
    "vllm": "vLLM's /metrics scraped by this Prometheus (prefix caching on)",
}
# The needs met by scraping another exporter: a panel fed by one only shows "No data: needs ..." in place
# of its data, so that an empty panel says what to deploy.
EXPORTERS = {"node_exporter": "node_exporter", "kube_state_metrics": "kube-state-metrics", "vllm": "vLLM's /metrics"}


@dataclass(frozen=True)
class ForeignMetric:
    """A series another exporter exports: its name is not in our registry, so it is declared here, with
    the labels it carries (and a scrape's job, instance) and the need that says which exporter."""
    kind: Kind
    labels: tuple[str, ...]
    needs: str


FOREIGN = {
    "node_disk_io_time_seconds_total": ForeignMetric(Kind.COUNTER, ("device",), "node_exporter"),
    "kube_pod_status_phase": ForeignMetric(Kind.GAUGE, ("namespace", "pod", "uid", "phase"), "kube_state_metrics"),
    # vLLM's V1 engine; its V0 engine named them with gpu_ (both carry model_name and engine)
    "vllm:prefix_cache_hits_total": ForeignMetric(Kind.COUNTER, ("model_name", "engine"), "vllm"),
    "vllm:prefix_cache_queries_total": ForeignMetric(Kind.COUNTER, ("model_name", "engine"), "vllm"),
    "vllm:gpu_prefix_cache_hits_total": ForeignMetric(Kind.COUNTER, ("model_name", "engine"), "vllm"),
    "vllm:gpu_prefix_cache_queries_total": ForeignMetric(Kind.COUNTER, ("model_name", "engine"), "vllm"),
}

LAUNCH_APIS = "cuLaunch.*|cuGraphLaunch.*"  # probes/ebpf/symbols.py: the launch group


def outside_allocators(**matchers) -> str:
    """Live driver bytes outside any pool allocator: live minus pooled (0 pooled where a process has
    no pooled series, so that it is not dropped)."""
    by = "sum by (instance, pid, process)"
    live = sel("gpuwatch.process.cuda.memory.live", **matchers)
    return (f"{live} - on(instance, pid, process) ({by} ({sel('gpuwatch.process.cuda.memory.pooled', **matchers)}) "
            f"or {by} (0 * {live}))")


# --- PromQL from the registry ---------------------------------------------------------------


def sel(name: str, series: str = "", **matchers: str | tuple[str, str]) -> str:
    """A selector of a registry metric on the dashboard's nodes (and GPUs, for per-GPU metrics).

    sel("hw.temperature", sensor="gpu"); a tuple gives the operator: reason=("!~", "total_.*").
    A histogram's series is named: sel("gpuwatch.oom.forecast.error", "bucket").
    """
    m = get(name)
    labels = m.labels
    if m.kind is Kind.HISTOGRAM:
        if series not in ("bucket", "sum", "count"):
            raise ValueError(f"{name} is a histogram: name its series, bucket, sum or count")
        labels += ("le",) if series == "bucket" else ()
        metric = f"{m.prom_name}_{series}"
    elif series:
        raise ValueError(f"{name} is a {m.kind.value}: it has no {series} series")
    else:
        metric = m.prom_exposed_name
    pairs = [("instance", "=~", "$instance")]
    if m.per_gpu:
        pairs.append(("gpu", "=~", "$gpu"))
    for label, value in matchers.items():
        if label not in labels:
            raise KeyError(f"{metric} has no label {label!r}; its labels: {labels}")
        op, value = value if isinstance(value, tuple) else ("=", value)
        pairs.append((label, op, value))
    return metric + "{" + ",".join(f'{k}{op}"{v}"' for k, op, v in pairs) + "}"


def foreign(name: str, **matchers: str) -> str:
    """A selector of another exporter's series, on all its targets: their instance is not the agent's."""
    m = FOREIGN[name]
    if unknown := set(matchers) - set(m.labels):
        raise KeyError(f"{name} has no label {sorted(unknown)}; its labels: {m.labels}")
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in matchers.items()) + "}" if matchers else "")


def _counter(name: str) -> None:
    if get(name).kind not in (Kind.COUNTER, Kind.HISTOGRAM):  # a histogram's series are counters
        raise ValueError(f"{name} is a {get(name).kind.value}: rate() and increase() are for counters")


def rate(name: str, series: str = "", **matchers) -> str:
    _counter(name)
    return f"rate({sel(name, series, **matchers)}[$__rate_interval])"


def increase(name: str, window: str = "$__range", series: str = "", **matchers) -> str:
    _counter(name)
    return f"increase({sel(name, series, **matchers)}[{window}])"


def quantile(q: float, name: str, window: str = "$__range", by: str = "", **matchers) -> str:
    """The q-quantile of a histogram's observations in the window (all selected series together,
    or per `by` labels)."""
    group = ", ".join(filter(None, ("le", by)))
    return f"histogram_quantile({q:g}, sum by ({group}) ({increase(name, window, 'bucket', **matchers)}))"


def with_index(expr: str) -> str:
    """expr with each GPU's index as a label: identity is the UUID, but people count GPUs by index."""
    return (f"({expr}) * on(instance, gpu) group_left(index) "
            f"max by (instance, gpu, index) ({sel('gpuwatch.gpu')})")


GPU = "{{instance}} GPU {{index}}"  # legend of a series joined by with_index()


def keyed(expr: str, *labels: str) -> str:
    """expr with exactly these labels: a table's queries need the same ones for Grafana to merge their rows."""
    return f"max by ({', '.join(labels)}) ({expr})"


def by_gpu(expr: str) -> str:
    return keyed(expr, "instance", "gpu")


# --- panels ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    needs: str = ""  # a NEEDS key: what must happen before this returns series; "" when it always does

    def __post_init__(self):
        if self.needs and self.needs not in NEEDS:
            raise KeyError(f"unknown need {self.needs!r}; known: {sorted(NEEDS)}")


@dataclass
class Panel:
    title: str
    queries: list[Query]
    kind: str = "timeseries"  # timeseries | stat | table
    unit: str = "short"
    description: str = ""
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    # (value, color) steps above a base color; for stats and thresholds drawn in time series
    thresholds: list[tuple[float, str]] = field(default_factory=list)
    base_color: str = "green"
    mappings: dict[str, str] = field(default_factory=dict)  # value -> text
    columns: dict[str, tuple[str, str]] = field(default_factory=dict)  # table: refId -> (title, unit)
    hide_columns: tuple[str, ...] = ()
    colors: dict[str, str] = field(default_factory=dict)  # legend regex -> fixed color
    dashed: str = ""  # legend regex of series drawn dashed (limits, thresholds)
    stepped: bool = False
    repeat: str = ""  # a variable: one panel per selected value

    @property
    def needs(self) -> list[str]:
        return sorted({q.needs for q in self.queries if q.needs})


@dataclass(frozen=True)
class Row:
    title: str


def ts(title: str, *queries: Query, **kw) -> Panel:
    return Panel(title, list(queries), "timeseries", **kw)


def stat(title: str, *queries: Query, **kw) -> Panel:
    kw.setdefault("width", 3)
    kw.setdefault("height", 4)
    return Panel(title, list(queries), "stat", **kw)


def table(title: str, *queries: Query, **kw) -> Panel:
    return Panel(title, list(queries), "table", **kw)


Q = Query  # short, for the many queries below


# --- template variables ----------------------------------------------------------------------


@dataclass(frozen=True)
class Var:
    name: str
    label: str
    query: str = ""  # label_values(...); empty for the datasource variable
    multi: bool = True

    def json(self) -> dict:
        if self.name == "datasource":
            return {"current": {}, "hide": 0, "includeAll": False, "label": self.label, "multi": False,
                    "name": "datasource", "options": [], "query": "prometheus", "refresh": 1, "regex": "",
                    "type": "datasource"}
        return {"current": {}, "datasource": DATASOURCE, "definition": self.query, "hide": 0,
                "includeAll": self.multi, "label": self.label, "multi": self.multi, "name": self.name,
                "options": [], "query": {"query": self.query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                "refresh": 2, "regex": "", "skipUrlSync": False, "sort": 1, "type": "query",
                **({"allValue": ".*"} if self.multi else {})}


DATASOURCE_VAR = Var("datasource", "Data source")
NODE_VAR = Var("instance", "Node", f"label_values({get('gpuwatch.build').prom_exposed_name}, instance)")


def gpu_var(multi: bool = True) -> Var:
    return Var("gpu", "GPU", f'label_values({get("gpuwatch.gpu").prom_exposed_name}{{instance=~"$instance"}}, gpu)',
               multi)


def process_var(metric: str) -> Var:
    name = get(metric).prom_exposed_name
    return Var("process", "Process", f'label_values({name}{{instance=~"$instance"}}, process)')


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    variables: list[Var]
    items: list[Panel | Row]

    @property
    def file(self) -> str:
        return f"{self.uid}.json"

    @property
    def panels(self) -> list[Panel]:
        return [p for p in self.items if isinstance(p, Panel)]


# --- the dashboards --------------------------------------------------------------------------

RATIO = {"unit": "percentunit", "min": 0}
RATIO_1 = {"unit": "percentunit", "min": 0, "max": 1}
ALERT_AT_1 = {"thresholds": [(1, "red")]}


def node_overview() -> Dashboard:
    util = sel("hw.gpu.utilization", task="general")
    margin = (f'{sel("hw.temperature.limit", threshold="slowdown")} - ignoring(threshold, sensor) '
              f'{sel("hw.temperature", sensor="gpu")}')
    ecc_per_interval = increase("hw.errors", "$__rate_interval", counter="volatile")
    power_share = f'{sel("hw.power")} / ignoring(limit) {sel("gpuwatch.gpu.power.limit", limit="enforced")}'
    return Dashboard(
        "gpuwatch-node-overview", "gpuwatch / Node overview",
        "The golden signals of every GPU on the selected nodes: utilisation, memory, temperature against "
        "its slowdown threshold, power against its limit, throttling, errors, and the agent's health.",
        [DATASOURCE_VAR, NODE_VAR, gpu_var()],
        [
            Row("At a glance"),
            stat("GPUs", Q(f'count({sel("gpuwatch.gpu")})'), unit="none", base_color="blue"),
            stat("GPUs lost", Q(f'sum(1 - {sel("gpuwatch.gpu.up")})'), unit="none", **ALERT_AT_1,
                 description="GPUs that stopped answering NVML (lost, fallen off the bus): they need a reset or "
                             "a reboot. Alert: GpuLost."),
            stat("Mean utilisation", Q(f"avg({util})"), **RATIO_1, base_color="blue",
                 description="Mean over the GPUs of the fraction of time a kernel was running (NVML)."),
            stat("Memory used, all GPUs", Q(f'sum({sel("hw.gpu.memory.usage")}) / sum({sel("hw.gpu.memory.limit")})'),
                 **RATIO_1, thresholds=[(0.9, "orange"), (0.97, "red")]),
            stat("Least thermal headroom", Q(f"min({margin})"), unit="celsius", base_color="red",
                 thresholds=[(5, "orange"), (10, "green")],
                 description="The smallest distance, over the GPUs, between the GPU temperature and its "
                             "slowdown threshold, where the driver cuts the clocks. Alert under 5 °C: "
                             "GpuNearThermalSlowdown."),
            stat("Power", Q(f'sum({sel("hw.power")})'), unit="watt", base_color="blue"),
            stat("XIDs in range", Q(f'sum({increase("gpuwatch.gpu.xid")}) or vector(0)'), unit="none", **ALERT_AT_1,
                 description="Critical XID events the agents counted in the time range. Alert: GpuXidError."),
            stat("Probes down", Q(f'sum(1 - {sel("gpuwatch.probe.up")})'), unit="none", **ALERT_AT_1,
                 description="gpuwatch probes that are unavailable, failing or late; their metrics are missing "
                             "or stale. `gpuwatch status` on the node says why."),
            table("GPU identities", Q(f'{sel("gpuwatch.gpu")} * on(instance, gpu) group_left() {sel("gpuwatch.gpu.up")}'),
                  width=24, height=6, columns={"A": ("state", "none")}, mappings={"1": "up", "0": "lost"},
                  description="Each GPU's identity (gpuwatch_gpu_info): the other panels name GPUs by node and "
                              "index; alerts name them by UUID (gpu)."),
            Row("Utilisation and memory"),
            ts("GPU utilisation", Q(with_index(util), GPU), **RATIO_1,
               description="Fraction of the sample period a kernel was running (NVML; busy even when one "
                           "kernel uses a few SMs: see SM activity on the GPU detail dashboard)."),
            ts("Memory used", Q(with_index(sel("hw.gpu.memory.utilization")), GPU), **RATIO_1,
               thresholds=[(0.97, "red")], description="Device memory used / total."),
            Row("Temperature and power"),
            ts("GPU temperature", Q(with_index(sel("hw.temperature", sensor="gpu")), GPU), unit="celsius"),
            ts("Headroom to thermal slowdown", Q(with_index(margin), GPU), unit="celsius", thresholds=[(5, "red")],
               description="Slowdown threshold minus GPU temperature: at 0 the driver cuts the clocks. Alert "
                           "under 5 °C for 5 minutes: GpuNearThermalSlowdown."),
            ts("Power draw", Q(with_index(sel("hw.power")), GPU), unit="watt"),
            ts("Power against the enforced limit", Q(with_index(power_share), GPU), **RATIO,
               description="Power draw / enforced power limit. At 100 % the GPU holds its clocks down to "
                           "stay within it (clock-event reason sw_power_cap), which is normal under full load."),
            Row("Throttling"),
            ts("Time clocks were held down, by reason",
               Q(with_index(rate("gpuwatch.gpu.clock_event.duration", reason=("!~", "total_.*"))),
                 GPU + " {{reason}}"), **RATIO,
               description="Share of time the driver held the clocks below target, per reason (NVML violation "
                           "counters). power: at the power limit; thermal: too hot; low_utilization: idle."),
            ts("GPUs with an active clock-event reason",
               Q(f'sum by (reason) ({sel("gpuwatch.gpu.clock_event.active")})', "{{reason}}"), unit="none",
               min=0, stepped=True,
               description="How many GPUs have each clock-event (throttle) reason active. sw_power_cap alone "
                           "is normal under full load; hw_slowdown, hw_thermal_slowdown, sw_thermal_slowdown "
                           "and hw_power_brake_slowdown for 10 minutes raise GpuThermalOrPowerBrakeThrottling."),
            Row("Errors"),
            ts("ECC errors",
               Q(with_index(f"sum by (instance, gpu, type) ({ecc_per_interval})"), GPU + " {{type}}"), unit="short",
               width=8, description="ECC errors per interval (the driver's volatile counters). Uncorrected ones "
                                    "corrupt or kill the work that hit them. Alert: GpuEccUncorrectable."),
            ts("Remapped rows", Q(with_index(sel("gpuwatch.gpu.remapped_rows")), GPU + " {{cause}}"), unit="none",
               width=8, description="Memory rows the GPU replaced with spare rows, by cause."),
            stat("Row remaps pending", Q(f'sum({sel("gpuwatch.gpu.remapped_rows.pending")})'), unit="none",
                 width=4, height=8, thresholds=[(1, "orange")],
                 description="GPUs with a row remap waiting for a GPU reset. Alert: GpuRowRemapPending."),
            stat("Row remap failures", Q(f'sum({sel("gpuwatch.gpu.remapped_rows.failure")})'), unit="none",
                 width=4, height=8, **ALERT_AT_1,
                 description="GPUs where a row remap failed: not safe to run work on. Alert: GpuRowRemapFailure."),
            table("XIDs by GPU and code",
                  Q(with_index(f'sum by (instance, gpu, xid) ({increase("gpuwatch.gpu.xid")}) > 0'), needs="xid"),
                  columns={"A": ("XIDs", "none")}, width=24, height=6,
                  description="XID events by GPU and code in the time range (the agent counts them from its "
                              "start)."),
            Row("Agent"),
            ts("Probes up", Q(sel("gpuwatch.probe.up"), "{{instance}} {{probe}}"), unit="none", min=0, max=1,
               width=6, stepped=True),
            ts("Late collections", Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.late")})',
                                     "{{instance}} {{probe}}"), unit="cps", width=6),
            ts("Collection errors", Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.errors")})',
                                      "{{instance}} {{probe}}"), unit="cps", width=6),
            ts("Events dropped", Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.events.dropped")})',
                                   "{{instance}} {{probe}}"), unit="cps", width=6,
               description="Events (XIDs) a probe dropped because its queue was full. Alert: GpuwatchEventsDropped."),
        ])


def gpu_detail() -> Dashboard:
    return Dashboard(
        "gpuwatch-gpu-detail", "gpuwatch / GPU detail",
        "One GPU in depth: state, clocks and throttling, utilisation and GPM, memory, power and energy, "
        "temperatures, PCIe and NVLink, errors, and the processes on it.",
        [DATASOURCE_VAR, NODE_VAR, gpu_var(multi=False)],
        [
            Row("Identity and state"),
            table("Identity", Q(sel("gpuwatch.gpu")), width=24, height=4, hide_columns=("Value",)),
            stat("State", Q(sel("gpuwatch.gpu.up")), width=4, mappings={"1": "up", "0": "lost"}, base_color="red",
                 thresholds=[(1, "green")]),
            stat("Performance state", Q(sel("gpuwatch.gpu.performance_state")), unit="prefix:P", width=4,
                 base_color="blue", description="P0 is the fastest, P15 the slowest."),
            stat("MIG mode", Q(sel("gpuwatch.gpu.mig.mode"), "{{state}}"), width=4, base_color="blue",
                 mappings={"1": "enabled", "0": "disabled"}),
            stat("PCIe link generation", Q(sel("gpuwatch.gpu.pcie.link.generation"), "{{state}}"), unit="none",
                 width=4, base_color="blue"),
            stat("PCIe link width", Q(sel("gpuwatch.gpu.pcie.link.width"), "{{state}}"), unit="prefix:x", width=4,
                 base_color="blue"),
            stat("Processes", Q(sel("gpuwatch.gpu.processes"), "{{type}}"), unit="none", width=4,
                 base_color="blue"),
            Row("Clocks and throttling"),
            ts("Clocks", Q(sel("gpuwatch.gpu.clock.frequency"), "{{clock}}"),
               Q(sel("gpuwatch.gpu.clock.max_frequency"), "{{clock}} max"), unit="hertz", dashed=" max$"),
            ts("Active clock-event reasons", Q(sel("gpuwatch.gpu.clock_event.active"), "{{reason}}"), unit="none",
               min=0, max=1, stepped=True,
               description="1 while the reason holds the clocks down. sw_power_cap alone is normal under load."),
            ts("Time clocks were held down, by reason",
               Q(rate("gpuwatch.gpu.clock_event.duration"), "{{reason}}"), **RATIO,
               description="Share of time per reason (NVML violation counters); total_app_clocks and "
                           "total_base_clocks: below the application or base clocks for any reason."),
            ts("Utilisation", Q(sel("hw.gpu.utilization"), "{{task}}"),
               Q(sel("gpuwatch.gpu.memory_controller.utilization"), "memory controller"), **RATIO_1,
               description="Fraction of the sample period a kernel (general), the encoder, the decoder or "
                           "the memory controller was busy (NVML)."),
            Row("GPM (Hopper and newer)"),
            ts("SM and DRAM activity", Q(sel("gpuwatch.gpu.sm.activity"), "SM activity"),
               Q(sel("gpuwatch.gpu.sm.occupancy"), "SM occupancy"),
               Q(sel("gpuwatch.gpu.dram.activity"), "DRAM activity"), **RATIO_1,
               description="NVML GPM, device-wide: SM activity is the time at least one warp was active on an "
                           "SM, occupancy the warps resident as a fraction of the maximum, both averaged over "
                           "SMs; DRAM activity is bandwidth used as a fraction of peak."),
            ts("Pipe activity", Q(sel("gpuwatch.gpu.pipe.activity"), "{{pipe}}"), **RATIO_1,
               description="NVML GPM: fraction of cycles each pipe (tensor, fp16, fp32, fp64) was active."),
            Row("Memory"),
            ts("Device memory", Q(sel("hw.gpu.memory.usage"), "used"), Q(sel("gpuwatch.gpu.memory.free"), "free"),
               Q(sel("gpuwatch.gpu.memory.reserved"), "reserved by the driver"),
               Q(sel("hw.gpu.memory.limit"), "total"), unit="bytes", min=0, dashed="^total$"),
            ts("BAR1 memory used", Q(sel("gpuwatch.gpu.bar1_memory.usage"), "BAR1"), unit="bytes", min=0),
            Row("Power, energy and temperature"),
            ts("Power against its limits", Q(sel("hw.power"), "draw"),
               Q(sel("gpuwatch.gpu.power.limit"), "{{limit}} limit"), unit="watt", min=0, dashed="limit$"),
            ts("Temperatures and thresholds", Q(sel("hw.temperature"), "{{sensor}}"),
               Q(sel("hw.temperature.limit"), "{{threshold}}"), unit="celsius",
               dashed="^(slowdown|shutdown|max_operating|max_memory)$"),
            stat("Energy in range", Q(f'sum({increase("hw.energy")})'), unit="joule", width=6, base_color="blue",
                 description="Energy the GPU consumed in the time range (its counter since the driver loaded)."),
            stat("Fan speed", Q(sel("gpuwatch.gpu.fan.speed"), "fan {{fan}}", needs="fan"), **RATIO_1, width=6),
            Row("PCIe and NVLink"),
            ts("PCIe throughput", Q(sel("gpuwatch.gpu.pcie.throughput"), "{{direction}}"), unit="Bps", width=8,
               description="Over a 20 ms NVML sample window, once per collection."),
            ts("PCIe replays", Q(rate("gpuwatch.gpu.pcie.replays"), "replays"), unit="cps", width=8,
               description="Link-level retransmissions: a steady rate points at a bad riser, cable or slot."),
            ts("NVLink traffic", Q(f'sum by (direction) ({rate("gpuwatch.gpu.nvlink.io")})', "{{direction}}",
                                   needs="nvlink"), unit="Bps", width=8),
            ts("NVLink links up", Q(f'sum({sel("gpuwatch.gpu.nvlink.up")})', "links up", needs="nvlink"),
               unit="none", min=0),
            ts("NVLink errors", Q(f'sum by (type) ({rate("gpuwatch.gpu.nvlink.errors")})', "{{type}}",
                                  needs="nvlink"), unit="cps"),
            Row("Errors"),
            table("ECC error counters", Q(sel("hw.errors")), columns={"A": ("errors", "none")}, width=8,
                  description="volatile: since the driver loaded; aggregate: over the GPU's life."),
            ts("Row remapping", Q(sel("gpuwatch.gpu.remapped_rows"), "{{cause}} rows"),
               Q(sel("gpuwatch.gpu.remapped_rows.pending"), "pending"),
               Q(sel("gpuwatch.gpu.remapped_rows.failure"), "failed"), unit="none", min=0, width=8),
            table("XIDs in range", Q(f'sum by (xid) ({increase("gpuwatch.gpu.xid")}) > 0', needs="xid"),
                  columns={"A": ("XIDs", "none")}, width=8),
            Row("Processes"),
            table("Processes on the GPU",
                  Q(keyed(sel("gpuwatch.process.gpu.memory.usage"), "instance", "gpu", "pid", "process")),
                  Q(keyed(sel("gpuwatch.process.gpu.utilization"), "instance", "gpu", "pid", "process")),
                  width=24, height=6,
                  columns={"A": ("memory (black)", "bytes"), "B": ("utilisation", "percentunit")},
                  description="Device memory the driver charges each process, and the share of time it had a "
                              "kernel running (NVML). The busiest are kept; the rest are folded into pid=other."),
            ts("Process memory", Q(sel("gpuwatch.process.gpu.memory.usage"), "{{process}} {{pid}}"), unit="bytes",
               min=0),
            ts("Process utilisation", Q(sel("gpuwatch.process.gpu.utilization"), "{{process}} {{pid}}"),
               **RATIO_1),
        ])


COLOR_OF = {"^white": "#E0E0E0", "^grey": "#8E8E8E", "^black": "#3D3D3D"}


def gpu_memory() -> Dashboard:
    proc = {"process": ("=~", "$process")}
    who = "{{process}} {{pid}} " + GPU
    return Dashboard(
        "gpuwatch-gpu-memory", "gpuwatch / GPU memory and leaks",
        "GPU memory per process in three colors — white: bytes in live tensors, grey: what the framework's "
        "allocator holds, black: what the driver charges — and the leak detector's findings with their "
        "time to out of memory (docs/leaks.md).",
        [DATASOURCE_VAR, NODE_VAR, gpu_var(), process_var("gpuwatch.process.gpu.memory.usage")],
        [
            Row("GPUs"),
            ts("Memory used", Q(with_index(sel("hw.gpu.memory.usage")), GPU),
               Q(with_index(sel("hw.gpu.memory.limit")), GPU + " total"), unit="bytes", min=0, dashed=" total$"),
            ts("Memory free", Q(with_index(sel("gpuwatch.gpu.memory.free")), GPU), unit="bytes", min=0,
               description="NVML's free memory: what a leak's time to out of memory counts down."),
            Row("Three colors per process"),
            ts("$process: white, grey, black",
               Q(with_index(sel("gpuwatch.process.gpu.memory.allocated", **proc)), "white (tensors) " + who,
                 needs="inprocess"),
               Q(with_index(sel("gpuwatch.process.gpu.memory.reserved", **proc)), "grey (allocator pool) " + who,
                 needs="inprocess"),
               Q(f'sum by (instance, pid, process) ({sel("gpuwatch.process.cuda.memory.pooled", **proc)})',
                 "grey (pooled driver allocations, eBPF) {{process}} {{pid}} {{instance}}", needs="ebpf_pool"),
               Q(with_index(sel("gpuwatch.process.gpu.memory.usage", **proc)), "black (driver) " + who),
               unit="bytes", min=0, colors=COLOR_OF, repeat="process",
               description="White rising steadily: tensors kept alive. Grey rising while white is flat: the "
                           "allocator's pool grows. Black rising while grey is flat: memory taken outside the "
                           "allocator (raw cudaMalloc, library workspaces). Grey from eBPF stands in when no "
                           "in-process agent reports: the driver allocations a pool allocator made, told by their "
                           "call stacks."),
            ts("White: bytes in live tensors",
               Q(with_index(sel("gpuwatch.process.gpu.memory.allocated", **proc)), who, needs="inprocess"),
               unit="bytes", min=0, width=8, description="torch.cuda.memory_allocated(), CuPy's pool used_bytes(), "
                                                         "JAX's bytes_in_use, from the in-process agent."),
            ts("Grey: the allocator's pool",
               Q(with_index(sel("gpuwatch.process.gpu.memory.reserved", **proc)), who, needs="inprocess"),
               unit="bytes", min=0, width=8, description="torch.cuda.memory_reserved(), CuPy's pool total_bytes(), "
                                                         "JAX's pool_bytes, from the in-process agent."),
            ts("Black: charged by the driver",
               Q(with_index(sel("gpuwatch.process.gpu.memory.usage", **proc)), who), unit="bytes", min=0, width=8,
               description="NVML's per-process used memory."),
            ts("Self-reported white and grey (not judged)",
               Q(with_index(sel("gpuwatch.process.gpu.memory.allocated.self_reported", **proc)), "white " + who,
                 needs="self_reported"),
               Q(with_index(sel("gpuwatch.process.gpu.memory.reserved.self_reported", **proc)), "grey " + who,
                 needs="self_reported"),
               unit="bytes", min=0, width=24,
               description="What in-process agents report for a GPU NVML cannot confirm them on: shown, never "
                           "judged by the leak detector or alert rules."),
            table("Kubernetes pods of GPU processes", Q(sel("gpuwatch.process.kubernetes", **proc), needs="kubernetes"),
                  width=24, height=6, hide_columns=("Value",),
                  description="Namespace, pod and container of each GPU process, from its cgroup (docs/kubernetes.md); "
                              "join with the per-process series on instance and pid."),
            Row("Leaks"),
            stat("Leaks suspected", Q(f'sum({sel("gpuwatch.leak.suspected", **proc)}) or vector(0)'), unit="none",
                 width=4, height=8, **ALERT_AT_1),
            stat("Soonest out of memory", Q(f'min({sel("gpuwatch.leak.time_to_oom", **proc)})', needs="leak"),
                 unit="s", width=4, height=8, base_color="red", thresholds=[(1800, "orange"), (3600, "green")],
                 description="Alert under 30 minutes: GpuMemoryLeakOutOfMemorySoon."),
            table("Suspected leaks",
                  Q(with_index(sel("gpuwatch.leak.growth.rate", **proc)), needs="leak"),
                  Q(with_index(sel("gpuwatch.leak.time_to_oom", **proc)), needs="leak"),
                  columns={"A": ("growth", "binBps"), "B": ("out of memory in", "s")}, width=16, height=8,
                  description="Open leak findings: which color grows, how fast, and when the GPU runs out of "
                              "memory at that rate. `gpuwatch leaks` on the node shows the window and, with eBPF, "
                              "the allocating call stacks."),
            ts("Leak growth rate", Q(with_index(sel("gpuwatch.leak.growth.rate", **proc)), "{{color}} " + who,
                                     needs="leak"), unit="binBps", min=0, colors=COLOR_OF),
            ts("Time to out of memory", Q(with_index(sel("gpuwatch.leak.time_to_oom", **proc)), "{{color}} " + who,
                                          needs="leak"), unit="s", min=0, thresholds=[(1800, "red")]),
            ts("Out-of-memory events", Q(f'sum by (instance, gpu, cause) ({increase("gpuwatch.oom.events", "1h")})',
                                         "{{instance}} {{gpu}} {{cause}}", needs="oom"), unit="none", min=0,
               description="OOMs in the last hour (`gpuwatch findings` lists each, with the forecast made for it)."),
            stat("How good the forecasts were",
                 Q(quantile(0.5, "gpuwatch.oom.forecast.error"), "median", needs="oom_forecast"),
                 Q(quantile(0.9, "gpuwatch.oom.forecast.error"), "90th percentile", needs="oom_forecast"),
                 unit="percentunit", width=6, height=8, base_color="green",
                 thresholds=[(0.2, "orange"), (0.5, "red")],
                 description="OOMs that a leak finding forecast, in the range: how far off the forecast made when "
                             "the leak was first found was (|came / forecast - 1|), interpolated within the "
                             "histogram's buckets (0.05, 0.1, 0.2, 0.5, 1, 2)."),
            stat("OOMs sooner than forecast",
                 Q(f'sum({increase("gpuwatch.oom.forecast.error", series="count", came="early")}) / '
                   f'sum({increase("gpuwatch.oom.forecast.error", series="count")})', needs="oom_forecast"),
                 unit="percentunit", width=6, height=8, base_color="green", thresholds=[(0.5, "orange")],
                 description="Of the forecast OOMs in the range, the share that came before the forecast: those "
                             "left less time than their forecast said."),
        ])


def cuda_api() -> Dashboard:
    proc = {"process": ("=~", "$process")}
    who = "{{process}} {{pid}} {{instance}}"
    calls = "gpuwatch.cuda.calls"
    return Dashboard(
        "gpuwatch-cuda-api", "gpuwatch / CUDA API",
        "CUDA driver API calls of the processes on the selected nodes, seen by the eBPF probe on libcuda "
        "(runtime, cuBLAS and Triton work all arrive there): calls, latency, errors, launches and bytes.",
        [DATASOURCE_VAR, NODE_VAR, process_var(calls)],
        [
            Row("eBPF probe"),
            stat("eBPF probe", Q(sel("gpuwatch.probe.up", probe="ebpf"), "{{instance}}", needs="ebpf"), width=4,
                 mappings={"1": "up", "0": "down"}, base_color="red", thresholds=[(1, "green")]),
            stat("Attached", Q(sel("gpuwatch.ebpf.attached"), "{{instance}} {{what}}", needs="ebpf"), unit="none",
                 width=8, base_color="blue", description="libcuda libraries the probe attached to, and its uprobes."),
            stat("Calls", Q(f"sum({rate(calls, **proc)})", needs="ebpf"), unit="ops", width=4, base_color="blue"),
            stat("Errors", Q(f'sum({rate("gpuwatch.cuda.errors", **proc)})', needs="ebpf"), unit="ops", width=4,
                 thresholds=[(0.001, "orange")]),
            stat("Kernel launches", Q(f"sum({rate(calls, api=('=~', LAUNCH_APIS), **proc)})", needs="ebpf"),
                 unit="ops", width=4, base_color="blue",
                 description="Estimated from the launch duty cycle unless ebpf.launch_sampling is 1 (see the "
                             "agent dashboard's eBPF launch sampling)."),
            Row("Calls"),
            ts("Calls by API", Q(f"sum by (api) ({rate(calls, **proc)})", "{{api}}", needs="ebpf"), unit="ops"),
            ts("Calls by process", Q(f"sum by (instance, pid, process) ({rate(calls, **proc)})", who, needs="ebpf"),
               unit="ops"),
            ts("Mean latency by API",
               Q(f'sum by (api) ({rate("gpuwatch.cuda.call.duration", **proc)}) / sum by (api) ({rate(calls, **proc)})',
                 "{{api}}", needs="ebpf"), unit="s",
               description="Time inside the API function (entry to return) per call."),
            ts("Time inside the CUDA API, by process",
               Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cuda.call.duration", **proc)})', who,
                 needs="ebpf"), **RATIO,
               description="Seconds spent in CUDA calls per second, all threads of the process together (over "
                           "100 % when several threads are in the API at once). High with synchronisation calls: "
                           "the CPU waits for the GPU."),
            ts("Errors by API", Q(f'sum by (api) ({rate("gpuwatch.cuda.errors", **proc)})', "{{api}}", needs="ebpf"),
               unit="ops", description="Calls that returned a CUresult other than CUDA_SUCCESS. "
                                       "`gpuwatch trace --pid PID` shows the codes."),
            ts("Kernel launches by process",
               Q(f"sum by (instance, pid, process) ({rate(calls, api=('=~', LAUNCH_APIS), **proc)})", who,
                 needs="ebpf"), unit="ops",
               description="cuLaunchKernel*, cuLaunchCooperativeKernel* and cuGraphLaunch*. Thousands a second of "
                           "tiny kernels: the process is launch-bound (CUDA graphs, torch.compile)."),
            Row("CUDA graphs"),
            ts("Kernels run by graph replays, by process",
               Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cuda.graph.kernel.launches", **proc)})', who,
                 needs="ebpf"), unit="ops",
               description="Each cuGraphLaunch runs every kernel node of its graph, with no launch call: counted "
                           "from how each graph was built (stream capture or explicit nodes)."),
            ts("Graph replays by what is known of their content",
               Q(f'sum by (content) ({rate("gpuwatch.cuda.graph.launches", **proc)})', "{{content}}",
                 needs="ebpf"), unit="ops",
               description="known: every kernel node followed; partial: some missed (a capture while the launch "
                           "duty cycle was off), its kernels a lower bound; unknown: instantiated before the probe "
                           "attached, its kernels not counted."),
            Row("Memory"),
            ts("Bytes by API", Q(f'sum by (api) ({rate("gpuwatch.cuda.bytes", **proc)})', "{{api}}", needs="ebpf"),
               unit="Bps", description="Bytes asked for by allocations, copies and sets."),
            ts("Live device memory by process", Q(sel("gpuwatch.process.cuda.memory.live", **proc), who, needs="ebpf"),
               unit="bytes", min=0,
               description="Driver allocations (cuMemAlloc*, cuMemCreate) minus frees since the probe attached, "
                           "pooled or not."),
            ts("Live device memory by allocator",
               Q(sel("gpuwatch.process.cuda.memory.pooled", **proc), "{{process}} {{pid}} {{allocator}} {{instance}}",
                 needs="ebpf_pool"),
               Q(outside_allocators(**proc), "{{process}} {{pid}} outside any allocator {{instance}}", needs="ebpf"),
               unit="bytes", min=0,
               description="Who made the live driver allocations, told by the libraries on their call stacks: a "
                           "pool allocator (the grey color where no in-process agent reports) or plain "
                           "cuMemAlloc/cudaMalloc calls outside any allocator (black beyond grey)."),
            Row("Launches per kernel (CUPTI)"),
            ts("Launches by kernel",
               Q(f'sum by (process, kernel) ({rate("gpuwatch.process.kernel.launches", **proc)})',
                 "{{process}} {{kernel}}", needs="inprocess"), unit="ops", width=24,
               description="Kernel names come from the in-process CUPTI agent (`gpuwatch run`), counted while its "
                           "kernel activity was on (a duty cycle by default); the Kernels dashboard has more."),
        ])


def kernels() -> Dashboard:
    proc = {"process": ("=~", "$process")}
    kernel = "{{process}} {{pid}} {{kernel}}"
    observed = f'sum by (instance, pid, process) ({rate("gpuwatch.cupti.observed", **proc)})'
    per_observed = f") / on(instance, pid, process) group_left() {observed}"
    per_kernel = ("instance", "pid", "process", "kernel")
    return Dashboard(
        "gpuwatch-kernels", "gpuwatch / Kernels",
        "What the GPU ran: per kernel GPU time, launches, duration and theoretical occupancy from the in-process "
        "CUPTI agent (`gpuwatch run`), and device-wide achieved occupancy, cache hit ratios and DRAM throughput "
        "from CUPTI PM sampling (NVML GPM beside them).",
        [DATASOURCE_VAR, NODE_VAR, gpu_var(), process_var("gpuwatch.process.kernel.launches")],
        [
            Row("Kernels (in-process CUPTI agent)"),
            ts("GPU time by kernel",
               Q(f'sum by (instance, pid, process, kernel) ({rate("gpuwatch.process.kernel.duration", **proc)}'
                 + per_observed, kernel, needs="inprocess"), **RATIO,
               description="Seconds of GPU time per second of observed time (kernel activity is on for a duty "
                           "cycle by default): over 100 % when kernels overlap on streams."),
            ts("Launches by kernel",
               Q(f'sum by (instance, pid, process, kernel) ({rate("gpuwatch.process.kernel.launches", **proc)}'
                 + per_observed, kernel, needs="inprocess"), unit="ops",
               description="Executions per second of observed time."),
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
                           "E": ("grid blocks", "none")}, width=24, height=10,
                  description="Low theoretical occupancy on a kernel that takes much GPU time, or a grid of one "
                              "block, is worth a look (`gpuwatch findings`: low_occupancy, degenerate_grid)."),
            ts("Mean duration", Q(sel("gpuwatch.process.kernel.mean_duration", **proc), kernel, needs="inprocess"),
               unit="s", min=0),
            ts("Theoretical occupancy",
               Q(sel("gpuwatch.process.kernel.theoretical_occupancy", **proc), kernel, needs="inprocess"), **RATIO_1,
               description="Warps of the launch configuration that fit on an SM, as a fraction of the maximum "
                           "(the lowest of the kernel's configurations)."),
            Row("Device-wide counters"),
            ts("Occupancy", Q(with_index(sel("gpuwatch.gpu.achieved_occupancy")), GPU + " achieved (CUPTI)",
                              needs="pm_sampling"),
               Q(with_index(sel("gpuwatch.gpu.sm.occupancy")), GPU + " SM occupancy (GPM)"), **RATIO_1,
               description="Achieved occupancy (CUPTI PM sampling) counts only cycles with work; GPM's SM "
                           "occupancy averages over all cycles, idle ones included."),
            ts("Cache hit ratio", Q(with_index(sel("gpuwatch.gpu.cache.hit_ratio")), GPU + " {{cache}}",
                                    needs="pm_sampling"), **RATIO_1,
               description="Sector hit ratio of L1 and L2 (CUPTI PM sampling); absent when a window saw no "
                           "traffic."),
            ts("DRAM", Q(with_index(sel("gpuwatch.gpu.dram.throughput.utilization")), GPU + " throughput (CUPTI)",
                         needs="pm_sampling"),
               Q(with_index(sel("gpuwatch.gpu.dram.activity")), GPU + " activity (GPM)"), **RATIO_1,
               description="CUPTI: the busiest DRAM throughput sub-metric against its peak; GPM: bytes moved "
                           "against peak bandwidth."),
            table("Counter sampler", Q(f'{sel("gpuwatch.profiling.state")} == 1', needs="pm_sampling"),
                  hide_columns=("Value",),
                  description="sampling; yielded: another profiler (ncu, nsys, DCGM) has the counters; backoff: "
                              "restarting after a hang or crash; unavailable: CUPTI cannot run here."),
            Row("In-process agents"),
            table("In-process agents", Q(f'{sel("gpuwatch.cupti.state", **proc)} == 1', needs="inprocess"),
                  hide_columns=("Value",),
                  description="Programs started with `gpuwatch run` and their CUPTI state: on, idle (no CUDA "
                              "yet), yielded (another profiler has CUPTI), unavailable, failed."),
            ts("Observed time", Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cupti.observed", **proc)})',
                                  "{{process}} {{pid}}", needs="inprocess"), **RATIO_1,
               description="Share of time kernel activity was on: the denominator of the kernel series."),
            ts("Records", Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cupti.records", **proc)})',
                            "{{process}} {{pid}} decoded", needs="inprocess"),
               Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cupti.records.dropped", **proc)})',
                 "{{process}} {{pid}} dropped", needs="inprocess"), unit="ops"),
            ts("Decoding cost", Q(f'sum by (instance, pid, process) ({rate("gpuwatch.cupti.decode.duration", **proc)})',
                                  "{{process}} {{pid}}", needs="inprocess"), **RATIO,
               description="CPU time the in-process agent spent decoding records, per second: its main cost to "
                           "the program."),
        ])


def baselines() -> Dashboard:
    own = sel("gpuwatch.baseline.relative_throughput", reference="own")
    sku_floor = HealthSettings().sku_floor
    gemm = "gpuwatch.baseline.gemm.throughput"
    return Dashboard(
        "gpuwatch-baselines", "gpuwatch / GPU health baselines",
        "The reference workload's runs on each GPU over time (docs/baseline.md): FLOP per SM cycle of the "
        "fused GEMM, throughput against cuBLAS, copy bandwidth, each GPU against its own history and its "
        "model, and wrong answers (silent data corruption).",
        [DATASOURCE_VAR, NODE_VAR, gpu_var()],
        [
            Row("Latest runs"),
            stat("Wrong answers", Q(f'sum({sel("gpuwatch.baseline.wrong_answers")})', needs="baseline"),
                 unit="none", width=6, **ALERT_AT_1,
                 description="Output elements of the latest runs beyond tolerance of the float64 reference "
                             "(plus 1 per changed digest): above 0 is silent data corruption."),
            stat("Slower than their own baseline",
                 Q(f'count({own} < {sel("gpuwatch.baseline.threshold")}) or vector(0)'), unit="none", width=6,
                 **ALERT_AT_1, description="GPU and workload pairs whose latest run fell below the threshold of "
                                           "their own history."),
            stat("Below their model", Q(f'count({sel("gpuwatch.baseline.relative_throughput", reference="sku")} '
                                        f'< {sku_floor}) or vector(0)'), unit="none", width=6, **ALERT_AT_1,
                 description=f"Latest runs below {sku_floor:.0%} of what a healthy GPU of the model reaches."),
            stat("Oldest latest run", Q(f'time() - min({sel("gpuwatch.baseline.last_run.timestamp")})',
                                        needs="baseline"), unit="s", width=6, thresholds=[(86400, "orange")],
                 description="Time since the least recently checked GPU's latest run (every 6 h on idle GPUs by "
                             "default)."),
            table("Latest run per GPU",
                  Q(with_index(by_gpu(sel("gpuwatch.baseline.gemm.efficiency"))), needs="baseline"),
                  Q(with_index(by_gpu(sel(gemm, kernel="fused"))), needs="baseline"),
                  Q(with_index(by_gpu(sel("gpuwatch.baseline.memory.throughput"))), needs="baseline"),
                  Q(with_index(by_gpu(sel("gpuwatch.baseline.relative_throughput", reference="own",
                                          workload="gemm"))), needs="baseline"),
                  Q(with_index(by_gpu(sel("gpuwatch.baseline.relative_throughput", reference="sku",
                                          workload="gemm"))), needs="baseline"),
                  Q(with_index(by_gpu(sel("gpuwatch.baseline.wrong_answers"))), needs="baseline"),
                  columns={"A": ("FLOP per cycle", "short"), "B": ("fused GEMM", "flops"), "C": ("copy", "Bps"),
                           "D": ("GEMM vs own", "percentunit"), "E": ("GEMM vs model", "percentunit"),
                           "F": ("wrong answers", "none")}, width=24, height=6,
                  description="vs own: against the median of the GPU's recent normal runs (from its sixth run "
                              "on); vs model: against what a healthy GPU of its model reaches."),
            Row("Over time"),
            ts("Fused kernel FLOP per SM cycle", Q(with_index(sel("gpuwatch.baseline.gemm.efficiency")), GPU,
                                                   needs="baseline"), unit="short",
               description="What the health judgement compares: throughput per SM clock cycle, so a GPU that "
                           "merely runs at a lower clock is not taken for a slower one."),
            ts("Against its own baseline and its model",
               Q(with_index(sel("gpuwatch.baseline.relative_throughput")), GPU + " {{workload}} vs {{reference}}",
                 needs="baseline"),
               Q(with_index(sel("gpuwatch.baseline.threshold")), GPU + " {{workload}} threshold", needs="baseline"),
               **RATIO, dashed=" threshold$",
               description="Latest run / median of the GPU's recent normal runs (own), or / what a healthy GPU "
                           "of the model reaches (sku). Below the threshold: slower."),
            ts("GEMM throughput by kernel", Q(with_index(sel(gemm)), GPU + " {{kernel}}", needs="baseline"),
               unit="flops", min=0),
            ts("Fused kernel against cuBLAS",
               Q(with_index(f'{sel(gemm, kernel="fused")} / ignoring(kernel) {sel(gemm, kernel="cublas")}'), GPU,
                 needs="baseline"), **RATIO),
            ts("Copy bandwidth", Q(with_index(sel("gpuwatch.baseline.memory.throughput")), GPU, needs="baseline"),
               unit="Bps", min=0, description="A 1 GiB device-to-device copy, bytes read + written per second."),
            table("Runs in range by result",
                  Q(with_index(f'sum by (instance, gpu, result) ({increase("gpuwatch.baseline.runs")})'),
                    needs="baseline"), columns={"A": ("runs", "none")},
                  description="ok, slower, below_sku, wrong (judged), skipped (the GPU was busy), failed."),
        ])


def agent() -> Dashboard:
    probe = "{{instance}} {{probe}}"
    return Dashboard(
        "gpuwatch-agent", "gpuwatch / Agent",
        "The gpuwatch agent itself: its build, scrapes, each probe's state, collection time, late and "
        "failed collections, dropped events, and the eBPF and CUPTI helpers.",
        [DATASOURCE_VAR, NODE_VAR],
        [
            Row("Agent"),
            table("Build", Q(sel("gpuwatch.build")), width=12, height=5, hide_columns=("Value",)),
            stat("Scraped", Q('up{job=~".*gpuwatch.*",instance=~"$instance"}', "{{instance}}"), width=6, height=5,
                 mappings={"1": "up", "0": "down"}, base_color="red", thresholds=[(1, "green")],
                 description="Prometheus' own `up` for scrape jobs whose name contains gpuwatch (as the "
                             "GpuwatchAgentDown alert assumes)."),
            stat("Probes down", Q(f'sum(1 - {sel("gpuwatch.probe.up")})'), unit="none", width=6, height=5,
                 **ALERT_AT_1),
            Row("Probes"),
            ts("Probe up", Q(sel("gpuwatch.probe.up"), probe), unit="none", min=0, max=1, stepped=True,
               description="0: unavailable, failing or late (`gpuwatch status` says why). Alert: GpuwatchProbeDown."),
            ts("Collection time", Q(sel("gpuwatch.probe.duration"), probe), unit="s", min=0,
               description="Wall time of each probe's last collection."),
            ts("Late collections", Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.late")})', probe), unit="cps",
               width=8, description="Collections that overran their deadline (a hung NVML call, say)."),
            ts("Collection errors", Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.errors")})', probe),
               unit="cps", width=8),
            ts("Events dropped", Q(f'sum by (instance, probe) ({rate("gpuwatch.probe.events.dropped")})', probe),
               unit="cps", width=8),
            ts("NVML call errors", Q(f'sum by (instance, error) ({rate("gpuwatch.nvml.call.errors")})',
                                     "{{instance}} {{error}}", needs="nvml_errors"), unit="cps",
               description="NVML calls that failed (other than not-supported), by NVML error."),
            ts("eBPF attachments", Q(sel("gpuwatch.ebpf.attached"), "{{instance}} {{what}}", needs="ebpf"),
               unit="none", min=0),
            ts("eBPF launch sampling", Q(sel("gpuwatch.ebpf.launch.sampled"), "{{instance}}", needs="ebpf"),
               unit="percentunit", min=0,
               description="Fraction of the time launches were counted (ebpf.launch_sampling); below 100 % the "
                           "launch APIs' call counts are estimates. Every other API is exact."),
            Row("Bounds"),
            ts("History series", Q(sel("gpuwatch.history.series"), "{{instance}}"),
               Q(f'sum by (instance, reason) ({rate("gpuwatch.history.series.evicted")})',
                 "{{instance}} evicted ({{reason}}) /s"), unit="none", min=0, width=8,
               description="Series held for the detectors (at most 16384; a process's are forgotten 10 min after "
                           "it ends), and the rate they are forgotten at."),
            ts("In-process reports refused",
               Q(f'sum by (instance, reason) ({rate("gpuwatch.cupti.reports.refused")})',
                 "{{instance}} report {{reason}}"),
               Q(f'sum by (instance, reason) ({rate("gpuwatch.cupti.memory.refused")})',
                 "{{instance}} memory {{reason}}"), unit="cps", width=8,
               description="Reports over the bounds (16 processes per user, 256 in all, one per 0.1 s) and memory "
                           "entries for GPUs NVML does not know or list the process on."),
            ts("Dropped by the agent",
               Q(f'sum by (instance) ({rate("gpuwatch.findings.dropped")})', "{{instance}} findings"),
               Q(f'sum by (instance, probe) ({rate("gpuwatch.history.points.future")})',
                 "{{instance}} {{probe}} points from the future"), unit="cps", width=8,
               description="Findings beyond the 256 open at once; points dated over a minute ahead."),
            ts("Control socket requests",
               Q(f'sum by (instance, method, result) ({rate("gpuwatch.control.requests")})',
                 "{{instance}} {{method}} {{result}}"), unit="cps",
               description="Control socket requests by method and result. refused: bad params, not the caller's "
                           "process, too large; busy: over the connections one user may hold (4) or all (16); "
                           "gone: the process that opened the connection exited; idle: closed without a request."),
            Row("CUPTI PM sampler"),
            table("Sampler state", Q(f'{sel("gpuwatch.profiling.state")} == 1', needs="pm_sampling"), width=8,
                  hide_columns=("Value",)),
            ts("Sampler restarts", Q(f'sum by (instance, reason) ({rate("gpuwatch.cupti.sampler.restarts")})',
                                     "{{instance}} {{reason}}", needs="pm_sampling"), unit="cps", width=8,
               description="hang: silent past its timeout and killed; crash: exited unexpectedly."),
            ts("Sampler protocol errors", Q(f'sum by (instance) ({rate("gpuwatch.cupti.sampler.invalid_lines")})',
                                            "{{instance}}", needs="pm_sampling"), unit="cps", width=8,
               description="Lines the sampler child printed that are not its protocol (ignored)."),
            Row("OTLP export"),
            ts("OTLP items", Q(f'sum by (instance, signal, result) ({rate("gpuwatch.otlp.items")})',
                               "{{instance}} {{signal}} {{result}}", needs="otlp"), unit="cps", width=24,
               description="Data points and log records exported, failed (refused, down or too slow after retries) "
                           "and dropped (the queue was full), from the OpenTelemetry SDK's own counters "
                           "(docs/otlp.md)."),
        ])


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


def infra_health() -> Dashboard:
    util = sel("hw.gpu.utilization", task="general")
    temp = sel("hw.temperature", sensor="gpu")
    disk_busy = f'rate({foreign("node_disk_io_time_seconds_total")}[$__rate_interval])'
    pending = f'sum({foreign("kube_pod_status_phase", phase="Pending")})'
    who = "{{instance}} {{process}} ({{pid}})"
    by_proc = "sum by (instance, pid, process"
    host = {"needs": "host"}
    return Dashboard(
        "gpuwatch-infra-health", "gpuwatch / Infra health",
        "The five golden signals an inference team watches — GPU saturation, KV-cache hit ratio, GPU "
        "temperature, disk I/O wait, pending pods — with the alert thresholds, gpuwatch's host-bound "
        "findings, and the host side of each GPU process: CPU, memory, faults, disk, cgroup throttling and "
        "pressure, and how much of its files the page cache holds.",
        [DATASOURCE_VAR, NODE_VAR, gpu_var()],
        [
            Row("Golden signals"),
            stat("GPUs saturated", Q(f"count(min_over_time({util}[5m]) >= {SATURATED}) or vector(0)"), unit="none",
                 width=4, **ALERT_AT_1,
                 description=f"GPUs at {SATURATED:.0%} utilisation or more for the last 5 minutes: more work "
                             "queues than the GPU can run. Alert: GpuSaturated."),
            stat("Lowest KV-cache hit ratio", Q(f"min({kv_cache_hit_ratio()})", needs="vllm"), **RATIO_1, width=4,
                 base_color="red", thresholds=[(KV_HIT_LOW, "green")],
                 description=f"The lowest prefix-cache hit ratio over the vLLM servers and models (under "
                             f"{KV_HIT_LOW:g}: prompts are recomputed that could be reused). Alert: KvCacheHitRatioLow."),
            stat("Hottest GPU", Q(f"max({temp})"), unit="celsius", width=4, thresholds=[(HOT, "red")],
                 description=f"The highest GPU temperature; above {HOT} °C for 5 minutes: GpuTemperatureHigh."),
            stat("Busiest disk", Q(f"max({disk_busy})", needs="node_exporter"), **RATIO_1, width=4,
                 thresholds=[(DISK_BUSY, "red")],
                 description="The largest fraction of time a disk had I/O in flight, over all node_exporter "
                             f"targets; above {DISK_BUSY:.0%} for 10 minutes: NodeDiskIoBusy."),
            stat("Pending pods", Q(pending, needs="kube_state_metrics"), unit="none", width=4, **ALERT_AT_1,
                 description="Pods in phase Pending, cluster-wide; above 0 for 15 minutes: PodsPending."),
            stat("Host-bound findings", Q(f'sum({sel("gpuwatch.host_bound.suspected")}) or vector(0)'), unit="none",
                 width=4, **ALERT_AT_1,
                 description="GPU processes whose GPU work fell while a host-side cause held. Alert: GpuHostBound."),
            ts("GPU utilisation", Q(with_index(util), GPU), **RATIO_1, thresholds=[(SATURATED, "red")],
               description=f"Fraction of the sample period a kernel was running (NVML). At {SATURATED:.0%} or more "
                           "for 5 minutes the GPU is saturated: GpuSaturated."),
            ts("KV-cache hit ratio", Q(kv_cache_hit_ratio(), "{{instance}} {{model_name}}", needs="vllm"), **RATIO_1,
               base_color="red", thresholds=[(KV_HIT_LOW, "green")],
               description="vLLM's prefix-cache hits / queries per server and model (vllm:prefix_cache_*_total, "
                           "or vllm:gpu_prefix_cache_*_total from older servers). Under "
                           f"{KV_HIT_LOW:g} for 10 minutes: KvCacheHitRatioLow."),
            ts("GPU temperature", Q(with_index(temp), GPU), unit="celsius", thresholds=[(HOT, "red")],
               description=f"GPU core temperature (NVML). Above {HOT} °C for 5 minutes: GpuTemperatureHigh."),
            ts("Disk I/O busy", Q(disk_busy, "{{instance}} {{device}}", needs="node_exporter"), **RATIO_1,
               thresholds=[(DISK_BUSY, "red")],
               description="Fraction of time each disk had I/O in flight (node_exporter's "
                           "node_disk_io_time_seconds_total per second), on every node_exporter target. Above "
                           f"{DISK_BUSY:.0%} for 10 minutes: NodeDiskIoBusy."),
            ts("Pods pending", Q(pending, "pending", needs="kube_state_metrics"), unit="none", min=0, width=24,
               thresholds=[(1, "red")],
               description="Pods in phase Pending, cluster-wide (kube-state-metrics). Above 0 for 15 minutes: "
                           "PodsPending."),
            Row("Host-bound findings"),
            table("Host-bound GPU processes",
                  Q(with_index(f'{sel("gpuwatch.host_bound.suspected")} == 1'), needs="host_bound"), width=12,
                  hide_columns=("Value",),
                  description="Open host_bound findings: the GPU process, and the host-side cause its GPU work "
                              "fell with (page_cache_eviction, input_thread, cpu_throttled, swapping, "
                              "memory_pressure, io_pressure). `gpuwatch findings` on the node has the evidence."),
            ts("Host-bound findings over time",
               Q(with_index(sel("gpuwatch.host_bound.suspected")), GPU + " {{process}} ({{pid}}) {{cause}}",
                 needs="host_bound"), unit="none", min=0, max=1, stepped=True,
               description="1 while a finding is open. Alert after 2 minutes: GpuHostBound."),
            Row("Host side of GPU processes"),
            ts("Process CPU", Q(sel("gpuwatch.process.cpu.utilization"), who, **host), unit="percentunit", min=0,
               description="CPU time of each GPU process per second (100 %: one core busy; above is several)."),
            ts("CPU time by mode",
               Q(f'{by_proc}, mode) ({rate("gpuwatch.process.cpu.time")})', who + " {{mode}}", **host),
               unit="percentunit", min=0, description="user and system CPU time per second."),
            ts("Busiest threads", Q(sel("gpuwatch.process.thread.cpu.utilization"), who + " {{thread}} ({{tid}})",
                                    **host), unit="percentunit", min=0, thresholds=[(0.9, "red")],
               description="The busiest 3 threads of each GPU process. One near 100 % is a single thread the GPU "
                           "waits on, such as a data loader (cause input_thread)."),
            ts("Host memory", Q(sel("gpuwatch.process.memory.rss"), who + " resident", **host),
               Q(sel("gpuwatch.process.memory.swap"), who + " swapped", **host), unit="bytes", min=0,
               description="Resident and swapped-out host memory (swap in use: cause swapping)."),
            ts("Page faults", Q(f'{by_proc}, type) ({rate("gpuwatch.process.paging.faults")})', who + " {{type}}",
                                **host), unit="cps", min=0,
               description="Major faults read a page from disk (an evicted file page, or swap); minor ones do not."),
            ts("Process disk I/O", Q(f'{by_proc}, direction) ({rate("gpuwatch.process.disk.io")})',
                                     who + " {{direction}}", **host), unit="Bps", min=0,
               description="Bytes each GPU process read from and wrote to storage (page-cache hits excluded)."),
            ts("Context switches", Q(f'{by_proc}, type) ({rate("gpuwatch.process.context_switches")})',
                                     who + " {{type}}", **host), unit="cps", min=0, width=8,
               description="Voluntary (waits) and involuntary (preempted: too few cores) switches per second."),
            ts("Threads in D state", Q(sel("gpuwatch.process.threads.blocked"), who, **host), unit="none", min=0,
               width=8, description="Threads in uninterruptible sleep, mostly waiting on disk."),
            ts("CPU quota throttling",
               Q(f'{by_proc}) ({rate("gpuwatch.process.cgroup.cpu.throttled.time")})', who + " throttled s/s",
                 **host),
               Q(f'{by_proc}) ({rate("gpuwatch.process.cgroup.cpu.throttled.periods")})', who + " periods/s",
                 **host), unit="short", min=0, width=8,
               description="Time per second the process's cgroup was held by its CPU quota, and the throttled "
                           "periods per second (cause cpu_throttled: raise the pod's CPU limit)."),
            ts("Pressure stall",
               Q(f'{by_proc}, resource, scope) ({rate("gpuwatch.process.cgroup.pressure.stall.time")})',
                 who + " {{resource}} {{scope}}", **host), unit="percentunit", min=0,
               description="Share of time tasks of the process's cgroup stalled on cpu, io or memory (PSI; some: "
                           "at least one task, full: all). Causes memory_pressure, io_pressure."),
            ts("Node top readers", Q(sel("gpuwatch.node.process.disk.read.rate"), who, **host), unit="Bps", min=0,
               description="The 5 processes of the node reading most from storage, GPU or not: who may be "
                           "evicting a GPU process's files from the page cache."),
            table("File page-cache residency",
                  Q(keyed(f'{sel("gpuwatch.process.file.cache.resident")} / {sel("gpuwatch.process.file.size")}',
                          "instance", "pid", "process", "file"), needs="host_files"),
                  Q(keyed(sel("gpuwatch.process.file.size"), "instance", "pid", "process", "file"),
                    needs="host_files"),
                  Q(keyed(sel("gpuwatch.process.file.cache.evicted"), "instance", "pid", "process", "file"),
                    needs="host_evicted"),
                  width=24, columns={"A": ("resident", "percentunit"), "B": ("size", "bytes"),
                                     "C": ("evicted", "bytes")},
                  description="The large files each GPU process maps or holds open (weights, datasets): how much "
                              "of each the page cache holds, and how much it evicted that the kernel remembers. "
                              "Low residency with major faults: cause page_cache_eviction."),
            ts("Page-cache residency over time",
               Q(f'{sel("gpuwatch.process.file.cache.resident")} / {sel("gpuwatch.process.file.size")}',
                 who + " {{file}}", needs="host_files"), **RATIO_1, width=24,
               description="Resident bytes / size of each large file of a GPU process."),
        ])


def dashboards() -> list[Dashboard]:
    return [node_overview(), gpu_detail(), gpu_memory(), cuda_api(), kernels(), baselines(), agent(), infra_health()]


# --- Grafana JSON ----------------------------------------------------------------------------


def _needs_text(p: Panel) -> str:
    everything = all(q.needs for q in p.queries)
    return " ".join(f"{'Empty' if everything else 'Some series are empty'} without {NEEDS[n]}." for n in p.needs)


def _value_field(p: Panel, ref: str) -> str:
    # Grafana names a table query's value column "Value", or "Value #A" when several queries are merged.
    return "Value" if len(p.queries) == 1 else f"Value #{ref}"


def _target(p: Panel, ref: str, q: Query) -> dict:
    t = {"datasource": DATASOURCE, "editorMode": "code", "expr": q.expr}
    if p.kind == "table":
        t.update(format="table", instant=True, range=False)
    elif p.kind == "stat":
        t.update(instant=True, range=False, legendFormat=q.legend or "__auto")
    else:
        t.update(instant=False, range=True, legendFormat=q.legend or "__auto")
    t["refId"] = ref
    return t


def _field_config(p: Panel) -> dict:
    defaults: dict = {"unit": p.unit}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    defaults["color"] = {"mode": "thresholds" if p.kind == "stat" else "palette-classic"}
    defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": p.base_color, "value": None}]
                              + [{"color": color, "value": value} for value, color in p.thresholds]}
    if p.needs and all(q.needs in EXPORTERS for q in p.queries):
        defaults["noValue"] = "No data: needs " + " and ".join(EXPORTERS[n] for n in p.needs)
    if p.mappings:
        defaults["mappings"] = [{"type": "value", "options": {
            value: {"index": i, "text": text} for i, (value, text) in enumerate(p.mappings.items())}}]
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "fillOpacity": 0, "lineInterpolation":
                              "stepAfter" if p.stepped else "linear", "lineWidth": 1, "showPoints": "never",
                              "spanNulls": False, "thresholdsStyle": {"mode": "dashed" if p.thresholds else "off"}}
    overrides = []
    for regex, color in p.colors.items():
        overrides.append({"matcher": {"id": "byRegexp", "options": regex},
                          "properties": [{"id": "color", "value": {"fixedColor": color, "mode": "fixed"}}]})
    if p.dashed:
        overrides.append({"matcher": {"id": "byRegexp", "options": p.dashed},
                          "properties": [{"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}}]})
    for ref, (title, unit) in p.columns.items():
        overrides.append({"matcher": {"id": "byName", "options": _value_field(p, ref)},
                          "properties": [{"id": "displayName", "value": title}, {"id": "unit", "value": unit}]})
    return {"defaults": defaults, "overrides": overrides}


def _options(p: Panel) -> dict:
    if p.kind == "stat":
        return {"colorMode": "value", "graphMode": "none", "justifyMode": "auto", "orientation": "auto",
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "textMode": "auto"}
    if p.kind == "table":
        return {"cellHeight": "sm", "showHeader": True}
    return {"legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"}}


def panel_json(p: Panel, panel_id: int, grid: dict) -> dict:
    description = " ".join(filter(None, (p.description, _needs_text(p))))
    out = {"datasource": DATASOURCE, "description": description, "fieldConfig": _field_config(p),
           "gridPos": grid, "id": panel_id, "options": _options(p)}
    if p.repeat:
        out.update(maxPerRow=2, repeat=p.repeat, repeatDirection="h")
    refs = [chr(ord("A") + i) for i in range(len(p.queries))]
    out["targets"] = [_target(p, ref, q) for ref, q in zip(refs, p.queries)]
    out["title"] = p.title
    if p.kind == "table":
        hidden = {name: True for name in ("Time", "__name__", "job", *p.hide_columns)}
        out["transformations"] = ([{"id": "merge", "options": {}}] if len(p.queries) > 1 else []) + [
            {"id": "organize", "options": {"excludeByName": hidden, "indexByName": {}, "renameByName": {}}}]
    out["type"] = p.kind
    return out


def dashboard_json(d: Dashboard) -> dict:
    panels, x, y, line_height = [], 0, 0, 0
    for panel_id, item in enumerate(d.items, start=1):
        if isinstance(item, Row):
            y, x, line_height = y + line_height, 0, 0
            panels.append({"collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "id": panel_id,
                           "panels": [], "title": item.title, "type": "row"})
            y += 1
            continue
        if x + item.width > 24:
            y, x, line_height = y + line_height, 0, 0
        panels.append(panel_json(item, panel_id, {"h": item.height, "w": item.width, "x": x, "y": y}))
        x, line_height = x + item.width, max(line_height, item.height)
    return {
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": d.description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [{"asDropdown": True, "icon": "external link", "includeVars": True, "keepTime": True,
                   "tags": [TAG], "targetBlank": False, "title": "gpuwatch", "tooltip": "", "type": "dashboards",
                   "url": ""}],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": [TAG],
        "templating": {"list": [v.json() for v in d.variables]},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": d.title,
        "uid": d.uid,
        "version": 1,
        "weekStart": "",
    }


def render(d: Dashboard) -> str:
    return json.dumps(dashboard_json(d), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail with a diff instead of writing when a file is stale")
    ap.add_argument("--output", type=Path, default=OUT, help=f"directory to write or check (default {OUT})")
    args = ap.parse_args(argv)
    want = {d.file: render(d) for d in dashboards()}
    present = {p.name for p in args.output.glob("*.json")} if args.output.is_dir() else set()
    if args.check:
        ok = True
        for name, text in want.items():
            path = args.output / name
            have = path.read_text(encoding="utf-8") if path.exists() else ""
            if have != text:
                ok = False
                sys.stdout.writelines(difflib.unified_diff(
                    have.splitlines(keepends=True), text.splitlines(keepends=True),
                    fromfile=f"{path} (committed)", tofile=f"{path} (from scripts/gen_dashboards.py)"))
        for name in sorted(present - set(want)):
            ok = False
            print(f"{args.output / name} is not generated by scripts/gen_dashboards.py")
        if not ok:
            print("dashboards are stale: run scripts/gen_dashboards.py", file=sys.stderr)
        return 0 if ok else 1
    args.output.mkdir(parents=True, exist_ok=True)
    for name in present - set(want):  # a dashboard renamed or dropped in the generator
        (args.output / name).unlink()
    for name, text in want.items():
        (args.output / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
