"""OpenTelemetry export over OTLP (gRPC or HTTP/protobuf): every registered metric, and every
event (findings, XIDs, probes going down, baseline runs) as a log record.

The OpenTelemetry SDK does the protocol work: a PeriodicExportingMetricReader reads the latest
snapshot through observable instruments on its own thread, a BatchLogRecordProcessor queues
log records (bounded) and sends them on its thread, and the OTLP exporters retry only answers
that are retryable (gRPC UNAVAILABLE/RESOURCE_EXHAUSTED..., HTTP 429/502/503/504), honouring
Retry-After and gRPC's RetryInfo, within `timeout`. So publish() and event() never block the
runner; a receiver that is down, slow or refusing costs failed exports, which are counted:
the SDK's own metrics (otel.sdk.exporter.*.exported, otel.sdk.processor.log.processed) are read
from a private in-memory reader and re-exported as gpuwatch_otlp_* by OtlpStatsProbe.

Names: the registry's names are OpenTelemetry's (hw.* hardware semantic conventions where one
exists). A per-GPU series carries hw.id (the GPU UUID), hw.type "gpu", hw.vendor and hw.model
(from gpuwatch.gpu's name label); registry labels that the conventions name otherwise are
renamed (ATTRIBUTE_NAMES). Info metrics are not instruments: gpuwatch.gpu enriches the GPU
series, gpuwatch.build becomes the resource's service.version.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import socket
import threading
from typing import Any, Iterable, Mapping

from gpuwatch.agent import __version__
from gpuwatch.agent import metrics as registry
from gpuwatch.agent.api import Event, Exporter, Probe, Sample, printable
from gpuwatch.agent.snapshot import EMPTY, Snapshot

log = logging.getLogger("gpuwatch.otlp")

PROTOCOLS = ("grpc", "http")
DEFAULT_ENDPOINTS = {"grpc": "http://localhost:4317", "http": "http://localhost:4318"}

# Registry label -> OpenTelemetry attribute, per metric (hardware semantic conventions).
ATTRIBUTE_NAMES: dict[str, dict[str, str]] = {
    "hw.gpu.utilization": {"task": "hw.gpu.task"},
    "hw.temperature": {"sensor": "hw.sensor_location"},
    "hw.temperature.limit": {"threshold": "hw.limit_type"},
    "hw.errors": {"type": "error.type", "counter": "gpuwatch.ecc.counter"},
}
# hw.limit_type values the conventions define, for our thresholds.
LIMIT_TYPES = {"slowdown": "high.degraded", "shutdown": "high.critical"}

SEVERITIES = {"critical": 17, "warning": 13, "info": 9}  # OpenTelemetry SeverityNumber: ERROR, WARN, INFO


def attributes(s: Sample, gpus: Mapping[str, str]) -> dict[str, Any]:
    """The sample's OpenTelemetry attributes."""
    rename = ATTRIBUTE_NAMES.get(s.metric, {})
    out: dict[str, Any] = {}
    if s.resource:
        out["hw.id"] = s.resource
        if s.metric.startswith("hw."):
            out["hw.type"] = "gpu"
            out["hw.vendor"] = "NVIDIA"
            if gpus.get(s.resource):
                out["hw.model"] = gpus[s.resource]
    for k, v in s.labels.items():
        name = rename.get(k, k)
        # as in /metrics: no C0/C1 or bidi control reaches a collector's UI (agent/wire.py printable)
        out[name] = LIMIT_TYPES.get(v, v) if name == "hw.limit_type" else printable(v) if isinstance(v, str) else v
    return out


def event_attributes(ev: Event) -> dict[str, Any]:
    """An event's attributes as log-record attributes: scalars as they are, the rest as JSON."""
    out: dict[str, Any] = {"event.name": f"gpuwatch.{ev.kind}"}
    if ev.resource:
        out["hw.id"] = ev.resource
    for k, v in ev.attrs.items():
        if k == "summary":
            continue  # the record's body
        if isinstance(v, str):
            out[f"gpuwatch.{k}"] = printable(v)
        elif isinstance(v, (bool, int, float)) or v is None:
            out[f"gpuwatch.{k}"] = "" if v is None else v
        else:
            out[f"gpuwatch.{k}"] = json.dumps(v, default=str, sort_keys=True)
    return out


