"""The Prometheus exporter translates snapshots using the registry and never calls probes.

Its renderer is checked against prometheus_client, the reference: the same snapshot turned
into prometheus_client metric families and rendered by the library must parse to exactly the
same series, in both exposition formats.
"""
import base64
import contextlib
import functools
import gzip
import io
import logging
import math
import re
import socket
import ssl
import sys
import threading
import time
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

from gpuwatch.agent import metrics as registry
from gpuwatch.agent.api import Sample
from gpuwatch.agent.runner import Runner
from gpuwatch.agent.snapshot import EMPTY, Snapshot
from gpuwatch.agent.api import printable
from gpuwatch.exporters.prometheus import (OPENMETRICS, TEXT, PrometheusExporter, _escape_value, _Family, _Guard,
                                           _MetricsApp, _number, _QuietHandler, _Server, LOOPBACK, peer_of, render)
from gpuwatch.exporters.webconfig import load_web_config
from gpuwatch.probes.nvml.probe import NvmlProbe
from gpuwatch.probes.nvml.replay import ReplayBackend
from tests.conftest import bcrypt_hash
from tests.prometheus_reference import reference_registry

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
        assert got.labels["pid"] == "42" and got.labels["process"] == 'a "b"\\c?d\ufffd(deleted)'
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
    # as surrogates, are covered above); the exposition must stay parseable, lossless for
    # printable text, and carry no control: C0, C1 and bidi controls come back as "?".
    s = Sample("gpuwatch.process.gpu.memory.usage", value, GPU, {"pid": pid, "process": process})
    for parse, om in ((parse_text, False), (parse_openmetrics, True)):
        (got,) = [x for f in parse(render(snap(s), om).decode()) for x in f.samples]
        assert got.labels == {"gpu": GPU, "pid": printable(pid), "process": printable(process)}
        assert all(c.isprintable() for v in got.labels.values() for c in v)
        assert got.value == value


# -- exact exposition text, straight from the renderer ----------------------------------------------

def test_family_headers_for_each_kind():
    energy = _Family.of(registry.REGISTRY["hw.energy"])  # a counter with a unit
    assert energy.metric is registry.REGISTRY["hw.energy"]
    assert energy.sample_name == "hw_energy_joules_total"
    assert energy.text_header == ("# HELP hw_energy_joules_total Energy consumed since the driver was loaded.\n"
                                  "# TYPE hw_energy_joules_total counter\n")
    assert energy.om_header == ("# HELP hw_energy_joules Energy consumed since the driver was loaded.\n"
                                "# TYPE hw_energy_joules counter\n# UNIT hw_energy_joules joules\n")
    power = _Family.of(registry.REGISTRY["hw.power"])  # a gauge with a unit
    assert power.sample_name == "hw_power_watts"
    assert power.text_header == "# HELP hw_power_watts Power draw.\n# TYPE hw_power_watts gauge\n"
    assert power.om_header == ("# HELP hw_power_watts Power draw.\n# TYPE hw_power_watts gauge\n"
                               "# UNIT hw_power_watts watts\n")
    errors = _Family.of(registry.REGISTRY["gpuwatch.probe.errors"])  # a counter without a unit: no UNIT line
    assert errors.sample_name == "gpuwatch_probe_errors_total"
    assert errors.text_header == ("# HELP gpuwatch_probe_errors_total Collections that raised an error.\n"
                                  "# TYPE gpuwatch_probe_errors_total counter\n")
    assert errors.om_header == ("# HELP gpuwatch_probe_errors Collections that raised an error.\n"
                                "# TYPE gpuwatch_probe_errors counter\n")
    up = _Family.of(registry.REGISTRY["gpuwatch.gpu.up"])  # a gauge without a unit
    assert up.sample_name == "gpuwatch_gpu_up"
    assert up.om_header.splitlines()[1:] == ["# TYPE gpuwatch_gpu_up gauge"]
    # Info: a gauge named *_info in text 0.0.4; in OpenMetrics the family drops the _info, its samples keep it.
    build = _Family.of(registry.REGISTRY["gpuwatch.build"])
    assert build.sample_name == "gpuwatch_build_info"
    assert build.text_header == ("# HELP gpuwatch_build_info gpuwatch build: version and Python.\n"
                                 "# TYPE gpuwatch_build_info gauge\n")
    assert build.om_header == "# HELP gpuwatch_build gpuwatch build: version and Python.\n# TYPE gpuwatch_build info\n"


def test_family_help_escaping_and_no_unit_for_info():
    m = registry.Metric("x.size", "By", registry.Kind.GAUGE, 'back\\slash\nnew "quoted"')
    fam = _Family.of(m)
    # Text 0.0.4 escapes backslash and newline in HELP; OpenMetrics quotes too.
    assert fam.text_header == '# HELP x_size_bytes back\\\\slash\\nnew "quoted"\n# TYPE x_size_bytes gauge\n'
    assert fam.om_header == ('# HELP x_size_bytes back\\\\slash\\nnew \\"quoted\\"\n# TYPE x_size_bytes gauge\n'
                             "# UNIT x_size_bytes bytes\n")
    # OpenMetrics allows no UNIT on an info family, even when the registry gives one.
    info = _Family.of(registry.Metric("x.thing", "s", registry.Kind.INFO, "h", ("a",)))
    assert info.om_header == "# HELP x_thing_seconds h\n# TYPE x_thing_seconds info\n"
    assert info.sample_name == "x_thing_seconds_info"


