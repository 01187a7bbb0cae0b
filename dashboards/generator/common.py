"""What every dashboard shares: the needs a query may have, other exporters' series, PromQL built from
the metric registry (agent/metrics.py), the template variables, and panel builders of the Grafana
Foundation SDK set up as our dashboards draw them."""
from __future__ import annotations

from dataclasses import dataclass
from string import ascii_uppercase

from grafana_foundation_sdk.builders import common as viz
from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders import prometheus, stat as stat_panel, table as table_panel, timeseries
from grafana_foundation_sdk.models import common as viz_model
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import prometheus as prometheus_model
from gpuwatch.agent.metrics import Kind, get
from gpuwatch.probes.ebpf.symbols import COLLECTIVE_APIS, LAUNCH_APIS

# gpuwatch_probe_state's states that are a probe down (disabled is off by the install, not down),
# as the GpuwatchProbeDown rule has them.
DOWN_STATES = "unavailable|failing|late"

DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
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
    "nccl": "the eBPF probe and NCCL jobs on the node (it hooks their libnccl)",
    "nccl_ranks": "the eBPF probe and an NCCL communicator with ranks in two or more processes on the node "
                  "(its collectives' entry times are compared)",
    "straggler": "an open straggler_rank finding",
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

# The api label values of kernel launches, as a regex: the eBPF probe's own list, so a new launch hook
# shows up in the launch panels without an edit here.
LAUNCHES = "|".join(sorted(LAUNCH_APIS))
COLLECTIVES = "|".join(sorted(COLLECTIVE_APIS))


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
    return (f"({expr}) * on(instance, gpu) group_left(gpu_index) "
            f"max by (instance, gpu, gpu_index) ({sel('gpuwatch.gpu')})")


GPU = "{{instance}} GPU {{gpu_index}}"  # legend of a series joined by with_index()


def keyed(expr: str, *labels: str) -> str:
    """expr with exactly these labels: a table's queries need the same ones for Grafana to merge their rows."""
    return f"max by ({', '.join(labels)}) ({expr})"


def by_gpu(expr: str) -> str:
    return keyed(expr, "instance", "gpu")


# --- panels ----------------------------------------------------------------------------------


class Query(prometheus.Dataquery):
    """A PromQL query on the dashboard's Prometheus, and what must happen before it returns series
    (a NEEDS key; "" when it always does)."""

    def __init__(self, expr: str, legend: str = "", needs: str = "") -> None:
        if needs and needs not in NEEDS:
            raise KeyError(f"unknown need {needs!r}; known: {sorted(NEEDS)}")
        super().__init__()
        self.expr(expr).datasource(DATASOURCE).editor_mode(prometheus_model.QueryEditorMode.CODE)
        self.legend = legend
        self.needs = needs

    def build(self) -> prometheus_model.Dataquery:
        query = super().build()
        # Grafana's JSON has no field for it: the need rides on the built query, where explain_needs()
        # and the tests that run every query read it.
        query.needs = self.needs
        return query


Q = Query  # short, for the many queries of the dashboards


def _add_queries(panel, queries: tuple[Query, ...], shape) -> None:
    for ref, query in zip(ascii_uppercase, queries):
        panel.with_target(shape(query.ref_id(ref)))


def steps(base: str, *above: tuple[float, str]) -> grafana.ThresholdsConfig:
    """Thresholds: a base color, then (value, color) steps above it."""
    return (grafana.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE)
            .steps([model.Threshold(None, base)] + [model.Threshold(value, color) for value, color in above]))


def ts(title: str, *queries: Query) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).datasource(DATASOURCE).span(12).height(8).unit("short")
             .color_scheme(grafana.FieldColor().mode(model.FieldColorModeId.PALETTE_CLASSIC)).thresholds(steps("green"))
             .legend(viz.VizLegendOptions().display_mode(viz_model.LegendDisplayMode.LIST)
                     .placement(viz_model.LegendPlacement.BOTTOM).show_legend(True).calcs([]))
             .tooltip(viz.VizTooltipOptions().mode(viz_model.TooltipDisplayMode.MULTI)
                      .sort(viz_model.SortOrder.DESCENDING))
             .draw_style(viz_model.GraphDrawStyle.LINE).line_interpolation(viz_model.LineInterpolation.LINEAR)
             .line_width(1).fill_opacity(0).show_points(viz_model.VisibilityMode.NEVER).span_nulls(False)
             .thresholds_style(viz.GraphThresholdsStyleConfig().mode(viz_model.GraphThresholdsStyleMode.OFF)))
    _add_queries(panel, queries, lambda q: q.range().legend_format(q.legend or "__auto"))
    return panel


STEPPED = viz_model.LineInterpolation.STEP_AFTER  # for states: a value holds until the next sample


def dashed() -> viz.GraphThresholdsStyleConfig:
    """A time series' thresholds drawn as dashed lines (alert levels)."""
    return viz.GraphThresholdsStyleConfig().mode(viz_model.GraphThresholdsStyleMode.DASHED)


def dashed_line() -> list[model.DynamicConfigValue]:
    """Series drawn dashed: limits and thresholds beside the values they bound."""
    return [model.DynamicConfigValue("custom.lineStyle", {"dash": [10, 10], "fill": "dash"})]


def colors(by_regex: dict[str, str]) -> list[grafana.DashboardFieldConfigSourceOverrides]:
    """Fixed colors of the series whose names match each regex."""
    return [grafana.DashboardFieldConfigSourceOverrides().matcher(model.MatcherConfig("byRegexp", regex))
            .properties([model.DynamicConfigValue("color", {"fixedColor": color, "mode": "fixed"})])
            for regex, color in by_regex.items()]