def _severity(ev: Event) -> int:
    default = SEVERITIES["critical"] if ev.kind in ("xid", "gpu.lost") else SEVERITIES["info"]
    return SEVERITIES.get(str(ev.attrs.get("severity", "")), default)


def sdk_counts(reader) -> dict[tuple[str, str], float]:
    """The OpenTelemetry SDK's own counters from an in-memory reader, as {(signal, result): n}:
    result exported or failed (after retries), or dropped_<reason> by a batch processor."""
    exported = {"otel.sdk.exporter.metric_data_point.exported": "metrics", "otel.sdk.exporter.log.exported": "logs",
                "otel.sdk.exporter.span.exported": "spans"}
    processed = {"otel.sdk.processor.log.processed": "logs", "otel.sdk.processor.span.processed": "spans"}
    out: dict[tuple[str, str], float] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    err = (p.attributes or {}).get("error.type")
                    if m.name in exported:
                        key = (exported[m.name], "failed" if err else "exported")
                    elif m.name in processed and err:
                        key = (processed[m.name], f"dropped_{err}")
                    else:
                        continue
                    out[key] = out.get(key, 0.0) + p.value
    return out


def _sdk_pieces(protocol: str, endpoint: str, headers: Mapping[str, str], certificate: str, insecure: bool,
                timeout: float, self_meters, signals: tuple[str, ...]) -> list:
    """OTLP exporters for `signals` ("metrics", "logs", "spans"), the SDK's own counters going to
    self_meters."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        creds = None
        if certificate:
            import grpc

            with open(certificate, "rb") as f:
                creds = grpc.ssl_channel_credentials(f.read())
        kw = dict(endpoint=endpoint, insecure=insecure or None, credentials=creds, headers=dict(headers) or None,
                  timeout=timeout, meter_provider=self_meters)
        made = {"metrics": OTLPMetricExporter, "logs": OTLPLogExporter, "spans": OTLPSpanExporter}
        return [made[sig](**kw) for sig in signals]
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    base = endpoint.rstrip("/")
    kw = dict(certificate_file=certificate or None, headers=dict(headers) or None, timeout=timeout,
              meter_provider=self_meters)
    made = {"metrics": (OTLPMetricExporter, "/v1/metrics"), "logs": (OTLPLogExporter, "/v1/logs"),
            "spans": (OTLPSpanExporter, "/v1/traces")}
    return [_failures_with_status_counted(made[sig][0](endpoint=base + made[sig][1], **kw), sig) for sig in signals]


HISTOGRAMS = [m for m in registry.METRICS if m.kind is registry.Kind.HISTOGRAM]


def _with_metrics(data, extra: list, resource):
    """MetricsData with `extra` (sdk Metric objects) added to the "gpuwatch" scope."""
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    rms = list(data.resource_metrics) if data is not None else []
    if not rms:
        rms = [ResourceMetrics(resource, [], "")]
    scopes = list(rms[0].scope_metrics)
    at = next((i for i, sm in enumerate(scopes) if sm.scope.name == "gpuwatch"), None)
    if at is None:
        scopes.append(ScopeMetrics(InstrumentationScope("gpuwatch", __version__), extra, ""))
    else:
        scopes[at] = ScopeMetrics(scopes[at].scope, [*scopes[at].metrics, *extra], scopes[at].schema_url)
    rms[0] = ResourceMetrics(rms[0].resource, scopes, rms[0].schema_url)
    return MetricsData(rms)


def _with_histograms(inner, resource, histograms):
    """The OTLP metric exporter `inner`, with the registry's histograms (histograms() -> sdk Metric
    objects) added to each export. The SDK has no asynchronous histogram instrument, and a
    synchronous one would need every observation; the snapshot holds each histogram's cumulative
    state, which becomes its data points here. (A class made here: the SDK is imported only once
    OTLP export starts.)"""
    from opentelemetry.sdk.metrics.export import MetricExporter

    class WithHistograms(MetricExporter):
        def __init__(self) -> None:
            super().__init__(preferred_temporality=inner._preferred_temporality,
                             preferred_aggregation=inner._preferred_aggregation)

        def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
            try:
                extra = histograms()
                if extra:
                    metrics_data = _with_metrics(metrics_data, extra, resource)
            except Exception:  # noqa: BLE001 - the other metrics still go out
                log.exception("OTLP: histograms left out of this export")
            return inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return inner.force_flush(timeout_millis=timeout_millis)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
            return inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    return WithHistograms()


class HttpStatusError(Exception):
    """An OTLP/HTTP export that ended in an error status (after the SDK's retries)."""


def _failures_with_status_counted(exporter, signal: str = ""):
    """The SDK (1.45) counts an export that ended in an HTTP error status — 429 or 503 after its
    retries, 400 — as exported: the result has the status but no exception, and only an exception
    makes its own counter say error.type. Such a result gets an exception here, so that
    gpuwatch_otlp_items_total counts it failed (found by tests/reliability/test_otlp_faults.py)."""
    client = getattr(exporter, "_client", None)
    export = getattr(client, "export", None)
    if export is None:
        return exporter

    def counted(data):
        result = export(data)
        if not getattr(result, "success", True) and getattr(result, "error", 0) is None:
            status = f"HTTP {result.status_code} {result.reason or ''}".strip()
            exporter_logs().note(signal or None, f"the receiver answered {status}")  # the SDK logs no reason
            with contextlib.suppress(TypeError, ValueError):
                result = dataclasses.replace(result, error=HttpStatusError(status))
        return result

    client.export = counted
    return exporter


class ExporterLogs(logging.Handler):
    """Where the OpenTelemetry exporters' own log records go instead of the log: a WARNING and an
    ERROR per failed export (a receiver down for an hour: thousands of lines). The newest says why
    the last export failed (`reason`); gpuwatch says it once per change of state (OtlpExporter),
    or in one line at the end of a trace. Each record stays at DEBUG on gpuwatch.otlp."""

    GENERIC = "due to timeout, max retries or shutdown"  # HTTP's last word: the retry before says why

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: dict[str | None, str] = {}  # signal (None: not known) -> the newest reason

    def note(self, signal: str | None, text: str) -> None:
        self.reasons[signal] = text if len(text) <= 300 else text[:299] + "…"

    def reason(self, signal: str) -> str | None:
        return self.reasons.get(signal) or self.reasons.get(None)

    def forget(self, signal: str) -> None:
        self.reasons.pop(signal, None)

    @staticmethod
    def _signal(record: logging.LogRecord, text: str) -> str | None:
        where = record.name + " " + text  # the HTTP exporters log on their own modules; gRPC's names it
        for signal, words in (("metrics", ("metric",)), ("logs", ("_log_exporter", " logs ")),
                              ("spans", ("trace_exporter", " traces ", " spans "))):
            if any(w in where for w in words):
                return signal
        return None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage().splitlines()[0].strip()
        except Exception:  # noqa: BLE001 - a record that cannot be formatted says nothing
            return
        if self.GENERIC not in text:
            self.note(self._signal(record, text), text)
        log.debug("OpenTelemetry: %s", text)


def exporter_logs() -> ExporterLogs:
    """The one ExporterLogs of this process, on the OpenTelemetry exporters' logger (which then no
    longer hands their records to the root logger)."""
    lg = logging.getLogger("opentelemetry.exporter.otlp")
    for h in lg.handlers:
        if isinstance(h, ExporterLogs):
            return h
    h = ExporterLogs()
    lg.addHandler(h)
    lg.propagate = False
    return h


def reach(endpoint: str, timeout: float) -> str:
    """Why an export failed when the exporter did not say (HTTP's last word is only "timeout, max
    retries or shutdown"): one TCP connect to the receiver, at a change of state only."""
    from urllib.parse import urlsplit

    u = urlsplit(endpoint)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname or "localhost", port), timeout=min(timeout, 2.0)):
            pass
    except OSError as e:
        return f"cannot connect to {u.hostname}:{port}: {e.strerror or e}"
    return f"the receiver at {u.hostname}:{port} accepts connections but did not take the batch in time"