MIXED = snap(
    Sample("hw.temperature", 41.0, "GPU-a", {"sensor": "gpu"}),
    Sample("gpuwatch.cupti.sampler.invalid_lines", 3.0),
    Sample("gpuwatch.build", 1.0, "", {"python": "3.11", "version": "1.2"}),
    Sample("hw.temperature", 85.5, "GPU-b", {"sensor": "memory", "unused": "x"}),
    Sample("gpuwatch.probe.errors", 2.0, "", {"probe": "nvml"}),
    Sample("hw.energy", 1234.5, "GPU-a"),
)
MIXED_SAMPLES = (
    'gpuwatch_build_info{version="1.2",python="3.11"} 1.0\n',  # the registry's label order, not the sample's
    'gpuwatch_probe_errors_total{probe="nvml"} 2.0\n',
    'hw_temperature_celsius{gpu="GPU-a",sensor="gpu"} 41.0\n',  # gpu from the resource, first
    'hw_temperature_celsius{gpu="GPU-b",sensor="memory"} 85.5\n',  # labels the registry does not name: dropped
    'hw_energy_joules_total{gpu="GPU-a"} 1234.5\n',
    "gpuwatch_cupti_sampler_invalid_lines_total 3.0\n",  # no labels: no braces
)


def test_text_exposition_is_exact_in_registry_order():
    assert render(MIXED, openmetrics=False).decode() == (
        "# HELP gpuwatch_build_info gpuwatch build: version and Python.\n"
        "# TYPE gpuwatch_build_info gauge\n"
        + MIXED_SAMPLES[0]
        + "# HELP gpuwatch_probe_errors_total Collections that raised an error.\n"
        "# TYPE gpuwatch_probe_errors_total counter\n"
        + MIXED_SAMPLES[1]
        + "# HELP hw_temperature_celsius Temperature by sensor (gpu core or memory).\n"
        "# TYPE hw_temperature_celsius gauge\n"
        + MIXED_SAMPLES[2] + MIXED_SAMPLES[3]
        + "# HELP hw_energy_joules_total Energy consumed since the driver was loaded.\n"
        "# TYPE hw_energy_joules_total counter\n"
        + MIXED_SAMPLES[4]
        + "# HELP gpuwatch_cupti_sampler_invalid_lines_total Lines the CUPTI PM sampling child printed that are "
        "not its JSON protocol (ignored).\n"
        "# TYPE gpuwatch_cupti_sampler_invalid_lines_total counter\n"
        + MIXED_SAMPLES[5])


def test_openmetrics_exposition_is_exact_and_ends_with_eof():
    text = render(MIXED, openmetrics=True).decode()
    assert text.endswith("gpuwatch_cupti_sampler_invalid_lines_total 3.0\n# EOF\n")
    assert text == "".join(
        _Family.of(registry.REGISTRY[n]).om_header + "".join(lines) for n, lines in (
            ("gpuwatch.build", MIXED_SAMPLES[0:1]), ("gpuwatch.probe.errors", MIXED_SAMPLES[1:2]),
            ("hw.temperature", MIXED_SAMPLES[2:4]), ("hw.energy", MIXED_SAMPLES[4:5]),
            ("gpuwatch.cupti.sampler.invalid_lines", MIXED_SAMPLES[5:6]))) + "# EOF\n"
    assert ("# TYPE hw_temperature_celsius gauge\n# UNIT hw_temperature_celsius celsius\n"
            'hw_temperature_celsius{gpu="GPU-a",sensor="gpu"} 41.0\n') in text


def _histogram_snapshot():
    """Forecast-error histograms as the OomRecorder keeps them: two GPUs, both sides of the forecast."""
    out = []
    for gpu, came, errors in (("GPU-a", "late", (0.05, 0.05, 0.3, 7.0)), ("GPU-a", "early", (0.12,)),
                              ("GPU-b", "late", ())):
        h = registry.Histogram("gpuwatch.oom.forecast.error", 100.0)
        for e in errors:
            h.observe(e)
        out.append(Sample("gpuwatch.oom.forecast.error", float(len(errors)), gpu, {"came": came}, 200.0, h.value()))
    return snap(*out, Sample("hw.power", 3.0, "GPU-a"))


