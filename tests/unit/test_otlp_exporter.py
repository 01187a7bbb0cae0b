"""OTLP export (exporters/otlp.py) against real OTLP receivers, gRPC and HTTP (tests/otlp_receiver.py):
names and attributes as the hardware semantic conventions have them, events as log records, and
a receiver that is down, hangs, answers 429 with Retry-After, 503 or 400."""
import time

import pytest

from gpuwatch.agent.api import Event, Sample
from gpuwatch.agent.snapshot import Snapshot
from gpuwatch.agent.config import check_endpoint, parse_headers
from gpuwatch.exporters.otlp import OtlpExporter, OtlpStatsProbe, attributes, event_attributes
from tests.otlp_receiver import GrpcReceiver, HttpReceiver

GPU = "GPU-c002ef2a-2a3c-e0e9-4d8a-a58bfd6b0084"
INFO = {"index": "0", "name": "NVIDIA H200", "pci_bus_id": "00000000:01:00.0", "driver_version": "580.159.04",
        "cuda_driver_version": "13.0", "vbios_version": "96.00", "serial": "1"}


def snapshot(power: float = 614.0) -> Snapshot:
    return Snapshot(ts=time.time(), samples=(
        Sample("gpuwatch.gpu", 1.0, GPU, INFO),
        Sample("hw.power", power, GPU, {}),
        Sample("hw.temperature", 41.0, GPU, {"sensor": "gpu"}),
        Sample("hw.temperature.limit", 89.0, GPU, {"threshold": "slowdown"}),
        Sample("hw.gpu.utilization", 0.97, GPU, {"task": "general"}),
        Sample("hw.energy", 12345.0, GPU, {}),
        Sample("hw.errors", 2.0, GPU, {"type": "uncorrected", "counter": "volatile"}),
        Sample("gpuwatch.process.gpu.memory.usage", 2.0 ** 30, GPU, {"pid": "4242", "process": "python3"}),
        Sample("gpuwatch.probe.up", 1.0, "", {"probe": "nvml"}),
    ))


@pytest.fixture(params=["grpc", "http"])
def receiver(request):
    r = GrpcReceiver() if request.param == "grpc" else HttpReceiver()
    r.protocol = request.param
    yield r
    r.stop()


def exporter(r, **kw) -> OtlpExporter:
    e = OtlpExporter(r.endpoint, r.protocol, **{"interval": 1.0, "timeout": 2.0, **kw})
    e.start()
    return e


def test_metrics_follow_the_hardware_semantic_conventions(receiver):
    e = exporter(receiver)
    try:
        e.publish(snapshot())
        assert receiver.wait_for(lambda: {"hw.power", "hw.errors"} <= receiver.metric_names())
    finally:
        e.shutdown()
    points = {p[0]: p for p in receiver.points}
    name, unit, value, attrs = points["hw.power"]
    assert (unit, value) == ("W", 614.0)
    assert attrs == {"hw.id": GPU, "hw.type": "gpu", "hw.vendor": "NVIDIA", "hw.model": "NVIDIA H200"}
    assert points["hw.temperature"][3]["hw.sensor_location"] == "gpu"
    assert points["hw.temperature.limit"][3]["hw.limit_type"] == "high.degraded"
    assert points["hw.gpu.utilization"][3]["hw.gpu.task"] == "general"
    assert points["hw.errors"][3]["error.type"] == "uncorrected"
    assert points["gpuwatch.process.gpu.memory.usage"][3] == {"hw.id": GPU, "pid": "4242", "process": "python3"}
    assert points["gpuwatch.probe.up"][3] == {"probe": "nvml"}
    assert "gpuwatch.gpu" not in points  # an info metric: its name became hw.model
    resource = receiver.resources[0]
    assert resource["service.name"] == "gpuwatch" and resource["service.version"]


def ours(receiver) -> list[dict]:
    with receiver.lock:  # not the SDK's own (it measures its collections in a histogram too)
        return [h for h in receiver.histograms if h["name"] == "gpuwatch.oom.forecast.error"]