def _watched(exporter, signal: str, result) -> Any:
    """The exporter, its export() results also told to result(signal, ok) (an exception: not ok)."""
    export = exporter.export

    def watched(*args, **kwargs):
        try:
            r = export(*args, **kwargs)
        except Exception:
            result(signal, False)
            raise
        result(signal, getattr(r, "name", "") == "SUCCESS")
        return r

    exporter.export = watched
    return exporter


def _resource():
    from opentelemetry.sdk.resources import Resource

    return Resource.create({"service.name": "gpuwatch", "service.version": __version__,
                            "host.name": socket.gethostname()})


def _self_meters():
    """A private MeterProvider for the SDK's own counters, and its reader. The SDK keeps them only
    when its documented switch is on as exporters and processors are made; they go nowhere else."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    os.environ["OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED"] = "true"
    reader = InMemoryMetricReader()
    return MeterProvider(metric_readers=[reader]), reader


class OtlpExporter(Exporter):
    name = "otlp"

    def __init__(self, endpoint: str = "", protocol: str = "grpc", interval: float = 10.0, timeout: float = 5.0,
                 headers: Mapping[str, str] | None = None, certificate: str = "", insecure: bool = False,
                 max_queue: int = 2048) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        self.protocol = protocol
        self.endpoint = endpoint or DEFAULT_ENDPOINTS[protocol]
        self.interval, self.timeout = interval, timeout
        self.headers = dict(headers or {})
        self.certificate, self.insecure, self.max_queue = certificate, insecure, max_queue
        self._snapshot: Snapshot = EMPTY
        self._index: tuple[Snapshot | None, dict[str, list[Sample]], dict[str, str]] = (None, {}, {})
        self._lock = threading.Lock()
        self._meters = self._logs = self._self_metrics = self._self_reader = None
        self._logger = None
        # The state of the export, per signal: True when its last export reached the receiver,
        # False when it failed, absent before the first; failed exports per signal.
        self._up: dict[str, bool] = {}
        self.failures = {"metrics": 0, "logs": 0}
        self._reasons: ExporterLogs | None = None

    def start(self) -> None:
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        resource = _resource()
        self._reasons = exporter_logs()
        self._self_metrics, self._self_reader = _self_meters()  # exported, failed, dropped: OtlpStatsProbe
        metric_exporter, log_exporter = _sdk_pieces(self.protocol, self.endpoint, self.headers, self.certificate,
                                                    self.insecure, self.timeout, self._self_metrics, ("metrics", "logs"))
        _watched(log_exporter, "logs", self._exported)
        metric_exporter = _watched(_with_histograms(metric_exporter, resource, self._histograms), "metrics",
                                   self._exported)
        reader = PeriodicExportingMetricReader(metric_exporter,
                                               export_interval_millis=self.interval * 1000,
                                               export_timeout_millis=self.timeout * 1000)
        self._meters = MeterProvider(metric_readers=[reader], resource=resource)
        meter = self._meters.get_meter("gpuwatch", __version__)
        for m in registry.METRICS:
            if m.kind in (registry.Kind.INFO, registry.Kind.HISTOGRAM):  # histograms: _with_histograms
                continue
            make = meter.create_observable_counter if m.kind is registry.Kind.COUNTER else meter.create_observable_gauge
            make(m.name, callbacks=[self._callback(m.name)], unit=m.unit, description=m.help)
        self._logs = LoggerProvider(resource=resource)
        self._logs.add_log_record_processor(BatchLogRecordProcessor(
            log_exporter, max_queue_size=self.max_queue, max_export_batch_size=min(512, self.max_queue),
            export_timeout_millis=self.timeout * 1000, meter_provider=self._self_metrics))
        self._logger = self._logs.get_logger("gpuwatch", __version__)
        log.info("exporting OTLP (%s) to %s every %g s", self.protocol, self.endpoint, self.interval)

    def _exported(self, signal: str, ok: bool) -> None:
        """One export's result: one log line when the signal's state changes (down, with why; up
        again), none for each failure of a receiver that stays down."""
        with self._lock:
            was = self._up.get(signal)
            self._up[signal] = ok
            if not ok:
                self.failures[signal] = self.failures.get(signal, 0) + 1
        if self._reasons is not None and ok:
            self._reasons.forget(signal)  # a later failure's reason is its own
        if not ok and was is not False:
            reason = ((self._reasons.reason(signal) if self._reasons is not None else None)
                      or reach(self.endpoint, self.timeout))
            log.warning("OTLP export of %s to %s (%s) is down: %s (said again only when it is back up; "
                        "gpuwatch_otlp_up, gpuwatch_otlp_export_failures_total)", signal, self.endpoint,
                        self.protocol, reason)
        elif ok and was is False:
            log.info("OTLP export of %s to %s (%s) is up again", signal, self.endpoint, self.protocol)

    @property
    def up(self) -> bool | None:
        """Whether the last export of metrics (every interval, so it follows the receiver) reached
        the receiver; None before the first."""
        return self._up.get("metrics")

    def _samples(self, metric: str) -> tuple[list[Sample], dict[str, str]]:
        snap = self._snapshot
        with self._lock:
            if self._index[0] is not snap:  # index the snapshot once per collection
                by_metric: dict[str, list[Sample]] = {}
                gpus: dict[str, str] = {}
                for s in snap.samples:
                    by_metric.setdefault(s.metric, []).append(s)
                    if s.metric == "gpuwatch.gpu":
                        gpus[s.resource] = s.labels.get("name", "")
                self._index = (snap, by_metric, gpus)
            return self._index[1].get(metric, []), self._index[2]

    def _callback(self, metric: str):
        from opentelemetry.metrics import Observation

        def observe(options) -> Iterable[Observation]:
            samples, gpus = self._samples(metric)
            return [Observation(s.value, attributes(s, gpus)) for s in samples]
        return observe

    def _histograms(self) -> list:
        """The registry's histograms in the latest snapshot, as OpenTelemetry explicit-bucket
        histograms (cumulative since each one's start)."""
        from opentelemetry.sdk.metrics.export import AggregationTemporality, Histogram, HistogramDataPoint, Metric

        out = []
        for m in HISTOGRAMS:
            samples, gpus = self._samples(m.name)
            points = [HistogramDataPoint(attributes=attributes(s, gpus), start_time_unix_nano=int(h.start * 1e9),
                                         time_unix_nano=int(s.ts * 1e9), count=h.count, sum=h.sum,
                                         bucket_counts=list(h.counts), explicit_bounds=list(m.buckets),
                                         min=h.min, max=h.max)
                      for s in samples
                      if (h := s.histogram) is not None and h.count and len(h.counts) == len(m.buckets) + 1]
            if points:
                out.append(Metric(m.name, m.help, m.unit, Histogram(points, AggregationTemporality.CUMULATIVE)))
        return out

    # -- the exporter interface -------------------------------------------------------------
    def publish(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def event(self, ev: Event) -> None:
        """One event as a log record: queued, sent by the SDK's thread; dropped (and counted) when
        the queue is full."""
        if self._logger is None:
            return
        from opentelemetry._logs import LogRecord, SeverityNumber

        sev = _severity(ev)
        self._logger.emit(LogRecord(timestamp=int(ev.ts * 1e9), severity_number=SeverityNumber(sev),
                                    severity_text=SeverityNumber(sev).name,
                                    body=printable(str(ev.attrs.get("summary") or ev.kind)),
                                    attributes=event_attributes(ev)))

    def stats(self) -> dict[tuple[str, str], float]:
        """{(signal, result): count}: result is exported, failed or dropped_<reason>."""
        return sdk_counts(self._self_reader) if self._self_metrics is not None else {}

    def shutdown(self) -> None:
        """Bounded: one last export of each signal, each within the timeout, then stop."""
        ms = int(self.timeout * 1000)
        steps = []
        if self._meters is not None:
            steps.append(lambda: self._meters.shutdown(timeout_millis=ms))
        if self._logs is not None:
            # Its last export is bounded by the exporter's own timeout (retries included).
            steps.append(self._logs.shutdown)
        for step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
                log.warning("OTLP shutdown: %s", e)
        self._meters = self._logs = self._logger = None


class OtlpStatsProbe(Probe):
    """What the OTLP exporter managed: gpuwatch_otlp_items_total{signal,result}, whether it is up
    (gpuwatch_otlp_up, once the first export is done) and its failed exports per signal."""

    name = "otlp"
    interval = 5.0

    def __init__(self, exporter: OtlpExporter) -> None:
        self.exporter = exporter

    def collect(self) -> list[Sample]:
        out = [Sample("gpuwatch.otlp.items", v, "", {"signal": sig, "result": res})
               for (sig, res), v in sorted(self.exporter.stats().items())]
        out += [Sample("gpuwatch.otlp.export.failures", float(n), "", {"signal": sig})
                for sig, n in sorted(self.exporter.failures.items())]
        up = self.exporter.up
        if up is not None:
            out.append(Sample("gpuwatch.otlp.up", 1.0 if up else 0.0, ""))
        return out


def export_calls_as_spans(raw_path: str, *, pid: int, process: str, protocol: str = "grpc", endpoint: str = "",
                          headers: Mapping[str, str] | None = None, certificate: str = "", insecure: bool = False,
                          timeout: float = 5.0, kernel_names: Mapping[int, str] | None = None,
                          flush_every: int = 4096) -> dict[str, float]:
    """`gpuwatch trace --pid --otlp`: every recorded CUDA call (probes/ebpf/events.py records) as a
    span under one span for the trace, timestamps moved from the monotonic clock the kernel stamped
    them with to wall time. Flushed every `flush_every` spans, so the queue stays bounded and only a
    receiver that cannot keep up loses spans (counted). Returns {"exported", "failed", "dropped",
    "error": why the last failed export failed, or None}."""
    import time

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import Status, StatusCode, set_span_in_context

    from gpuwatch.probes.ebpf.events import GROUPS, LAUNCH_GROUP, NCCL_GROUP, read_records
    from gpuwatch.probes.ebpf.symbols import API_NAMES, result_name

    endpoint = endpoint or DEFAULT_ENDPOINTS[protocol]
    reasons = exporter_logs()  # the SDK's line per failed batch: the reason of the last one is returned
    reasons.forget("spans")
    to_wall = time.time_ns() - time.monotonic_ns()  # bpf_ktime_get_ns() is CLOCK_MONOTONIC
    self_meters, self_reader = _self_meters()
    (span_exporter,) = _sdk_pieces(protocol, endpoint, headers or {}, certificate, insecure, timeout, self_meters,
                                   ("spans",))
    provider = TracerProvider(resource=_resource())
    processor = BatchSpanProcessor(span_exporter, max_queue_size=2 * flush_every, max_export_batch_size=512,
                                   export_timeout_millis=timeout * 1000, meter_provider=self_meters)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("gpuwatch.trace", __version__)
    kernel_names = kernel_names or {}
    records = read_records(raw_path)
    first = next(records, None)
    if first is None:
        provider.shutdown()
        return {"exported": 0, "failed": 0, "dropped": 0, "error": None}
    root = tracer.start_span(f"gpuwatch trace {pid}", start_time=first[0] + to_wall,
                             attributes={"process.pid": pid, "process.executable.name": process})
    parent = set_span_in_context(root)
    last_end = first[0] + first[1]
    n = 0
    for ts, ns, nbytes, ptr, rpid, tid, api, rc, gx, gy, gz, bx, by, bz in itertools.chain([first], records):
        attrs: dict[str, Any] = {"cuda.api.group": GROUPS[api], "thread.id": tid, "process.pid": rpid}
        if nbytes:
            attrs["gpuwatch.bytes"] = nbytes
        if GROUPS[api] == LAUNCH_GROUP and ptr:
            attrs["gpuwatch.kernel"] = kernel_names.get(ptr) or hex(ptr)
            attrs["gpuwatch.grid"] = f"{gx},{gy},{gz}"
            attrs["gpuwatch.block"] = f"{bx},{by},{bz}"
        elif GROUPS[api] == NCCL_GROUP and ptr:
            attrs["gpuwatch.nccl.communicator"] = hex(ptr)
        elif ptr:
            attrs["gpuwatch.pointer"] = hex(ptr)
        span = tracer.start_span(API_NAMES[api], context=parent, start_time=ts + to_wall, attributes=attrs)
        if rc:
            span.set_attribute("error.type", result_name(API_NAMES[api], rc))
            span.set_status(Status(StatusCode.ERROR, result_name(API_NAMES[api], rc)))
        span.end(end_time=ts + ns + to_wall)
        last_end = max(last_end, ts + ns)
        n += 1
        if n % flush_every == 0:
            processor.force_flush(timeout_millis=int(timeout * 1000))
    root.end(end_time=last_end + to_wall)
    processor.force_flush(timeout_millis=int(timeout * 1000))
    provider.shutdown()
    counts = sdk_counts(self_reader)
    return {"exported": counts.get(("spans", "exported"), 0), "failed": counts.get(("spans", "failed"), 0),
            "dropped": sum(v for (sig, res), v in counts.items() if sig == "spans" and res.startswith("dropped")),
            "error": reasons.reason("spans")}