def test_histograms_render_as_prometheus_client_renders_them():
    snapshot = _histogram_snapshot()
    for ours, ref, parse in ((render(snapshot, False), generate_latest(reference_registry(snapshot)), parse_text),
                             (render(snapshot, True), generate_openmetrics(reference_registry(snapshot)),
                              parse_openmetrics)):
        assert series(parse(ours.decode())) == series(parse(ref.decode()))
        fams = {f.name: (f.type, f.unit) for f in parse(ours.decode())}
        assert fams["gpuwatch_oom_forecast_error_ratio"][0] == "histogram"
    text = render(snapshot, False).decode()
    assert "# TYPE gpuwatch_oom_forecast_error_ratio histogram\n" in text
    lines = [line for line in text.splitlines() if 'gpu="GPU-a",came="late"' in line]
    assert lines == [  # cumulative; an observation on a bound is in that bound's bucket (le)
        'gpuwatch_oom_forecast_error_ratio_bucket{gpu="GPU-a",came="late",le="0.05"} 2',
        'gpuwatch_oom_forecast_error_ratio_bucket{gpu="GPU-a",came="late",le="0.1"} 2',
        'gpuwatch_oom_forecast_error_ratio_bucket{gpu="GPU-a",came="late",le="0.2"} 2',
        'gpuwatch_oom_forecast_error_ratio_bucket{gpu="GPU-a",came="late",le="0.5"} 3',
        'gpuwatch_oom_forecast_error_ratio_bucket{gpu="GPU-a",came="late",le="1.0"} 3',
        'gpuwatch_oom_forecast_error_ratio_bucket{gpu="GPU-a",came="late",le="2.0"} 3',
        'gpuwatch_oom_forecast_error_ratio_bucket{gpu="GPU-a",came="late",le="+Inf"} 4',
        'gpuwatch_oom_forecast_error_ratio_sum{gpu="GPU-a",came="late"} 7.4',
        'gpuwatch_oom_forecast_error_ratio_count{gpu="GPU-a",came="late"} 4']
    om = render(snapshot, True).decode()
    assert ("# TYPE gpuwatch_oom_forecast_error_ratio histogram\n"
            "# UNIT gpuwatch_oom_forecast_error_ratio ratio\n") in om
    assert 'gpuwatch_oom_forecast_error_ratio_count{gpu="GPU-b",came="late"} 0\n' in om


def test_a_histogram_sample_without_its_state_is_skipped():
    bad = registry.Histogram("gpuwatch.oom.forecast.error", 0.0).value()
    short = type(bad)(bad.counts[:-1], 0.0, 0.0, 0.0, 0.0)  # not the registry's buckets
    text = render(snap(Sample("gpuwatch.oom.forecast.error", 1.0, GPU, {"came": "late"}),
                       Sample("gpuwatch.oom.forecast.error", 1.0, GPU, {"came": "early"}, histogram=short),
                       Sample("hw.power", 3.0, GPU)), False).decode()
    assert "forecast" not in text and "hw_power_watts" in text


def test_histogram_counting():
    h = registry.Histogram("gpuwatch.oom.forecast.error", 5.0)
    assert h.value() == registry.HistogramValue((0,) * 7, 0.0, float("inf"), float("-inf"), 5.0)
    for v in (0.0, 0.05, 0.0500001, 2.0, 2.5):
        h.observe(v)
    v = h.value()
    assert v.counts == (2, 1, 0, 0, 0, 1, 1) and v.count == 5
    assert (v.sum, v.min, v.max, v.start) == (pytest.approx(4.6000001), 0.0, 2.5, 5.0)
    with pytest.raises(ValueError, match="is a gauge, not a histogram"):
        registry.Histogram("hw.power", 0.0)


def test_empty_snapshot():
    assert render(snap(), openmetrics=False) == b""
    assert render(snap(), openmetrics=True) == b"# EOF\n"


def test_skipped_samples_are_logged_at_debug_and_their_family_left_out(caplog):
    caplog.set_level(logging.DEBUG, logger="gpuwatch.prometheus")
    text = render(snap(Sample("no.such.metric", 1.0), Sample("hw.temperature", 1.0, GPU),
                       Sample("hw.power", 300.0, GPU), Sample("no.such.metric", 2.0)), False).decode()
    assert text == f'# HELP hw_power_watts Power draw.\n# TYPE hw_power_watts gauge\nhw_power_watts{{gpu="{GPU}"}} 300.0\n'
    # A sample without its labels costs only itself, not the samples of its metric after it.
    text = render(snap(Sample("hw.temperature", 1.0, GPU), Sample("hw.temperature", 2.0, GPU, {"sensor": "gpu"})),
                  False).decode()
    assert text.endswith(f'\nhw_temperature_celsius{{gpu="{GPU}",sensor="gpu"}} 2.0\n') and text.count("} ") == 1
    caplog.clear()
    render(snap(Sample("no.such.metric", 1.0), Sample("hw.temperature", 1.0, GPU),
                Sample("hw.power", 300.0, GPU), Sample("no.such.metric", 2.0)), False)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "samples not exported (not in the registry or wrong labels): "
                        "[\"hw.temperature (missing label 'sensor')\", 'no.such.metric']")]
    caplog.clear()
    render(snap(Sample("hw.power", 300.0, GPU)), True)
    assert caplog.records == []  # nothing skipped, nothing logged


