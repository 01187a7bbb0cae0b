"""Prometheus exporter: serves the latest snapshot on /metrics.

A scrape only translates the snapshot the runner last published; it never calls
NVML, CUPTI or bcc, so a hung GPU call can delay a probe but never a scrape.
Names, types, units and label names all come from the metric registry.

The exposition is rendered here, straight from the snapshot's samples, in the two
formats Prometheus asks for (OpenMetrics 1.0, which Prometheus prefers, and text
0.0.4). prometheus_client renders the same output from its metric families, but most
of its time goes to per-sample label-name validation: for 742 samples (8 GPUs x 8
processes) it took 4.8 ms (text) and 8.1 ms (OpenMetrics) of CPU per new snapshot on
the H200 machine, this renderer 0.95 and 0.85 ms (bench/bench_render.py, 2026-11-30).
Tests check its output against prometheus_client's rendering and parsers
(tests/unit/test_prometheus_exporter.py). Each snapshot is rendered at most once per
format: HA Prometheus pairs and retries get cached bytes.
"""
from __future__ import annotations

import gzip
import logging
import math
import socket
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from socketserver import ThreadingMixIn

from prometheus_client.exposition import choose_encoder, gzip_accepted

from gpuwatch.agent import metrics as registry
from gpuwatch.agent.api import Exporter, Sample
from gpuwatch.agent.config import parse_listen
from gpuwatch.agent.snapshot import EMPTY, Snapshot

log = logging.getLogger("gpuwatch.prometheus")

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _escape_value(value: str) -> str:
    # Process names can hold invalid UTF-8 (surrogate escapes); the exposition must stay valid UTF-8.
    if not value.isascii():
        try:  # bytes that were undecodable in /proc come back as U+FFFD
            value = value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        except UnicodeEncodeError:  # a lone surrogate of another kind
            value = value.encode("utf-8", "replace").decode("utf-8")
    if "\\" in value or '"' in value or "\n" in value:
        value = value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")
    return value


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


@dataclass(frozen=True)
class _Family:
    """What the exposition needs of one registry entry, computed once."""

    metric: registry.Metric
    sample_name: str
    text_header: str
    om_header: str

    @classmethod
    def of(cls, m: registry.Metric) -> "_Family":
        name, unit = m.prom_name, registry._UNIT_SUFFIX[m.unit]
        help_text = m.help.replace("\\", r"\\").replace("\n", r"\n")
        if m.kind is registry.Kind.COUNTER:
            sample, om_type, om_name = name + "_total", "counter", name
        elif m.kind is registry.Kind.INFO:
            sample, om_type, om_name = name, "info", name[: -len("_info")]
        else:
            sample, om_type, om_name = name, "gauge", name
        text_type = "counter" if m.kind is registry.Kind.COUNTER else "gauge"
        text = f"# HELP {sample} {help_text}\n# TYPE {sample} {text_type}\n"
        om_help = help_text.replace('"', r'\"')  # OpenMetrics escapes quotes in HELP too
        om = f"# HELP {om_name} {om_help}\n# TYPE {om_name} {om_type}\n"
        if unit and m.kind is not registry.Kind.INFO:
            om += f"# UNIT {om_name} {unit}\n"
        return cls(m, sample, text, om)


_FAMILIES = {m.name: _Family.of(m) for m in registry.METRICS}
_ORDER = {m.name: i for i, m in enumerate(registry.METRICS)}


def render(snapshot: Snapshot, openmetrics: bool) -> bytes:
    """The exposition of a snapshot: OpenMetrics 1.0 or Prometheus text 0.0.4."""
    groups: dict[str, list[Sample]] = {}
    skipped: set[str] = set()
    for s in snapshot.samples:
        if s.metric in _FAMILIES:
            groups.setdefault(s.metric, []).append(s)
        else:
            skipped.add(s.metric)
    out: list[str] = []
    for metric in sorted(groups, key=_ORDER.__getitem__):
        fam = _FAMILIES[metric]
        labels = fam.metric.labels
        rest = labels[1:] if fam.metric.per_gpu else labels
        lines = []
        for s in groups[metric]:
            try:
                pairs = [f'{k}="{_escape_value(str(s.labels[k]))}"' for k in rest]
            except KeyError as e:
                skipped.add(f"{metric} (missing label {e})")
                continue
            if fam.metric.per_gpu:
                pairs.insert(0, f'gpu="{_escape_value(s.resource)}"')
            lines.append(f"{fam.sample_name}{{{','.join(pairs)}}} {_number(s.value)}\n" if pairs
                         else f"{fam.sample_name} {_number(s.value)}\n")
        if lines:
            out.append(fam.om_header if openmetrics else fam.text_header)
            out.extend(lines)
    if openmetrics:
        out.append("# EOF\n")
    if skipped:
        log.debug("samples not exported (not in the registry or wrong labels): %s", sorted(skipped))
    return "".join(out).encode("utf-8")


