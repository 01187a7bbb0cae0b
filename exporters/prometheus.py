"""Prometheus exporter: serves the latest snapshot on /metrics.

A scrape only translates the snapshot the runner last published; it never calls
NVML, CUPTI or bcc, so a hung GPU call can delay a probe but never a scrape.
Names, types, units and label names all come from the metric registry.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterable

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric as PromMetric
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from wsgiref.simple_server import make_server

from gpuwatch.agent import metrics as registry
from gpuwatch.agent.api import Exporter
from gpuwatch.agent.config import parse_listen
from gpuwatch.agent.snapshot import EMPTY, Snapshot

log = logging.getLogger("gpuwatch.prometheus")


def _clean(value: str) -> str:
    # Process names can hold invalid UTF-8 (surrogate escapes); the exposition must stay valid UTF-8.
    if value.isascii():
        return value
    return value.encode("utf-8", "replace").decode("utf-8")


def families(snapshot: Snapshot) -> list[PromMetric]:
    """Translate a snapshot into Prometheus metric families, one per registered metric present."""
    fams: dict[str, PromMetric] = {}
    skipped: set[str] = set()
    for s in snapshot.samples:
        m = registry.REGISTRY.get(s.metric)
        if m is None:
            skipped.add(s.metric)
            continue
        fam = fams.get(m.name)
        if fam is None:
            cls = CounterMetricFamily if m.kind is registry.Kind.COUNTER else GaugeMetricFamily
            unit = registry._UNIT_SUFFIX[m.unit]
            fam = fams[m.name] = cls(m.prom_name, m.help, labels=m.labels, unit=unit)
        try:
            if m.per_gpu:
                values = [s.resource] + [_clean(str(s.labels[k])) for k in m.labels[1:]]
            else:
                values = [_clean(str(s.labels[k])) for k in m.labels]
        except KeyError as e:
            skipped.add(f"{s.metric} (missing label {e})")
            continue
        fam.add_metric(values, s.value)
    if skipped:
        log.debug("samples not exported (not in the registry or wrong labels): %s", sorted(skipped))
    return list(fams.values())


class _SnapshotCollector:
    """prometheus_client collector over the current snapshot; families are built once per snapshot."""

    def __init__(self) -> None:
        self._snapshot: Snapshot = EMPTY
        self._cache: tuple[Snapshot, list[PromMetric]] | None = None
        self._lock = threading.Lock()

    def set(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[PromMetric]:
        snap = self._snapshot
        with self._lock:
            if self._cache is None or self._cache[0] is not snap:
                self._cache = (snap, families(snap))
            return self._cache[1]


class PrometheusExporter(Exporter):
    name = "prometheus"

    def __init__(self, listen: str) -> None:
        self.host, self.port = parse_listen(listen)
        self.collector = _SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        family = ThreadingWSGIServer.address_family
        import socket

        class _Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in self.host else family
            daemon_threads = True

        app = make_wsgi_app(self.registry)
        self._server = make_server(self.host, self.port, app, _Server, handler_class=_SilentHandler)
        self.port = self._server.server_address[1]  # the real port when 0 was asked for
        self._thread = threading.Thread(target=self._server.serve_forever, name="prometheus-http", daemon=True)
        self._thread.start()
        log.info("serving Prometheus metrics on http://%s:%d/metrics",
                 f"[{self.host}]" if ":" in self.host else self.host, self.port)

    def publish(self, snapshot: Snapshot) -> None:
        self.collector.set(snapshot)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