def test_label_value_escaping():
    assert _escape_value("plain-ascii 1") == "plain-ascii 1"
    assert _escape_value("\\") == "\\\\"
    assert _escape_value('"') == '\\"'
    assert _escape_value("\n") == "?"  # no control in a label, escaped or not
    assert _escape_value('a\\b"c\nd') == 'a\\\\b\\"c?d'
    assert _escape_value("w\u202egnp.exe\x9b[1m") == "w?gnp.exe?[1m"  # bidi RLO, C1 CSI
    assert _escape_value("\udce2\udc80\udcae") == "?"  # RLO's bytes from /proc, as surrogate escapes
    assert _escape_value("ünïcödé ✓") == "ünïcödé ✓"  # valid non-ASCII stays as it is
    assert _escape_value("x\udcff\udcfe") == "x\ufffd\ufffd"  # undecodable bytes from /proc
    assert _escape_value("é\udcff") == "é\ufffd"
    assert _escape_value("a\ud800b") == "a?b"  # a lone high surrogate: not a byte, replaced by "?"
    assert _escape_value('\udcff"') == '\ufffd\\"'  # replaced, then escaped


def test_number_formatting():
    assert [_number(v) for v in (math.nan, math.inf, -math.inf, 1.0, 3, 0.5, 1e-7, -2.0, 0)] == [
        "NaN", "+Inf", "-Inf", "1.0", "3.0", "0.5", "1e-07", "-2.0", "0.0"]


# -- the WSGI app, called directly ---------------------------------------------------------------------

def wsgi(app, method="GET", path="/metrics", accept=None, encoding=None, **extra):
    """(status, headers, body) of one call of a WSGI app."""
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, **extra}
    if accept:
        environ["HTTP_ACCEPT"] = accept
    if encoding:
        environ["HTTP_ACCEPT_ENCODING"] = encoding
    got = []
    body = b"".join(app(environ, lambda status, headers, exc_info=None: got.append((status, headers, exc_info))))
    ((status, headers, exc_info),) = got
    assert exc_info is None
    return status, headers, body


def test_content_types():
    assert TEXT == "text/plain; version=0.0.4; charset=utf-8"
    assert OPENMETRICS == "application/openmetrics-text; version=1.0.0; charset=utf-8"


def test_metrics_app_answers_exactly():
    app = _MetricsApp()
    assert app.snapshot is EMPTY and wsgi(app) == ("200 OK", [("Content-Type", TEXT), ("Content-Length", "0")], b"")
    app.snapshot = MIXED
    text, om = render(MIXED, False), render(MIXED, True)
    assert wsgi(app) == ("200 OK", [("Content-Type", TEXT), ("Content-Length", str(len(text)))], text)
    assert wsgi(app, accept=OM_ACCEPT) == (
        "200 OK", [("Content-Type", OPENMETRICS), ("Content-Length", str(len(om)))], om)
    assert wsgi(app, method="HEAD", accept=OM_ACCEPT) == (
        "200 OK", [("Content-Type", OPENMETRICS), ("Content-Length", str(len(om)))], b"")
    status, headers, zipped = wsgi(app, encoding="gzip, deflate")
    assert gzip.decompress(zipped) == text and zipped[8] == 4  # gzip's XFL byte: 4 is "fastest" (level 1)
    assert (status, headers) == ("200 OK", [("Content-Type", TEXT), ("Content-Length", str(len(zipped))),
                                            ("Content-Encoding", "gzip")])
    assert wsgi(app, path="/") == ("200 OK", [("Content-Type", "text/html; charset=utf-8")],
                                   b'<html><head><title>gpuwatch</title></head><body><h1>gpuwatch</h1>'
                                   b'<p><a href="/metrics">Metrics</a></p></body></html>\n')
    for path in ("/debug", "/metrics/", ""):
        assert wsgi(app, path=path) == ("404 Not Found", [("Content-Type", "text/plain")],
                                        b"not found: metrics are at /metrics\n")
    for method in ("POST", "PUT", "get", ""):
        assert wsgi(app, method=method) == (
            "405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Type", "text/plain")],
            b"method not allowed: use GET or HEAD\n")


def test_metrics_app_caches_per_snapshot_and_format():
    app = _MetricsApp()
    a, b = snap(Sample("hw.power", 100.0, GPU)), snap(Sample("hw.power", 250.0, GPU))
    app.snapshot = a
    text = app.body(openmetrics=False, compress=False)
    assert app.body(False, False) is text  # cached bytes, not a second rendering
    om = app.body(True, False)
    assert om == render(a, True) and app.body(True, False) is om
    assert app._cache == {(False, False): text, (True, False): om} and app._cached_for is a
    app.snapshot = b  # a new snapshot drops what was cached for the old one
    assert app.body(False, False) == render(b, False)
    assert app._cache == {(False, False): render(b, False)} and app._cached_for is b
    zipped = app.body(False, True)
    assert gzip.decompress(zipped) == render(b, False) and app.body(False, True) is zipped


def write_web_config(tmp_path, extra=""):
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n"
                    "http_server_config:\n  headers:\n    X-Frame-Options: deny\n" + extra)
    return load_web_config(str(path))


def basic(user_password):
    return "Basic " + base64.b64encode(user_password.encode()).decode()


