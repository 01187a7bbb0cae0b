"""The Grafana dashboards (dashboards/grafana/*.json): built in dashboards/generator/, written by
scripts/gen_dashboards.py and committed as generated, importable as they are, and together they show
every metric the agent exports.
Their queries run against a real Prometheus in tests/e2e/test_dashboards_prometheus.py."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from gpuwatch.agent.metrics import METRICS, Kind

from dashboards import generator
from dashboards.generator import common
from tests.conftest import ROOT
from tests.rules.test_rules import SCRAPE_LABELS, exposed_series, selectors

GEN = ROOT / "scripts" / "gen_dashboards.py"
DIR = ROOT / "dashboards" / "grafana"

# Metrics no dashboard shows, each with the reason. Keep it short: a metric worth exporting is
# usually worth a panel.
INTENTIONALLY_ABSENT: dict[str, str] = {}

# Panels that show a counter's own value on purpose, with the reason; everywhere else a counter is
# read through rate() or increase(), which ride out resets.
RAW_COUNTER_PANELS = {"ECC error counters": "the count since the driver loaded and over the GPU's life is the point"}

# Grafana unit ids the generator may use (a typo shows raw numbers, silently).
UNITS = {"bytes", "Bps", "binBps", "watt", "joule", "celsius", "hertz", "s", "percentunit", "flops", "ops", "cps",
         "short", "none", "prefix:P", "prefix:x"}
BUILTIN_VARIABLES = {"__rate_interval", "__range", "__interval"}
VARIABLE = re.compile(r"\$\{?(\w+)")


def committed() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted(DIR.glob("*.json"))}


def queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel."""
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def walk(obj, key: str):
    """Every value stored under `key` anywhere in a JSON tree."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield v
            yield from walk(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from walk(v, key)


# --- generated, and committed as generated ---------------------------------------------------


def test_committed_dashboards_are_what_the_generator_writes():
    out = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert set(committed()) == {generator.file_name(d) for d in generator.dashboards()}


def test_check_reports_a_hand_edit_and_a_stray_file(tmp_path):
    copy = tmp_path / "grafana"
    shutil.copytree(DIR, copy)
    overview = copy / "gpuwatch-node-overview.json"
    overview.write_text(overview.read_text().replace('"title": "GPUs lost"', '"title": "GPUs gone"'))
    (copy / "mine.json").write_text("{}")
    out = subprocess.run([sys.executable, str(GEN), "--check", "--output", str(copy)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 1
    assert '-      "title": "GPUs gone"' in out.stdout and '+      "title": "GPUs lost"' in out.stdout
    assert "mine.json is not generated" in out.stdout and "stale" in out.stderr


def test_generation_is_deterministic():
    first = [generator.render(d) for d in generator.dashboards()]
    assert first == [generator.render(d) for d in generator.dashboards()]


# --- every metric shown, by its registry name -------------------------------------------------


def test_every_metric_is_in_a_dashboard_or_intentionally_absent():
    series = exposed_series()
    used = {series[name][0].prom_exposed_name for dash in committed().values() for _, expr in queries(dash)
            for name, _ in selectors(expr) if name in series}  # a histogram is shown by any of its series
    exported = {m.prom_exposed_name for m in METRICS}
    missing = exported - used - set(INTENTIONALLY_ABSENT)
    assert not missing, f"no dashboard shows {sorted(missing)}: add a panel, or a reason to INTENTIONALLY_ABSENT"
    assert set(INTENTIONALLY_ABSENT) <= exported, "INTENTIONALLY_ABSENT names a metric the registry lacks"
    assert not set(INTENTIONALLY_ABSENT) & used, "INTENTIONALLY_ABSENT names a metric a dashboard shows"
    assert all(reason.strip() for reason in INTENTIONALLY_ABSENT.values())


def test_queries_use_only_exported_metrics_and_their_labels():
    by_name = exposed_series()
    problems = []
    for file, dash in committed().items():
        for title, expr in queries(dash):
            for name, labels in selectors(expr):
                if name == "up":  # Prometheus' own, per scrape target
                    continue
                if name in common.FOREIGN:  # another exporter's, declared with its labels in the generator
                    if unknown := labels - set(common.FOREIGN[name].labels) - SCRAPE_LABELS:
                        problems.append(f"{file} {title!r}: {name} has no label {sorted(unknown)}")
                elif name not in by_name:
                    problems.append(f"{file} {title!r}: {name} is not an exported metric")
                elif unknown := labels - set(by_name[name][1]) - SCRAPE_LABELS:
                    problems.append(f"{file} {title!r}: {name} has no label {sorted(unknown)}")
    assert not problems, "\n".join(problems)


def test_counters_are_read_through_rate_or_increase_and_gauges_never():
    # a histogram's series count observations: read like counters
    kinds = {name: Kind.COUNTER if m.kind is Kind.HISTOGRAM else m.kind for name, (m, _) in exposed_series().items()}
    kinds.update({name: m.kind for name, m in common.FOREIGN.items()})
    problems = []
    for file, dash in committed().items():
        for title, expr in queries(dash):
            for hit in re.finditer(r"(?<![\w:])([\w:]+)(?:\{|\[)", expr):
                name = hit.group(1)
                if name not in kinds:
                    continue
                in_rate = re.search(r"\b(rate|increase)\(\s*$", expr[:hit.start()]) is not None
                if kinds[name] is Kind.COUNTER and not in_rate and title not in RAW_COUNTER_PANELS:
                    problems.append(f"{file} {title!r}: counter {name} outside rate() or increase()")
                if kinds[name] is not Kind.COUNTER and in_rate:
                    problems.append(f"{file} {title!r}: {kinds[name].value} {name} inside rate() or increase()")
    assert not problems, "\n".join(problems)


def test_the_generator_refuses_rate_of_a_gauge_and_unknown_names_and_labels():
    with pytest.raises(ValueError, match="rate"):
        common.rate("hw.power")
    with pytest.raises(KeyError, match="not in the registry"):
        common.sel("hw.power.draw")
    with pytest.raises(KeyError, match="no label"):
        common.sel("hw.power", sensor="gpu")
    with pytest.raises(ValueError, match="histogram: name its series"):
        common.sel("gpuwatch.oom.forecast.error")
    with pytest.raises(ValueError, match="no bucket series"):
        common.sel("hw.power", "bucket")
    with pytest.raises(KeyError, match="no label 'le'"):
        common.sel("gpuwatch.oom.forecast.error", "count", le="0.1")
    assert common.sel("gpuwatch.oom.forecast.error", "bucket", le="0.1").startswith(
        'gpuwatch_oom_forecast_error_ratio_bucket{instance=~"$instance",gpu=~"$gpu",le="0.1"}')


# --- importable into Grafana as they are ------------------------------------------------------


@pytest.mark.parametrize("file", sorted(p.name for p in DIR.glob("*.json")))
def test_dashboard_structure(file):
    dash = committed()[file]
    assert dash["uid"] == file.removesuffix(".json") and len(dash["uid"]) <= 40
    assert dash["title"].startswith("gpuwatch / ") and dash.get("id") is None
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert "gpuwatch" in dash["tags"]

    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    node = variables["instance"]
    assert node["type"] == "query" and node["query"]["query"].startswith("label_values(")
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            query = v["query"]["query"]
            assert re.fullmatch(r"label_values\(\w+(\{[^}]*\})?, \w+\)", query), query
    # No data source uid of somebody's Grafana: every reference is the variable (or Grafana's own annotations).
    for ref in walk(dash, "datasource"):
        if isinstance(ref, dict):
            assert ref.get("uid") in ("${datasource}", "-- Grafana --"), ref

    titles = [p["title"] for p in dash["panels"] if p["type"] != "row"]
    assert len(titles) == len(set(titles)), "panel titles repeat"
    ids, cells = set(), set()
    for panel in dash["panels"]:
        assert panel["id"] not in ids, f"duplicate panel id {panel['id']}"
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "hwxy") and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        for x in range(grid["x"], grid["x"] + grid["w"]):  # panels must not overlap
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps another panel at {(x, y)}"
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat", "table")
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["fieldConfig"]["defaults"]["unit"] in UNITS, panel["title"]
        targets = panel["targets"]
        assert targets, f"{panel['title']!r} has no query"
        assert len({t["refId"] for t in targets}) == len(targets)
        for t in targets:
            assert t["refId"] and t["expr"].strip() and t["datasource"] == panel["datasource"]
            used = set(VARIABLE.findall(t["expr"])) - BUILTIN_VARIABLES
            assert used <= set(variables), f"{panel['title']!r} uses undefined variables {used - set(variables)}"
        if panel.get("repeat"):
            assert variables[panel["repeat"]]["multi"]
    if any("$gpu" in expr for _, expr in queries(dash)):
        assert variables["gpu"]["query"]["query"].startswith("label_values(gpuwatch_gpu_info")


def test_panels_that_need_a_workload_say_so():
    for d in generator.dashboards():
        for p in generator.panels(d):
            for need in {q.needs for q in p.targets} - {""}:
                assert common.NEEDS[need] in p.description, (d.build().uid, p.title)
            if (needs := [q.needs for q in p.targets]) and all(n in common.EXPORTERS for n in needs):
                assert all(common.EXPORTERS[n] in p.field_config.defaults.no_value for n in needs), p.title