def test_histograms_are_explicit_bucket_histograms_cumulative_from_their_start(receiver):
    """The forecast-error histogram as the OomRecorder holds it: an OTel histogram with the
    registry's bounds, its counts, sum, min and max, cumulative from when counting began."""
    from gpuwatch.agent import metrics as registry
    from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_CUMULATIVE

    hist = registry.Histogram("gpuwatch.oom.forecast.error", 1_700_000_000.0)
    for err in (0.02, 0.05, 0.3, 4.0):
        hist.observe(err)
    now = time.time()
    e = exporter(receiver)
    try:
        e.publish(Snapshot(ts=now, samples=(
            Sample("gpuwatch.gpu", 1.0, GPU, INFO),
            Sample("gpuwatch.oom.forecast.error", 4.0, GPU, {"came": "late"}, now, hist.value()),
            Sample("hw.power", 614.0, GPU, {}))))
        assert receiver.wait_for(lambda: ours(receiver) and "hw.power" in receiver.metric_names())
    finally:
        e.shutdown()
    h = ours(receiver)[0]
    assert h == {"name": "gpuwatch.oom.forecast.error", "unit": "1", "attributes": {"hw.id": GPU, "came": "late"},
                 "temporality": AGGREGATION_TEMPORALITY_CUMULATIVE, "count": 4, "sum": pytest.approx(4.37),
                 "bucket_counts": [2, 0, 0, 1, 0, 0, 1], "explicit_bounds": [0.05, 0.1, 0.2, 0.5, 1.0, 2.0],
                 "min": 0.02, "max": 4.0, "start_time_unix_nano": 1_700_000_000 * 10**9,
                 "time_unix_nano": int(now * 1e9)}
    # its only points are the histogram's (no gauge of its count), in every export
    hists = ours(receiver)
    with receiver.lock:
        points = [p for p in receiver.points if p[0] == "gpuwatch.oom.forecast.error"]
    assert len(points) == len(hists)
    assert all(p == ("gpuwatch.oom.forecast.error", "1", 4, {"hw.id": GPU, "came": "late"}) for p in points)


def test_events_are_log_records_with_their_severity(receiver):
    e = exporter(receiver)
    try:
        e.event(Event("finding.opened", GPU, {"kind": "memory_leak", "severity": "critical",
                                              "summary": "process 4242 is leaking", "colors": {"black": 1.5}}))
        e.event(Event("xid", GPU, {"xid": 79, "pids": [4242]}))
        assert receiver.wait_for(lambda: len(receiver.logs) == 2)
    finally:
        e.shutdown()
    finding, xid = sorted(receiver.logs, key=lambda r: r["attributes"]["event.name"])
    assert finding["body"] == "process 4242 is leaking" and finding["severity"] == 17  # ERROR
    assert finding["attributes"]["gpuwatch.kind"] == "memory_leak" and finding["attributes"]["hw.id"] == GPU
    assert finding["attributes"]["gpuwatch.colors"] == '{"black": 1.5}'
    assert xid["attributes"]["event.name"] == "gpuwatch.xid" and xid["attributes"]["gpuwatch.xid"] == 79
    assert xid["severity"] == 17


def test_a_receiver_that_is_down_costs_failed_exports_not_the_agent(receiver):
    endpoint = receiver.endpoint
    receiver.stop()  # nobody listens there now
    e = OtlpExporter(endpoint, receiver.protocol, interval=1.0, timeout=1.0)
    e.start()
    try:
        t = time.monotonic()
        for _ in range(50):
            e.publish(snapshot())
            e.event(Event("probe.down", "", {"probe": "nvml"}))
        assert time.monotonic() - t < 0.5  # publish and event never wait on the network
        stats = OtlpStatsProbe(e)
        assert receiver.wait_for(lambda: any(s.labels == {"signal": "metrics", "result": "failed"} and s.value > 0
                                             for s in stats.collect()), timeout=20)
    finally:
        t = time.monotonic()
        e.shutdown()
        assert time.monotonic() - t < 5.0  # bounded, though every export fails


