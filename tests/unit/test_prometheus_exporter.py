"""The Prometheus exporter translates snapshots using the registry and never calls probes.

Its renderer is checked against prometheus_client, the reference: the same snapshot turned
into prometheus_client metric families and rendered by the library must parse to exactly the
same series, in both exposition formats.
"""
import functools
import gzip
import math
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuwatch.agent.api import Sample
from gpuwatch.agent.runner import Runner
from gpuwatch.agent.snapshot import Snapshot
from gpuwatch.exporters.prometheus import PrometheusExporter, reference_registry, render
from gpuwatch.probes.nvml.probe import NvmlProbe
from gpuwatch.probes.nvml.replay import ReplayBackend

GPU = "GPU-8c2e6a2b-0000-1111-2222-333344445555"
FIXTURE = Path(__file__).parents[1] / "fixtures" / "nvml-h200.json"
OM_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"  # as Prometheus asks


def snap(*samples):
    return Snapshot(ts=1.0, samples=tuple(samples))


def fetch(exp, accept=None, encoding=None, method="GET", path="/metrics"):
    headers = {k: v for k, v in (("Accept", accept), ("Accept-Encoding", encoding)) if v}
    req = urllib.request.Request(f"http://127.0.0.1:{exp.port}{path}", headers=headers, method=method)
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.headers, r.read()


@pytest.fixture
def exporter():
    exp = PrometheusExporter("127.0.0.1:0")
    exp.start()
    yield exp
    exp.shutdown()


def series(families):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


@functools.lru_cache(maxsize=1)
def replay_snapshot():
    """8 GPUs x 8 processes replayed from the H200 recording, plus the agent's own series."""
    probe = NvmlProbe(functools.partial(ReplayBackend, str(FIXTURE), gpus=8, processes_per_gpu=8), xid_events=False)
    runner = Runner([probe])
    try:
        return runner.tick_once()
    finally:
        runner.shutdown()


def test_text_format_matches_prometheus_client():
    snapshot = replay_snapshot()
    ours = render(snapshot, openmetrics=False).decode()
    ref = generate_latest(reference_registry(snapshot)).decode()
    assert len(series(parse_text(ours))) > 600
    assert series(parse_text(ours)) == series(parse_text(ref))
    # Same metadata too: HELP and TYPE lines.
    meta = lambda text: sorted(line for line in text.splitlines() if line.startswith("#"))
    assert meta(ours) == meta(ref)


def test_openmetrics_matches_prometheus_client():
    snapshot = replay_snapshot()
    ours = render(snapshot, openmetrics=True).decode()
    ref = generate_openmetrics(reference_registry(snapshot)).decode()
    assert ours.endswith("# EOF\n")
    ours_fams = {f.name: (f.type, f.unit, f.documentation) for f in parse_openmetrics(ours)}
    ref_fams = {f.name: (f.type, f.unit, f.documentation) for f in parse_openmetrics(ref)}
    assert ours_fams == ref_fams
    assert series(parse_openmetrics(ours)) == series(parse_openmetrics(ref))


def test_names_units_and_gpu_label_come_from_the_registry(exporter):
    exporter.publish(snap(
        Sample("hw.temperature", 41.0, GPU, {"sensor": "gpu"}),
        Sample("hw.energy", 1234.5, GPU),
        Sample("gpuwatch.gpu.up", 1.0, GPU),
    ))
    _, body = fetch(exporter)
    text = body.decode()
    assert "# TYPE hw_temperature_celsius gauge" in text
    assert f'hw_temperature_celsius{{gpu="{GPU}",sensor="gpu"}} 41.0' in text
    assert f'hw_energy_joules_total{{gpu="{GPU}"}} 1234.5' in text
    assert re.search(r"^# TYPE hw_energy_joules_total counter$", text, re.M)
    assert f'gpuwatch_gpu_up{{gpu="{GPU}"}} 1.0' in text


def test_prometheus_accept_header_gets_openmetrics(exporter):
    exporter.publish(snap(Sample("hw.energy", 5.0, GPU)))
    headers, body = fetch(exporter, accept=OM_ACCEPT)
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert "# TYPE hw_energy_joules counter\n# UNIT hw_energy_joules joules\n" in text
    assert text.endswith("# EOF\n")


def test_hostile_label_values_keep_the_exposition_valid():
    name = 'a "b"\\c\nd\udcff(deleted)'
    s = Sample("gpuwatch.process.gpu.memory.usage", 1e9, GPU, {"pid": "42", "process": name})
    for parse, om in ((parse_text, False), (parse_openmetrics, True)):
        (got,) = [x for f in parse(render(snap(s), om).decode()) for x in f.samples]
        assert got.labels["pid"] == "42" and got.labels["process"] == 'a "b"\\c\nd\ufffd(deleted)'
        assert got.value == 1e9


def test_special_values():
    text = render(snap(Sample("hw.power", math.inf, GPU), Sample("hw.power", math.nan, "GPU-2"),
                       Sample("hw.power", -math.inf, "GPU-3")), False).decode()
    got = {s.labels["gpu"]: s.value for f in parse_text(text) for s in f.samples}
    assert got[GPU] == math.inf and math.isnan(got["GPU-2"]) and got["GPU-3"] == -math.inf


def test_unknown_metric_or_missing_label_is_skipped_not_fatal():
    text = render(snap(Sample("no.such.metric", 1.0), Sample("hw.temperature", 1.0, GPU),
                       Sample("hw.power", 300.0, GPU)), False).decode()
    assert [f.name for f in parse_text(text)] == ["hw_power_watts"]


def test_each_snapshot_is_rendered_once_per_format_and_new_snapshots_are_served(exporter):
    exporter.publish(snap(Sample("hw.power", 100.0, GPU)))
    _, first = fetch(exporter)
    _, again = fetch(exporter)
    assert first is not again and first == again and b" 100.0" in first
    headers, zipped = fetch(exporter, encoding="gzip")
    assert headers["Content-Encoding"] == "gzip" and gzip.decompress(zipped) == first
    exporter.publish(snap(Sample("hw.power", 250.0, GPU)))
    assert b" 250.0" in fetch(exporter)[1]


def test_http_methods_and_paths(exporter):
    headers, body = fetch(exporter, method="HEAD")
    assert body == b"" and int(headers["Content-Length"]) >= 0
    assert b'href="/metrics"' in fetch(exporter, path="/")[1]
    for method, path, code in (("POST", "/metrics", 405), ("DELETE", "/metrics", 405), ("GET", "/debug", 404)):
        with pytest.raises(urllib.error.HTTPError) as e:
            fetch(exporter, method=method, path=path)
        assert e.value.code == code


@settings(max_examples=300, deadline=None)
@given(process=st.text(), pid=st.text(min_size=1), value=st.floats(allow_nan=False))
def test_any_label_value_round_trips_through_both_parsers(process, pid, value):
    # Process names come from /proc and can be anything printable or not (undecodable bytes,
    # as surrogates, are covered above); the exposition must stay parseable and lossless.
    s = Sample("gpuwatch.process.gpu.memory.usage", value, GPU, {"pid": pid, "process": process})
    for parse, om in ((parse_text, False), (parse_openmetrics, True)):
        (got,) = [x for f in parse(render(snap(s), om).decode()) for x in f.samples]
        assert got.labels == {"gpu": GPU, "pid": pid, "process": process}
        assert got.value == value
