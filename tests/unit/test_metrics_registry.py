"""The metric registry (agent/metrics.py) and its generated reference (docs/metrics.md)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gpuwatch.agent.metrics import METRICS, Kind, Metric
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "scripts" / "gen_metrics_doc.py"

PROM_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# {flop}/s and {flop}/{cycle}: counts of operations (UCUM annotations), unscaled.
BASE_UNITS = {"By", "By/s", "s", "W", "J", "Cel", "Hz", "1", "", "{flop}/s", "{flop}/{cycle}"}
# Scaled units have no place in a name: values are converted to base units at the probe.
SCALED = re.compile(r"(^|[._])(ms|us|ns|milli\w*|micro\w*|nano\w*|[kmg]i?b|kilo\w*|mega\w*|giga\w*|"
                    r"mhz|ghz|mw|mj|percent|pct|minutes?|hours?|kelvin|fahrenheit)($|[._])")
# Unbounded or sensitive values must not become label names (pointer addresses, command lines).
FORBIDDEN_LABEL = re.compile(r"(^|_)(ptr|pointer|addr|address|cmdline|cmd|command|argv|args)($|_)")


def test_doc_is_up_to_date():
    out = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_check_reports_a_stale_doc_with_a_diff(tmp_path):
    stale = tmp_path / "metrics.md"
    stale.write_text((ROOT / "docs" / "metrics.md").read_text().replace("hw_power_watts", "hw_power_milliwatts"))
    out = subprocess.run([sys.executable, str(GEN), "--check", "--output", str(stale)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 1
    assert "-| `hw_power_milliwatts`" in out.stdout and "+| `hw_power_watts`" in out.stdout
    assert "stale" in out.stderr


def test_every_metric_is_in_the_doc_once():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for m in METRICS:
        assert doc.count(f"| `{m.prom_exposed_name}` |") == 1, m.name


@pytest.mark.parametrize("m", METRICS, ids=lambda m: m.name)
def test_names(m: Metric):
    assert PROM_NAME.match(m.prom_name), m.prom_name
    assert m.name.startswith(("hw.", "gpuwatch.")), "OTel names: hw.* semantic conventions or our own gpuwatch.*"
    assert m.help.strip()
    if m.kind is Kind.COUNTER:
        assert m.prom_exposed_name.endswith("_total") and not m.prom_name.endswith("_total")
    else:
        assert not m.prom_exposed_name.endswith("_total")
    if m.kind is Kind.INFO:
        assert m.prom_name.endswith("_info")
    if m.kind is Kind.HISTOGRAM:
        assert m.buckets and "le" not in m.labels
    else:
        assert not m.buckets


@pytest.mark.parametrize("m", METRICS, ids=lambda m: m.name)
def test_base_units_only(m: Metric):
    assert m.unit in BASE_UNITS
    assert not SCALED.search(m.name), f"{m.name} names a scaled unit"


@pytest.mark.parametrize("m", METRICS, ids=lambda m: m.name)
def test_labels(m: Metric):
    assert len(set(m.labels)) == len(m.labels), "duplicate label"
    for label in m.labels:
        assert LABEL_NAME.match(label) and not label.startswith("__"), label
        assert not FORBIDDEN_LABEL.search(label), f"label {label!r} would carry pointers or command lines"
    if "gpu" in m.labels:
        assert m.labels[0] == "gpu", "per-GPU metrics have gpu first"
    if m.name.startswith("hw.") or ".gpu." in m.name + ".":
        assert m.per_gpu, f"{m.name} is about a GPU but has no leading gpu label"


def test_names_are_unique():
    for key in (lambda m: m.name, lambda m: m.prom_name, lambda m: m.prom_exposed_name):
        names = [key(m) for m in METRICS]
        assert len(names) == len(set(names))


def _exposition() -> str:
    """Every registry metric through the official Prometheus client, one sample each."""

    class Everything:
        def collect(self):
            for m in METRICS:
                values = [f"v{i}" for i in range(len(m.labels))]
                if m.kind is Kind.INFO:
                    # The client appends `_info` itself.
                    fam = InfoMetricFamily(m.prom_name.removesuffix("_info"), m.help)
                    fam.add_metric([], dict(zip(m.labels, values)))
                elif m.kind is Kind.HISTOGRAM:
                    fam = HistogramMetricFamily(m.prom_name, m.help, labels=m.labels)
                    fam.add_metric(values, [(str(b), 0.0) for b in m.buckets] + [("+Inf", 1.0)], 1.0)
                else:
                    cls = CounterMetricFamily if m.kind is Kind.COUNTER else GaugeMetricFamily
                    fam = cls(m.prom_name, m.help, labels=m.labels)
                    fam.add_metric(values, 1.0)
                yield fam

    reg = CollectorRegistry()
    reg.register(Everything())
    return generate_latest(reg).decode()


def test_exposed_names_match_the_registry():
    text = _exposition()
    exposed = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert exposed == {name for m in METRICS for name in m.prom_series_names}


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (scripts/setup --test installs it)")
def test_promtool_lint_is_clean():
    out = subprocess.run(["promtool", "check", "metrics"], input=_exposition(), capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr
