"""Real OTLP receivers for the tests (metrics, logs, traces), gRPC and HTTP/protobuf, built on opentelemetry-proto's
service definitions: they decode what gpuwatch sends and can misbehave on demand (refuse with a
status, answer 429 with Retry-After, hang) the way a Collector under pressure does."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs_pb
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc as logs_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as metrics_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as trace_grpc


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class Received:
    """What a receiver got: requests (with their arrival times) and the decoded points and logs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[str, float]] = []  # (signal, monotonic time)
        self.points: list[tuple[str, str, float, dict]] = []  # (metric, unit, value, attributes)
        self.histograms: list[dict] = []  # explicit-bucket histogram points, field by field
        self.resources: list[dict] = []
        self.logs: list[dict] = []
        self.spans: list[dict] = []
        # Behaviour, for the next requests: a list consumed front first, then `default`.
        self.script: list[str] = []
        self.default = "ok"  # ok | hang | <status>
        self.hang_seconds = 30.0

    def next_behaviour(self) -> str:
        with self.lock:
            return self.script.pop(0) if self.script else self.default

    def metrics_request(self, req: metrics_pb.ExportMetricsServiceRequest) -> None:
        with self.lock:
            for rm in req.resource_metrics:
                self.resources.append(attrs(rm.resource.attributes))
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        data = getattr(m, m.WhichOneof("data"))
                        for p in data.data_points:
                            if m.WhichOneof("data") in ("gauge", "sum"):
                                v = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                            else:  # histograms: their count
                                v = p.count
                                if m.WhichOneof("data") == "histogram":
                                    self.histograms.append({
                                        "name": m.name, "unit": m.unit, "attributes": attrs(p.attributes),
                                        "temporality": data.aggregation_temporality, "count": p.count,
                                        "sum": p.sum, "bucket_counts": list(p.bucket_counts),
                                        "explicit_bounds": list(p.explicit_bounds), "min": p.min, "max": p.max,
                                        "start_time_unix_nano": p.start_time_unix_nano,
                                        "time_unix_nano": p.time_unix_nano})
                            self.points.append((m.name, m.unit, v, attrs(p.attributes)))

    def logs_request(self, req: logs_pb.ExportLogsServiceRequest) -> None:
        with self.lock:
            for rl in req.resource_logs:
                for sl in rl.scope_logs:
                    for r in sl.log_records:
                        self.logs.append({"body": _value(r.body), "severity": r.severity_number,
                                          "attributes": attrs(r.attributes), "time_unix_nano": r.time_unix_nano})

    def traces_request(self, req: trace_pb.ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        self.spans.append({"name": sp.name, "trace_id": sp.trace_id.hex(),
                                           "span_id": sp.span_id.hex(), "parent": sp.parent_span_id.hex(),
                                           "start": sp.start_time_unix_nano, "end": sp.end_time_unix_nano,
                                           "status": sp.status.code, "attributes": attrs(sp.attributes)})

    def metric_names(self) -> set[str]:
        with self.lock:
            return {p[0] for p in self.points}

    def wait_for(self, predicate, timeout: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return False


class HttpReceiver(Received):
    """POST /v1/metrics and /v1/logs, application/x-protobuf; on `port` (0: any free one)."""

    def __init__(self, port: int = 0) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet tests
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                signal = {"/v1/metrics": "metrics", "/v1/logs": "logs", "/v1/traces": "traces"}.get(self.path)
                with receiver.lock:
                    receiver.requests.append((signal or self.path, time.monotonic()))
                behaviour = receiver.next_behaviour()
                if behaviour == "hang":
                    time.sleep(receiver.hang_seconds)
                    return
                if behaviour.startswith("429"):  # "429" or "429:SECONDS"
                    self.send_response(429)
                    if ":" in behaviour:
                        self.send_header("Retry-After", behaviour.split(":")[1])
                    self.end_headers()
                    return
                if behaviour != "ok":
                    self.send_response(int(behaviour))
                    self.end_headers()
                    return
                if signal == "metrics":
                    receiver.metrics_request(metrics_pb.ExportMetricsServiceRequest.FromString(body))
                    reply = metrics_pb.ExportMetricsServiceResponse()
                elif signal == "logs":
                    receiver.logs_request(logs_pb.ExportLogsServiceRequest.FromString(body))
                    reply = logs_pb.ExportLogsServiceResponse()
                elif signal == "traces":
                    receiver.traces_request(trace_pb.ExportTraceServiceRequest.FromString(body))
                    reply = trace_pb.ExportTraceServiceResponse()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = reply.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        ThreadingHTTPServer.allow_reuse_address = True  # a port an agent tried before (down, then up)
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver(Received):
    """opentelemetry.proto.collector.{metrics,logs}.v1 services on an insecure port (0: any free one)."""

    def __init__(self, port: int = 0) -> None:
        super().__init__()
        import grpc

        receiver = self

        def handle(signal, request, context, record, reply):
            with receiver.lock:
                receiver.requests.append((signal, time.monotonic()))
            behaviour = receiver.next_behaviour()
            if behaviour == "hang":
                time.sleep(receiver.hang_seconds)
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "hung")
            if behaviour != "ok":
                context.abort(getattr(grpc.StatusCode, behaviour), f"told to answer {behaviour}")
            record(request)
            return reply

        class Metrics(metrics_grpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the service's name
                return handle("metrics", request, context, receiver.metrics_request,
                              metrics_pb.ExportMetricsServiceResponse())

        class Logs(logs_grpc.LogsServiceServicer):
            def Export(self, request, context):  # noqa: N802
                return handle("logs", request, context, receiver.logs_request, logs_pb.ExportLogsServiceResponse())

        class Traces(trace_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802
                return handle("traces", request, context, receiver.traces_request, trace_pb.ExportTraceServiceResponse())

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        metrics_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        logs_grpc.add_LogsServiceServicer_to_server(Logs(), self.server)
        trace_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.stop(0)