def test_guard_asks_for_auth_and_adds_headers_to_every_answer(tmp_path):
    app = _MetricsApp()
    app.snapshot = MIXED
    guard = _Guard(app, write_web_config(tmp_path))
    text = render(MIXED, False)
    unauthorized = ("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                         ("WWW-Authenticate", 'Basic realm="gpuwatch"'), ("X-Frame-Options", "deny")],
                    b"Unauthorized\n")
    assert wsgi(guard) == unauthorized
    assert wsgi(guard, HTTP_AUTHORIZATION=basic("prometheus:wrong")) == unauthorized
    assert wsgi(guard, path="/", HTTP_AUTHORIZATION=basic("nobody:s3cret")) == unauthorized
    assert wsgi(guard, HTTP_AUTHORIZATION=basic("prometheus:s3cret")) == (
        "200 OK", [("Content-Type", TEXT), ("Content-Length", str(len(text))), ("X-Frame-Options", "deny")], text)
    assert wsgi(guard, path="/nope", HTTP_AUTHORIZATION=basic("prometheus:s3cret")) == (
        "404 Not Found", [("Content-Type", "text/plain"), ("X-Frame-Options", "deny")],
        b"not found: metrics are at /metrics\n")


def test_guard_without_auth_only_adds_headers_and_passes_exc_info(tmp_path):
    path = tmp_path / "headers.yml"
    path.write_text("http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n")
    web = load_web_config(str(path))
    assert web.auth is None
    app = _MetricsApp()
    assert wsgi(_Guard(app, web), path="/missing") == (
        "404 Not Found", [("Content-Type", "text/plain"), ("X-Content-Type-Options", "nosniff")],
        b"not found: metrics are at /metrics\n")
    # An app that reports an error with exc_info (PEP 3333) gets it through to the server.
    def failing(environ, start_response):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            start_response("500 Internal Server Error", [], sys.exc_info())
        return [b""]
    got = []
    _Guard(failing, web)({}, lambda status, headers, exc_info=None: got.append((status, headers, exc_info)))
    ((status, headers, exc_info),) = got
    assert (status, headers) == ("500 Internal Server Error", [("X-Content-Type-Options", "nosniff")])
    assert exc_info[0] is RuntimeError and str(exc_info[1]) == "boom"


# -- the HTTP server: requests refused before the app, slow clients, errors, start and stop -----------

def raw(exp, data: bytes, host="127.0.0.1") -> tuple[str, list, bytes]:
    """Send bytes, read to the close: (status line, headers but Server and Date, body)."""
    with socket.create_connection((host, exp.port), timeout=5) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = [tuple(line.split(": ", 1)) for line in lines]
    assert sorted(k for k, _ in headers if k in ("Server", "Date")) == ["Date", "Server"]
    return status, [h for h in headers if h[0] not in ("Server", "Date")], body


def refused(body_length: int):
    """The headers of a refusal: the connection closed, a plain-text body of that length."""
    return [("Connection", "close"), ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(body_length))]


def test_requests_refused_before_the_app_get_a_status_line_and_a_plain_body(exporter):
    # An unparsable request line: the standard library would answer HTTP/0.9 style, without a status line.
    assert raw(exporter, b"GARBAGE\r\n\r\n") == (
        "HTTP/1.0 400 Bad Request", refused(16), b"400 Bad Request\n")
    assert raw(exporter, b"GET /metrics HTTP/2.0\r\n\r\n") == (
        "HTTP/1.0 505 HTTP Version Not Supported", refused(31), b"505 HTTP Version Not Supported\n")
    assert raw(exporter, b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\n\r\n") == (
        "HTTP/1.0 414 Request-URI Too Long", refused(25), b"414 Request-URI Too Long\n")
    many = b"".join(b"X-%d: y\r\n" % i for i in range(101))
    assert raw(exporter, b"GET /metrics HTTP/1.1\r\n" + many + b"\r\n") == (
        "HTTP/1.0 431 Request Header Fields Too Large", refused(36), b"431 Request Header Fields Too Large\n")
    # HEAD: the same status and headers, no body.
    assert raw(exporter, b"HEAD /metrics HTTP/1.1\r\n" + many + b"\r\n") == (
        "HTTP/1.0 431 Request Header Fields Too Large", refused(36), b"")


def test_error_code_without_a_standard_reason():
    # No request the standard library parses leads here; the handler is called without a connection.
    h = object.__new__(_QuietHandler)
    h.wfile, h.requestline, h.request_version, h.command, h.close_connection = io.BytesIO(), "", "HTTP/1.1", "GET", False
    h.send_error(599)
    head, _, body = h.wfile.getvalue().partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.0 599 Error" and body == b"599 Error\n"
    assert b"\r\nContent-Length: 10" in head and h.close_connection is True


def test_a_client_slower_than_the_header_timeout_is_dropped(exporter):
    exporter._server.header_timeout = 0.3
    with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as s:
        t = time.monotonic()
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        time.sleep(0.1)
        # Unfinished connections are read by the server's one thread: none has a thread of its own.
        assert not [th for th in threading.enumerate() if th.name == "prometheus-request"]
        assert s.recv(100) == b""  # dropped without an answer
        assert 0.25 < time.monotonic() - t < 2
    # One that finishes its request in time is answered.
    exporter.publish(snap(Sample("hw.power", 100.0, GPU)))
    assert fetch(exporter)[1].endswith(f'hw_power_watts{{gpu="{GPU}"}} 100.0\n'.encode())
    assert exporter._server.stats()["timeout"] == 1 and exporter._server.stats()["served"] >= 1