def reference_registry(snapshot: Snapshot):
    """The snapshot as prometheus_client metric families, for the library to render.

    Not used to serve: it is the reference that tests compare render() with, and that
    bench/bench_render.py measures it against.
    """
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

    fams: dict = {}
    for s in snapshot.samples:
        m = registry.REGISTRY[s.metric]
        values = dict(s.labels, **({"gpu": s.resource} if m.per_gpu else {}))
        values = {k: str(values[k]) for k in m.labels}
        if m.name not in fams:
            unit = registry._UNIT_SUFFIX[m.unit]
            if m.kind is registry.Kind.INFO:
                fams[m.name] = InfoMetricFamily(m.prom_name[: -len("_info")], m.help)
            elif m.kind is registry.Kind.COUNTER:
                fams[m.name] = CounterMetricFamily(m.prom_name, m.help, labels=m.labels, unit=unit)
            else:
                fams[m.name] = GaugeMetricFamily(m.prom_name, m.help, labels=m.labels, unit=unit)
        if m.kind is registry.Kind.INFO:
            fams[m.name].add_metric([], values)
        else:
            fams[m.name].add_metric([values[k] for k in m.labels], s.value)

    class _Collector:
        def collect(self):
            return list(fams.values())

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector())
    return reg


class _MetricsApp:
    """WSGI app: /metrics with content negotiation and gzip, rendered once per snapshot and format."""

    def __init__(self) -> None:
        self.snapshot: Snapshot = EMPTY
        self._lock = threading.Lock()
        self._cache: dict[tuple[bool, bool], bytes] = {}
        self._cached_for: Snapshot | None = None

    def body(self, openmetrics: bool, compress: bool) -> bytes:
        snap = self.snapshot
        key = (openmetrics, compress)
        with self._lock:
            if self._cached_for is snap and key in self._cache:
                return self._cache[key]
        data = render(snap, openmetrics)
        if compress:
            data = gzip.compress(data, compresslevel=1)  # level 1: a fifth of the bytes for little CPU
        with self._lock:
            if self._cached_for is not snap:
                self._cache.clear()
                self._cached_for = snap
            self._cache[key] = data
        return data

    def __call__(self, environ, start_response):
        method, path = environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", "")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Type", "text/plain")])
            return [f"{method} is not allowed: use GET\n".encode()]
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [b'<html><head><title>gpuwatch</title></head><body><h1>gpuwatch</h1>'
                    b'<p><a href="/metrics">Metrics</a></p></body></html>\n']
        if path != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: metrics are at /metrics\n"]
        content_type = choose_encoder(environ.get("HTTP_ACCEPT"))[1]
        openmetrics = content_type.startswith("application/openmetrics-text")
        compress = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING"))
        data = self.body(openmetrics, compress)
        headers = [("Content-Type", OPENMETRICS if openmetrics else TEXT), ("Content-Length", str(len(data)))]
        if compress:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [b"" if method == "HEAD" else data]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - scrapes are not worth a log line each
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class PrometheusExporter(Exporter):
    name = "prometheus"

    def __init__(self, listen: str) -> None:
        self.host, self.port = parse_listen(listen)
        self.app = _MetricsApp()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6}) if ":" in self.host \
            else _Server
        self._server = make_server(self.host, self.port, self.app, server_class, handler_class=_QuietHandler)
        self.port = self._server.server_address[1]  # the real port when 0 was asked for
        self._thread = threading.Thread(target=self._server.serve_forever, name="prometheus-http", daemon=True)
        self._thread.start()
        log.info("serving Prometheus metrics on http://%s:%d/metrics",
                 f"[{self.host}]" if ":" in self.host else self.host, self.port)

    def publish(self, snapshot: Snapshot) -> None:
        self.app.snapshot = snapshot

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