def test_a_hanging_receiver_is_cut_off_at_the_timeout_and_shutdown_is_bounded(receiver):
    receiver.default = "hang"
    receiver.hang_seconds = 20.0
    e = exporter(receiver, timeout=1.0)
    e.publish(snapshot())
    assert receiver.wait_for(lambda: receiver.requests, timeout=10)
    t = time.monotonic()
    e.shutdown()
    assert time.monotonic() - t < 6.0


@pytest.fixture
def http_receiver():
    r = HttpReceiver()
    r.protocol = "http"
    yield r
    r.stop()


def test_429_is_retried_after_retry_after(http_receiver):
    http_receiver.script = ["429:1"]  # the first metrics or logs request is refused, come back in 1 s
    e = exporter(http_receiver, interval=60.0, timeout=5.0)  # one export: at shutdown
    try:
        e.publish(snapshot())
    finally:
        e.shutdown()
    times = [t for sig, t in http_receiver.requests if sig == "metrics"]
    assert len(times) == 2 and times[1] - times[0] >= 0.9  # waited as told, then delivered
    assert "hw.power" in http_receiver.metric_names()


def test_503_is_retried_and_400_is_not(http_receiver):
    http_receiver.script = ["503"]
    e = exporter(http_receiver, interval=60.0, timeout=5.0)
    e.publish(snapshot())
    e.shutdown()
    assert len([1 for sig, _ in http_receiver.requests if sig == "metrics"]) == 2
    http_receiver.requests.clear()
    http_receiver.script = ["400"]
    e = exporter(http_receiver, interval=60.0, timeout=5.0)
    e.publish(snapshot())
    e.shutdown()
    assert len([1 for sig, _ in http_receiver.requests if sig == "metrics"]) == 1  # a bad request stays bad
    assert OtlpStatsProbe(e).collect()  # counted


def test_a_full_log_queue_drops_and_counts(http_receiver):
    http_receiver.default = "hang"
    http_receiver.hang_seconds = 5.0
    e = exporter(http_receiver, interval=60.0, timeout=1.0, max_queue=8)
    try:
        for i in range(200):
            e.event(Event("probe.down", "", {"n": i}))
        stats = {(s.labels["signal"], s.labels["result"]): s.value for s in OtlpStatsProbe(e).collect()
             if s.metric == "gpuwatch.otlp.items"}
        assert stats.get(("logs", "dropped_queue_full"), 0) >= 150
    finally:
        e.shutdown()


def test_headers_and_endpoints_are_checked():
    assert parse_headers("authorization=Bearer%20abc, X-Tenant=a") == {"authorization": "Bearer abc", "x-tenant": "a"}
    with pytest.raises(ValueError, match="key=value"):
        parse_headers("authorization")
    assert check_endpoint("https://collector:4317") == "https://collector:4317"
    for bad in ("collector:4317", "ftp://x:1", "http://:4317", "http://x:99999"):
        with pytest.raises(ValueError):
            check_endpoint(bad)
    with pytest.raises(ValueError, match="protocol"):
        OtlpExporter("http://x:1", "udp")


def test_attributes_carry_no_c0_c1_or_bidi_control():
    # as /metrics labels: a file or process name a user chose reaches a collector's UI without controls
    hostile = "/data/w\u202egnp.exe\x9b[31m\u2066\u200f\u061c\n"
    attrs = attributes(Sample("gpuwatch.process.file.size", 1.0, "", {"pid": "1", "process": "p", "file": hostile}), {})
    assert attrs["file"] == "/data/w?gnp.exe?[31m????"
    ev = event_attributes(Event("finding.opened", GPU, {"summary": hostile, "file": hostile, "numbers": {"f": hostile}}))
    assert ev["gpuwatch.file"] == "/data/w?gnp.exe?[31m????"
    assert all(c.isprintable() for v in ev.values() if isinstance(v, str) for c in v)  # JSON escapes the rest