def test_peers_are_addresses_ipv6_prefixes_and_all_of_loopback():
    assert {peer_of(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1")} == {LOOPBACK}
    assert peer_of("192.0.2.7") == peer_of("::ffff:192.0.2.7") == "192.0.2.7"
    assert peer_of("2001:db8:1:2:3:4:5:6") == peer_of("2001:db8:1:2::9") == "2001:db8:1:2::/64"
    assert peer_of("2001:db8:1:3::1") != peer_of("2001:db8:1:2::1")


def test_unfinished_connections_evict_their_own_peers_oldest_first(caplog):
    # Remote peers cannot be made on loopback: the server admits one end of socket pairs under
    # made-up addresses, as its accept loop would.
    server = _Server(("127.0.0.1", 0), _QuietHandler)
    server.max_unfinished, server.max_unfinished_per_peer = 7, 2
    pairs = []

    def admit(host):
        ours, theirs = socket.socketpair()
        pairs.append(theirs)
        server._admit(ours, (host, 40000), tls=False)
        return theirs

    def evicted(sock) -> bool:
        sock.setblocking(False)
        try:
            return sock.recv(1) == b""
        except BlockingIOError:
            return False

    try:
        a1, a2, a3 = admit("192.0.2.1"), admit("192.0.2.1"), admit("192.0.2.1")
        assert (evicted(a1), evicted(a2), evicted(a3)) == (True, False, False)  # a peer's third evicts its first
        b = [admit("192.0.2.2") for _ in range(2)]
        local = [admit("127.0.0.1") for _ in range(3)]  # loopback shares the whole pool: now full (7)
        newest = admit("127.0.0.1")
        # The peer holding the most (loopback, 3) gives up its oldest; the others keep theirs.
        assert evicted(local[0]) and not any(evicted(s) for s in (a2, a3, *b, *local[1:], newest))
        assert server.stats()["evicted"] == 2
        assert sum("had not sent their request" in r.getMessage() for r in caplog.records) == 1
    finally:
        server.server_close()
        for s in pairs:
            s.close()


def test_connection_errors_are_logged_at_debug_and_others_with_a_traceback(caplog):
    caplog.set_level(logging.DEBUG, logger="gpuwatch.prometheus")
    server = _Server(("127.0.0.1", 0), _QuietHandler)
    try:
        for err in (ConnectionResetError(104, "Connection reset by peer"), ValueError("bad")):
            try:
                raise err
            except Exception:
                server.handle_error(None, ("192.0.2.7", 40000))
    finally:
        server.server_close()
    assert [(r.levelno, r.getMessage(), r.exc_info is not None and r.exc_info[0]) for r in caplog.records] == [
        (logging.DEBUG, "connection from 192.0.2.7: [Errno 104] Connection reset by peer", False),
        (logging.ERROR, "error serving 192.0.2.7", ValueError)]


def test_start_on_ipv6_logs_where_it_serves_and_shutdown_is_idempotent(caplog):
    caplog.set_level(logging.INFO, logger="gpuwatch.prometheus")
    exp = PrometheusExporter("[::1]:0")
    assert (exp.host, exp.port, exp.scheme, exp.web) == ("::1", 0, "http", None)
    assert exp._server is None and exp._thread is None
    exp.shutdown()  # before start: nothing to stop
    exp.start()
    try:
        assert exp._server.address_family == socket.AF_INET6 and exp._server.server_address[:2] == ("::1", exp.port)
        assert exp.port > 0 and isinstance(exp._server.web, type(None))
        assert exp._thread.name == "prometheus-http" and exp._thread.daemon and exp._thread.is_alive()
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
            (logging.INFO, f"serving Prometheus metrics on http://[::1]:{exp.port}/metrics")]
        exp.publish(MIXED)
        assert exp.app.snapshot is MIXED
        assert raw(exp, b"GET /metrics HTTP/1.0\r\n\r\n", host="::1")[2] == render(MIXED, False)
    finally:
        exp.shutdown()
    exp._thread.join(2)
    assert exp._server is None and not exp._thread.is_alive()
    exp.shutdown()  # a second time: nothing to do


def test_start_with_a_web_config_logs_what_protects_it(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="gpuwatch.prometheus")
    web = write_web_config(tmp_path)
    exp = PrometheusExporter("127.0.0.1:0", web)
    exp.start()
    try:
        assert exp._server.web is web and exp._server.address_family == socket.AF_INET
        assert [r.getMessage() for r in caplog.records] == [
            f"serving Prometheus metrics on http://127.0.0.1:{exp.port}/metrics "
            f"(basic auth for 1 user, from {tmp_path / 'web.yml'})"]
        exp.publish(MIXED)
        status, headers, _ = raw(exp, b"GET /metrics HTTP/1.0\r\n\r\n")
        assert status == "HTTP/1.0 401 Unauthorized" and ("X-Frame-Options", "deny") in headers
        status, _, body = raw(exp, b"GET /metrics HTTP/1.0\r\nAuthorization: " + basic("prometheus:s3cret").encode()
                              + b"\r\n\r\n")
        assert status == "HTTP/1.0 200 OK" and body == render(MIXED, False)
    finally:
        exp.shutdown()


# -- TLS: what the log says about refused handshakes, and plain HTTP sent to the TLS port ------------

@pytest.fixture
def tls_exporter(pki, tmp_path):
    path = tmp_path / "tls.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
                    f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"
                    "  client_allowed_sans: [scraper.example]\n")
    exp = PrometheusExporter("127.0.0.1:0", load_web_config(str(path)))
    exp.start()
    exp.publish(snap(Sample("hw.power", 300.0, GPU)))
    yield exp
    exp.shutdown()


