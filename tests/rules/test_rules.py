"""The Prometheus rules (dashboards/prometheus): promtool accepts them, their unit tests pass,
every alert has a runbook section and both a firing and a quiet unit test, every recorded series
is named level:metric:operations and checked by a unit test, and the rules use only metrics and
labels the agent exports (or that the rules record), so a rename in agent/metrics.py cannot
silently break them.

Two rule files, each with its unit tests beside it: gpuwatch.rules.yml (per-node alerts) and
gpuwatch.fleet.rules.yml (recording rules across nodes and the peer alert).
"""
import re
import subprocess

import pytest
from gpuwatch.agent.metrics import METRICS
from gpuwatch.probes.baseline.verdict import HealthSettings

from dashboards.generator import common
from tests.conftest import ROOT, need_binary

RULES_DIR = ROOT / "dashboards" / "prometheus"
RULE_FILES = {  # rule file -> its unit tests
    RULES_DIR / "gpuwatch.rules.yml": RULES_DIR / "gpuwatch.rules.test.yml",
    RULES_DIR / "gpuwatch.fleet.rules.yml": RULES_DIR / "gpuwatch.fleet.rules.test.yml",
}
RULES = RULES_DIR / "gpuwatch.rules.yml"
RUNBOOK = ROOT / "docs" / "alerts.md"
SEVERITIES = {"critical", "warning", "info"}
# Labels Prometheus adds to every scraped series; `up` is Prometheus's own, per target.
SCRAPE_LABELS = {"job", "instance"}


def exposed_series() -> dict:
    """Each series name of the exposition -> (its registry metric, the labels it carries): one per
    metric, three per histogram (whose _bucket carries le too)."""
    out = {}
    for m in METRICS:
        for name in m.prom_series_names:
            out[name] = (m, m.labels + (("le",) if name.endswith("_bucket") and m.kind.value == "histogram" else ()))
    return out
PROMETHEUS_METRICS = {"up"}
# Other exporters' series (node_exporter, kube-state-metrics, vLLM), with their labels: declared once,
# in dashboards/generator/common.py, which builds panels on them too.
FOREIGN = common.FOREIGN
# level:metric:operations (prometheus.io/docs/practices/rules), the metric an exported one.
RECORD_NAME = re.compile(r"^(?P<level>[a-z_]+):(?P<metric>[a-z_][a-z0-9_]*):(?P<ops>[a-z0-9_]+)$")


def load(path):
    try:
        import yaml
    except ImportError:
        pytest.fail("PyYAML is missing: pip install pyyaml (Debian: apt-get install python3-yaml)")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def rules(path=None) -> list[dict]:
    paths = [path] if path else list(RULE_FILES)
    return [rule for p in paths for group in load(p)["groups"] for rule in group["rules"]]


def alert_rules(path=None) -> list[dict]:
    return [rule for rule in rules(path) if "alert" in rule]