def value_texts(texts: dict[str, str]) -> list[model.ValueMap]:
    """Values shown as words (1: up, 0: lost)."""
    return [model.ValueMap({value: model.ValueMappingResult(text=text, index=i)
                            for i, (value, text) in enumerate(texts.items())})]


def stat(title: str, *queries: Query) -> stat_panel.Panel:
    panel = (stat_panel.Panel().title(title).datasource(DATASOURCE).span(3).height(4).unit("short")
             .color_scheme(grafana.FieldColor().mode(model.FieldColorModeId.THRESHOLDS)).thresholds(steps("green"))
             .color_mode(viz_model.BigValueColorMode.VALUE).graph_mode(viz_model.BigValueGraphMode.NONE)
             .justify_mode(viz_model.BigValueJustifyMode.AUTO).orientation(viz_model.VizOrientation.AUTO)
             .text_mode(viz_model.BigValueTextMode.AUTO)
             .reduce_options(viz.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)))
    _add_queries(panel, queries, lambda q: q.instant().legend_format(q.legend or "__auto"))
    return panel


def table(title: str, *queries: Query, columns: dict[str, tuple[str, str]] | None = None,
          hide: tuple[str, ...] = ()) -> table_panel.Panel:
    """A table of instant queries, one row per series, their rows merged on equal labels; columns: a
    query's refId -> (title, unit) of its value column; hide: label columns left out."""
    panel = (table_panel.Panel().title(title).datasource(DATASOURCE).span(12).height(8).unit("short")
             .color_scheme(grafana.FieldColor().mode(model.FieldColorModeId.PALETTE_CLASSIC)).thresholds(steps("green"))
             .cell_height(viz_model.TableCellHeight.SM).show_header(True))
    _add_queries(panel, queries, lambda q: q.instant().format(prometheus_model.PromQueryFormat.TABLE))
    if len(queries) > 1:
        panel.with_transformation(model.DataTransformerConfig("merge", options={}))
    hidden = {name: True for name in ("Time", "__name__", "job", *hide)}
    panel.with_transformation(model.DataTransformerConfig(
        "organize", options={"excludeByName": hidden, "indexByName": {}, "renameByName": {}}))
    for ref, (column, unit) in (columns or {}).items():
        # Grafana names a table query's value column "Value", or "Value #A" when several queries are merged.
        name = "Value" if len(queries) == 1 else f"Value #{ref}"
        panel.override_by_name(name, [model.DynamicConfigValue("displayName", column),
                                      model.DynamicConfigValue("unit", unit)])
    return panel


def explain_needs(panel):
    """The panel's description says what its empty queries wait for; a panel fed only by other exporters
    shows which ones in place of its data, so that an empty panel says what to deploy."""
    built = panel.build()
    needs = [query.needs for query in built.targets]
    wanted = sorted(set(filter(None, needs)))
    if not wanted:
        return panel
    empty = "Empty" if all(needs) else "Some series are empty"
    text = " ".join(f"{empty} without {NEEDS[need]}." for need in wanted)
    panel.description(" ".join(filter(None, (built.description, text))))
    if all(need in EXPORTERS for need in needs):
        panel.no_value("No data: needs " + " and ".join(EXPORTERS[need] for need in wanted))
    return panel


# --- template variables ----------------------------------------------------------------------


def datasource_var() -> grafana.DatasourceVariable:
    return grafana.DatasourceVariable("datasource").label("Data source").type("prometheus").regex("")


def query_var(name: str, label: str, query: str, multi: bool = True) -> grafana.QueryVariable:
    var = (grafana.QueryVariable(name).label(label).datasource(DATASOURCE)
           .query({"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"})
           .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(model.VariableSort.ALPHABETICAL_ASC)
           .multi(multi).include_all(multi).regex(""))
    return var.all_value(".*") if multi else var


def node_var() -> grafana.QueryVariable:
    return query_var("instance", "Node", f"label_values({get('gpuwatch.build').prom_exposed_name}, instance)")


def gpu_var(multi: bool = True) -> grafana.QueryVariable:
    return query_var("gpu", "GPU",
                     f'label_values({get("gpuwatch.gpu").prom_exposed_name}{{instance=~"$instance"}}, gpu)', multi)


def process_var(metric: str) -> grafana.QueryVariable:
    name = get(metric).prom_exposed_name
    return query_var("process", "Process", f'label_values({name}{{instance=~"$instance"}}, process)')


# --- dashboards ------------------------------------------------------------------------------


def build_dashboard(uid: str, title: str, description: str, variables: list, items: list) -> grafana.Dashboard:
    """A dashboard of rows (grafana.Row) and panels, laid out in order by the SDK: a new line starts
    once a line's panels fill its 24 columns, and not before, so the widths on a line add up to 24
    (tests/unit/test_dashboards.py fails on a panel that sticks out)."""
    board = (grafana.Dashboard(title).uid(uid).description(description).tags([TAG]).editable()
             .tooltip(model.DashboardCursorSync.CROSSHAIR).refresh("30s").time("now-1h", "now")
             .timezone("browser").week_start("").fiscal_year_start_month(0).version(1)
             .annotation(grafana.AnnotationQuery().name("Annotations & Alerts").built_in(1).type("dashboard")
                         .datasource(model.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
                         .enable(True).hide(True).icon_color("rgba(0, 211, 255, 1)"))
             .link(grafana.DashboardLink("gpuwatch").type(model.DashboardLinkType.DASHBOARDS).tags([TAG])
                   .as_dropdown(True).include_vars(True).keep_time(True).icon("external link")
                   .target_blank(False).tooltip("").url(""))
             .variables(variables))
    for panel_id, item in enumerate(items, start=1):
        if isinstance(item, grafana.Row):
            board.with_row(item.id(panel_id))
        else:
            board.with_panel(explain_needs(item.id(panel_id)))
    return board