def tls_get(exp, pki, cert, key):
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(str(cert), str(key))
    with socket.create_connection(("127.0.0.1", exp.port), timeout=5) as raw_sock:
        with ctx.wrap_socket(raw_sock, server_hostname="127.0.0.1") as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            got = b""
            while chunk := s.recv(65536):
                got += chunk
    return got


def wait_for_records(caplog, n, timeout=3.0):
    """The server logs from its connection threads: wait until n records are there (and a moment more)."""
    end = time.monotonic() + timeout
    while len(caplog.records) < n and time.monotonic() < end:
        time.sleep(0.01)
    time.sleep(0.05)
    return [(r.levelno, r.getMessage()) for r in caplog.records]


def test_tls_refusals_are_logged_at_debug_and_a_good_scrape_logs_nothing(tls_exporter, pki, caplog):
    caplog.set_level(logging.DEBUG, logger="gpuwatch.prometheus")
    got = tls_get(tls_exporter, pki, pki.client_cert, pki.client_key)
    assert got.startswith(b"HTTP/1.0 200 OK\r\n") and got.endswith(f'hw_power_watts{{gpu="{GPU}"}} 300.0\n'.encode())
    assert wait_for_records(caplog, 1, timeout=0.2) == []  # served, closed, nothing to say
    # A certificate from the right CA but without an allowed name: the handshake succeeds, then the server hangs up.
    with contextlib.suppress(ssl.SSLError, OSError):  # an alert or a reset, depending on timing
        assert tls_get(tls_exporter, pki, pki.other_client_cert, pki.other_client_key) == b""
    assert wait_for_records(caplog, 1) == [
        (logging.DEBUG, "client certificate of 127.0.0.1 has none of client_allowed_sans")]
    caplog.clear()
    # Something that starts like a TLS record but is none.
    with socket.create_connection(("127.0.0.1", tls_exporter.port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01\x00\x05hello")
        with contextlib.suppress(ConnectionResetError):
            while s.recv(100):
                pass
    ((level, message),) = wait_for_records(caplog, 1)
    assert level == logging.DEBUG and message.startswith("TLS handshake with 127.0.0.1 failed: [SSL") and "\n" not in message


PLAIN_HTTP_ANSWER = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                     b"Connection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n")


def plain_http(exp, request: bytes) -> socket.socket:
    """Send plain HTTP to the TLS port, read the answer to the server's half-close; the socket stays open."""
    s = socket.create_connection(("127.0.0.1", exp.port), timeout=5)
    s.sendall(request)
    got = b""
    while chunk := s.recv(4096):
        got += chunk
    assert got == PLAIN_HTTP_ANSWER
    return s


def request_of(size: int) -> bytes:
    head = b"GET /metrics HTTP/1.1\r\nX-Pad: "
    return head + b"p" * (size - len(head) - 4) + b"\r\n\r\n"


def test_plain_http_to_the_tls_port_is_answered_then_drained_for_a_second(tls_exporter, caplog):
    caplog.set_level(logging.DEBUG, logger="gpuwatch.prometheus")
    t = time.monotonic()
    s = plain_http(tls_exporter, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        # The answer comes at once; then the server reads what else the client sends, for a second at most.
        assert wait_for_records(caplog, 1) == [(logging.DEBUG, "TLS handshake with 127.0.0.1 failed: timed out")]
        assert 0.9 < time.monotonic() - t < 1.8
    finally:
        s.close()


def test_plain_http_drain_stops_at_64_kib(tls_exporter, caplog):
    caplog.set_level(logging.DEBUG, logger="gpuwatch.prometheus")
    # 64 KiB read: the server closes. A byte more from the client meets a closed socket, which resets
    # the connection: the next send fails.
    with plain_http(tls_exporter, request_of(65536)) as s:
        time.sleep(0.2)
        s.sendall(b"x")
        time.sleep(0.1)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            s.sendall(b"y")
    # One byte short of 64 KiB: the server reads on, gets that byte and only then closes.
    with plain_http(tls_exporter, request_of(65535)) as s:
        time.sleep(0.2)
        s.sendall(b"x")
        time.sleep(0.1)
        s.sendall(b"y")  # no reset yet: the server read "x" before it closed
    assert wait_for_records(caplog, 1, timeout=0.1) == []  # neither waited for the timeout


def test_the_handshake_deadline_covers_the_whole_handshake(tls_exporter, pki):
    tls_exporter._server.header_timeout = 0.6
    # A client that sends the start of a record and stalls is dropped when the deadline passes ...
    with socket.create_connection(("127.0.0.1", tls_exporter.port), timeout=5) as s:
        t = time.monotonic()
        s.sendall(b"\x16\x03\x01")
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(100) == b""
        assert 0.5 < time.monotonic() - t < 1.0
    # ... and one that is slow but within it gets its scrape.
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with socket.create_connection(("127.0.0.1", tls_exporter.port), timeout=5) as s:
        first = True
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                out = outgoing.read()
                if first:  # the ClientHello in two parts, 0.3 s apart
                    s.sendall(out[:3])
                    time.sleep(0.3)
                    out, first = out[3:], False
                s.sendall(out)
                incoming.write(s.recv(65536))
        tls.write(b"GET /metrics HTTP/1.0\r\n\r\n")
        s.sendall(outgoing.read())
        got = b""
        while True:
            try:
                got += tls.read(65536)
            except ssl.SSLWantReadError:
                chunk = s.recv(65536)
                if not chunk:
                    break
                incoming.write(chunk)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break
    assert got.startswith(b"HTTP/1.0 200 OK\r\n") and got.endswith(f'hw_power_watts{{gpu="{GPU}"}} 300.0\n'.encode())


# ---- content negotiation: ours against prometheus_client's, header by header -------------------
_MEDIA = st.sampled_from(["application/openmetrics-text", "text/plain", "*/*", "application/json", "text/html",
                          " application/openmetrics-text ", "TEXT/PLAIN", ""])
_VERSION = st.one_of(st.sampled_from(["0.0.1", "0.0.4", "1.0.0", "1.0", "1", "2.0.0", "1.0.0.1", "01.0.0",
                                      "abc", "1.x", "1.0.x", "2.abc", "-1.0.0", "+1.0.0", " 1.0.0", "", "1..0"]),
                     st.text(alphabet="0123456789.ax-+= ", max_size=8))
_PARAM = st.one_of(st.builds(lambda v: f"version={v}", _VERSION), st.builds(lambda v: f" version={v}", _VERSION),
                   st.sampled_from(["charset=utf-8", "q=0.5", "escaping=underscores", "version", "version =1.0.0",
                                    "=", ""]))
_RANGE = st.builds(lambda m, ps: ";".join([m, *ps]), _MEDIA, st.lists(_PARAM, max_size=3))
_ACCEPT = st.one_of(st.none(), st.builds(",".join, st.lists(_RANGE, max_size=4)))


def _theirs(accept: str | None) -> bool | None:
    from prometheus_client.exposition import choose_encoder
    try:
        return choose_encoder(accept)[1].startswith("application/openmetrics-text")
    except TypeError:  # a version that is not all numbers: theirs raises
        return None


@settings(max_examples=3000, deadline=None)
@given(_ACCEPT)
def test_content_negotiation_is_prometheus_clients_and_total(accept):
    from gpuwatch.exporters.prometheus import wants_openmetrics
    ours = wants_openmetrics(accept)  # never raises
    theirs = _theirs(accept)
    assert type(ours) is bool
    if theirs is not None:
        assert ours == theirs, accept


@pytest.mark.parametrize("accept,openmetrics", [
    ("application/openmetrics-text; version=1.0.0; charset=utf-8,text/plain;version=0.0.4;q=0.5,*/*;q=0.1", True),
    ("application/openmetrics-text;version=0.0.1,text/plain;version=0.0.4;q=0.5,*/*;q=0.1", False),
    ("text/plain; version=0.0.4", False),
    (None, False),
    ("application/openmetrics-text; version=abc", False),        # theirs: TypeError
    ("application/openmetrics-text; version=1.0.x, application/openmetrics-text", True),
    ("application/openmetrics-text; version=2.abc", True),        # theirs too: 2 > 1 settles it
    ("application/openmetrics-text; version=1.0.0=x", False),     # the value is all after the first "="
    ("application/openmetrics-text; version=2=1.0.0", False),    # "2=1": not a number, as theirs reads it
])
def test_content_negotiation_cases(accept, openmetrics):
    from gpuwatch.exporters.prometheus import wants_openmetrics
    assert wants_openmetrics(accept) is openmetrics


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.none(), st.builds(",".join, st.lists(st.builds(lambda e, q: e + q, st.sampled_from(
    ["gzip", " GZIP ", "deflate", "br", "identity", "*", "x-gzip", ""]), st.sampled_from(["", ";q=0", ";q=1.0"])),
    max_size=4))))
def test_gzip_negotiation_is_prometheus_clients(accept_encoding):
    from prometheus_client.exposition import gzip_accepted as theirs
    from gpuwatch.exporters.prometheus import gzip_accepted
    assert gzip_accepted(accept_encoding) == theirs(accept_encoding)


def test_the_exporter_does_not_import_prometheus_client():
    """Its whole package (default registry and collectors, urllib.request) is 3.5 MiB resident
    for two header checks; the tests keep it as the reference."""
    import subprocess
    code = ("import sys; import gpuwatch.exporters.prometheus, gpuwatch.agent.daemon; "
            "print(sorted(m for m in sys.modules if m.startswith('prometheus_client')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