def recorded() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def promtool(*args: str) -> str:
    binary = need_binary("promtool")  # fails (not skips): run scripts/setup --test
    out = subprocess.run([binary, *args], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (f"promtool {' '.join(args)} exited {out.returncode}:\n"
                                 f"{out.stdout}{out.stderr}")
    return out.stdout + out.stderr


@pytest.mark.prometheus
@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(path):
    output = promtool("check", "rules", "--lint=all", "--lint-fatal", str(path))
    assert f"SUCCESS: {len(rules(path))} rules found" in output, output


@pytest.mark.prometheus
@pytest.mark.parametrize("path", RULE_FILES.values(), ids=lambda p: p.name)
def test_promtool_rule_unit_tests_pass(path):
    output = promtool("test", "rules", str(path))
    assert "SUCCESS" in output, output


def test_every_alert_has_severity_annotations_and_a_runbook_section():
    anchors = {re.sub(r"[^a-z0-9_-]", "", h.strip().lower().replace(" ", "-"))
               for h in re.findall(r"^#{2,3} (.+)$", RUNBOOK.read_text(encoding="utf-8"), re.MULTILINE)}
    problems = []
    for rule in alert_rules():
        name = rule["alert"]
        if rule.get("labels", {}).get("severity") not in SEVERITIES:
            problems.append(f"{name}: labels.severity must be one of {sorted(SEVERITIES)}")
        notes = rule.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            if not notes.get(key):
                problems.append(f"{name}: no annotations.{key}")
        if "description" in notes and "{{ $labels.gpu }}" not in notes["description"] \
                and "gpu" in _labels_of(rule["expr"]):
            problems.append(f"{name}: a per-GPU alert whose description does not name {{{{ $labels.gpu }}}}")
        anchor = name.lower()
        if notes.get("runbook_url") != f"docs/alerts.md#{anchor}":
            problems.append(f"{name}: runbook_url should be docs/alerts.md#{anchor}, is {notes.get('runbook_url')!r}")
        if anchor not in anchors:
            problems.append(f"{name}: docs/alerts.md has no section '## {name}'")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_every_alert_has_a_firing_and_a_quiet_unit_test(path):
    suite = load(RULE_FILES[path])
    assert suite["rule_files"] == [path.name]
    fires, quiet = set(), set()
    for case in suite["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alert_rules(path)}
    assert names - fires == set(), f"alerts no unit test sees firing: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts no unit test sees quiet: {sorted(names - quiet)}"
    assert (fires | quiet) - names == set(), f"unit tests of unknown alerts: {sorted((fires | quiet) - names)}"


def test_recording_rules_are_named_by_level_metric_operations_and_unit_tested():
    exposed = {m.prom_exposed_name for m in METRICS}
    problems = []
    for name in sorted(recorded()):
        m = RECORD_NAME.match(name)
        if not m:
            problems.append(f"{name}: not level:metric:operations")
        elif m["metric"] not in exposed:
            problems.append(f"{name}: {m['metric']} is not an exported metric")
    checked = {name for tests in RULE_FILES.values() for case in load(tests)["tests"]
               for check in case.get("promql_expr_test", []) for name, _ in selectors(check["expr"])}
    untested = recorded() - checked
    assert not untested, f"recording rules no promql_expr_test queries: {sorted(untested)}"
    assert not problems, "\n".join(problems)


def test_the_sku_floor_is_the_health_detectors():
    (rule,) = [r for r in alert_rules(RULES) if r["alert"] == "GpuBelowSku"]
    floor = float(re.search(r"<\s*([0-9.]+)\s*$", rule["expr"].strip()).group(1))
    assert floor == HealthSettings.sku_floor
    assert f"{floor:.0%}" in rule["annotations"]["description"]


# --- PromQL selectors ------------------------------------------------------------------------

_KEYWORDS = {"and", "or", "unless", "on", "ignoring", "group_left", "group_right", "by", "without",
             "offset", "bool", "inf", "nan", "atan2"}
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                 "bottomk", "topk", "quantile"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_TOKEN = re.compile(r"(?<![\w.:])(?P<name>[A-Za-z_:][\w:]*)?\s*(?P<matchers>\{[^}]*\})?")


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) for each vector selector in a PromQL expression.

    Not a PromQL parser, but enough for rule files: strings, ranges, grouping label lists,
    keywords, aggregations and function calls are not selectors.
    """
    expr = _STRING.sub('""', expr)
    expr = re.sub(r"\b(on|ignoring|by|without|group_left|group_right)\s*\([^)]*\)", r"\1", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    found = []
    for m in _TOKEN.finditer(expr):
        name, matchers = m.group("name"), m.group("matchers")
        if not name and not matchers:
            continue
        if name and not matchers and (name in _KEYWORDS or name in _AGGREGATIONS
                                      or expr[m.end():].lstrip().startswith("(")):
            continue
        labels = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers or ""))
        if not name:  # {__name__="..."}: not used here, and not checkable without a parser
            raise AssertionError(f"selector without a metric name in {expr!r}")
        found.append((name, labels))
    return found


def _labels_of(expr: str) -> set[str]:
    by_name = exposed_series()
    return {label for name, _ in selectors(expr) if name in by_name for label in by_name[name][1]}


def _queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every rule expression and every query in an annotation template."""
    out = []
    for rule in rules():
        name = rule.get("alert") or rule.get("record")
        out.append((f"{name} expr", rule["expr"]))
        for key, text in rule.get("annotations", {}).items():
            for query in re.findall(r"printf\s+`([^`]*)`", text):
                out.append((f"{name} annotations.{key}", query.replace("%s", "x")))
    return out


def test_selector_extraction():
    expr = ('max without (reason) (rate(foo_total{a="b,c}", b=~"x|y"}[5m] offset 1m)) >= on(gpu) '
            'group_left(name) (bar_celsius - 5) or up{job=~".*gpuwatch.*"} == 0 and '
            'max_over_time((baz unless present_over_time(baz[5m] offset 1m))[10m:1m]) > 1e3')
    assert selectors(expr) == [("foo_total", {"a", "b"}), ("bar_celsius", set()),
                               ("up", {"job"}), ("baz", set()), ("baz", set())]


def test_rules_use_only_exported_metrics_and_labels():
    exposed = exposed_series()
    problems, used = [], set()
    for where, query in _queries():
        for name, labels in selectors(query):
            if name in PROMETHEUS_METRICS or name in recorded():
                continue
            if name in FOREIGN:
                if unknown := labels - set(FOREIGN[name].labels) - SCRAPE_LABELS:
                    problems.append(f"{where}: {name} has no label {sorted(unknown)}; its labels: {FOREIGN[name].labels}")
                continue
            if name not in exposed:
                problems.append(f"{where}: {name} is not an exported metric (agent/metrics.py, docs/metrics.md)")
                continue
            used.add(name)
            unknown = labels - set(exposed[name][1]) - SCRAPE_LABELS
            if unknown:
                problems.append(f"{where}: {name} has no label {sorted(unknown)}; its labels: {exposed[name][1]}")
    assert not problems, "\n".join(problems)
    # The extraction must have seen the rules' metrics, or this test checks nothing.
    assert {"gpuwatch_gpu_up", "gpuwatch_gpu_xid_total", "hw_temperature_limit_celsius",
            "hw_errors_total", "gpuwatch_gpu_clock_event_active"} <= used, sorted(used)
