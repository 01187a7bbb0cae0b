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
import itertools
import logging
import math
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING

from prometheus_client.exposition import choose_encoder, gzip_accepted

from gpuwatch.agent import metrics as registry
from gpuwatch.agent.api import Exporter, HistogramValue, Sample
from gpuwatch.agent.config import parse_listen
from gpuwatch.agent.snapshot import EMPTY, Snapshot

if TYPE_CHECKING:
    from gpuwatch.exporters.webconfig import WebConfig

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
        elif m.kind is registry.Kind.HISTOGRAM:
            sample, om_type, om_name = name, "histogram", name
        else:
            sample, om_type, om_name = name, "gauge", name
        text_type = om_type if om_type in ("counter", "histogram") else "gauge"
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
        histogram = fam.metric.kind is registry.Kind.HISTOGRAM
        lines = []
        for s in groups[metric]:
            try:
                pairs = [f'{k}="{_escape_value(str(s.labels[k]))}"' for k in rest]
            except KeyError as e:
                skipped.add(f"{metric} (missing label {e})")
                continue
            if fam.metric.per_gpu:
                pairs.insert(0, f'gpu="{_escape_value(s.resource)}"')
            if histogram:
                if s.histogram is None or len(s.histogram.counts) != len(fam.metric.buckets) + 1:
                    skipped.add(f"{metric} (no histogram of its buckets)")
                    continue
                lines.extend(_histogram_lines(fam, pairs, s.histogram))
                continue
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


def _le(bound: float) -> str:
    """A bucket's bound as Prometheus writes it (Go's float formatting: 1.0, 0.05, +Inf)."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _histogram_lines(fam: _Family, pairs: list[str], h: HistogramValue) -> list[str]:
    """_bucket{le} (cumulative), _sum, _count. The bounds are non-negative (registry), so _sum may
    be there in OpenMetrics too."""
    name, labels = fam.sample_name, ",".join(pairs)
    sep = "," if labels else ""
    out, total = [], 0
    for bound, n in zip((*fam.metric.buckets, math.inf), h.counts):
        total += n
        out.append(f'{name}_bucket{{{labels}{sep}le="{_le(bound)}"}} {total}\n')
    tail = f"{{{labels}}}" if labels else ""
    out.append(f"{name}_sum{tail} {_number(h.sum)}\n")
    out.append(f"{name}_count{tail} {total}\n")
    return out


def reference_registry(snapshot: Snapshot):
    """The snapshot as prometheus_client metric families, for the library to render.

    Not used to serve: it is the reference that tests compare render() with, and that
    bench/bench_render.py measures it against.
    """
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

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
            elif m.kind is registry.Kind.HISTOGRAM:
                fams[m.name] = HistogramMetricFamily(m.prom_name, m.help, labels=m.labels, unit=unit)
            else:
                fams[m.name] = GaugeMetricFamily(m.prom_name, m.help, labels=m.labels, unit=unit)
        if m.kind is registry.Kind.INFO:
            fams[m.name].add_metric([], values)
        elif m.kind is registry.Kind.HISTOGRAM:
            cumulative = itertools.accumulate(s.histogram.counts)
            fams[m.name].add_metric([values[k] for k in m.labels],
                                    [(_le(b), n) for b, n in zip((*m.buckets, math.inf), cumulative)],
                                    s.histogram.sum)
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
            return [b"method not allowed: use GET or HEAD\n"]  # not the client's bytes back
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


class _Guard:
    """WSGI app in front of _MetricsApp when there is a web config: its headers on every
    response, and basic auth on every path. A failed check says 401 and nothing more: not
    whether the user, the password or the header was wrong."""

    def __init__(self, app, web: "WebConfig") -> None:
        from gpuwatch.exporters.webconfig import UNAUTHORIZED_HEADER

        self.app, self.web, self.challenge = app, web, UNAUTHORIZED_HEADER

    def __call__(self, environ, start_response):
        extra = list(self.web.headers)

        def start(status, headers, exc_info=None):
            return start_response(status, headers + extra, exc_info)

        if self.web.auth is not None and not self.web.auth.check(environ.get("HTTP_AUTHORIZATION")):
            start("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"), self.challenge])
            return [b"Unauthorized\n"]
        return self.app(environ, start)


# A TLS handshake must finish within this many seconds, all of it (CPython's handshake keeps one
# deadline over its reads); then a silent or trickling client is dropped.
HANDSHAKE_TIMEOUT = 10.0
# Each read or write of a request and its response: a client that stalls longer is dropped.
CONNECTION_TIMEOUT = 30.0
_PLAIN_HTTP_ANSWER = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                      b"Connection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n")


# The request line and headers, all of them, must arrive within this many seconds. The per-read
# timeout above never fires for a client that trickles a byte a second (each read gets its byte),
# so without a deadline over the whole request such a client would hold its thread for ever.
REQUEST_TIMEOUT = 10.0


class _Deadlines:
    """One thread for every connection's request deadline (a timer thread per connection would
    double the threads a flood of idle connections costs). A connection past its deadline is shut
    down: its blocked read returns and its handler ends."""

    def __init__(self) -> None:
        self._due: dict[socket.socket, float] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(2.0)

    def add(self, conn: socket.socket, seconds: float) -> None:
        with self._cond:
            self._due[conn] = time.monotonic() + seconds
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prometheus-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def discard(self, conn: socket.socket) -> None:
        with self._cond:
            self._due.pop(conn, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                late = [c for c, t in self._due.items() if t <= now]
                for c in late:
                    del self._due[c]
                wait = min(self._due.values(), default=now + 60.0) - now
                if not late:
                    self._cond.wait(max(0.05, wait))
                    continue
            for c in late:
                try:
                    # The base socket's shutdown (also for TLS): the blocked read returns.
                    socket.socket.shutdown(c, socket.SHUT_RDWR)
                except OSError:
                    pass


class _QuietHandler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT
    request_timeout = REQUEST_TIMEOUT

    def setup(self) -> None:
        super().setup()
        self.server.deadlines.add(self.connection, self.request_timeout)

    def parse_request(self) -> bool:
        ok = super().parse_request()  # has read the headers: the request arrived in time
        self.server.deadlines.discard(self.connection)
        return ok

    def finish(self) -> None:
        self.server.deadlines.discard(self.connection)
        super().finish()

    def log_message(self, format, *args):  # noqa: A002 - scrapes are not worth a log line each
        pass

    def send_error(self, code, message=None, explain=None):
        """Requests refused before they reach the app (request line over 64 KiB: 414; a header line
        over 64 KiB or more than 100 headers: 431; an unparsable request line: 400; HTTP/2 or
        another version: 505). The standard library would answer a request line it cannot parse
        without a status line (HTTP/0.9 style), put the client's words into the status line and
        send an HTML page: here always a status line with the standard reason, a short plain-text
        body, and the connection closed."""
        if getattr(self, "request_version", None) == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        try:
            reason = self.responses[code][0]
        except KeyError:
            reason = "Error"
        body = f"{code} {reason}\n".encode()
        self.close_connection = True
        self.send_response(code, reason)
        self.send_header("Connection", "close")
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if getattr(self, "command", None) != "HEAD":
            self.wfile.write(body)


# At most this many connections are served at once (node_exporter's --web.max-requests): each
# holds a thread, so a flood of idle connections costs threads up to here and no further.
MAX_REQUESTS = 40
_BUSY_ANSWER = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"Connection: close\r\nRetry-After: 1\r\n\r\ntoo many concurrent requests\n")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    # The listen backlog (socketserver's default is 5): a burst of scrapes and health checks must
    # not wait a second for a SYN retransmit while the accept loop starts threads.
    request_queue_size = 1024
    web: "WebConfig | None" = None
    handshake_timeout = HANDSHAKE_TIMEOUT
    max_requests = MAX_REQUESTS

    def server_activate(self) -> None:
        super().server_activate()
        self.deadlines = _Deadlines()
        self._active = 0
        self._active_lock = threading.Lock()
        self._refused_logged = 0.0

    def process_request(self, request, client_address):
        """Serve in a thread of its own, or, past max_requests, answer 503 from the accept loop
        without a thread (a non-blocking write of a few bytes to a fresh socket) and close."""
        with self._active_lock:
            busy = self._active >= self.max_requests
            if not busy:
                self._active += 1
        if not busy:
            return super().process_request(request, client_address)
        now = time.monotonic()
        if now - self._refused_logged > 60.0:  # once a minute, not once per connection
            self._refused_logged = now
            log.warning("/metrics: more than %d connections at once; refusing new ones with 503 "
                        "(a scraper or client that opens connections and does not finish them?)",
                        self.max_requests)
        try:
            if self.web is None or self.web.ssl_context is None:  # TLS clients would not read it
                request.setblocking(False)
                request.send(_BUSY_ANSWER)
        except OSError:
            pass
        self.shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        deadlines = getattr(self, "deadlines", None)
        if deadlines is not None:
            deadlines.close()

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._active_lock:
                self._active -= 1

    def finish_request(self, request, client_address):
        # Runs in the connection's own thread (ThreadingMixIn), not in the accept loop: a client
        # that sends garbage or a byte a second holds its own thread only, never the next scrape.
        ctx = self.web.ssl_context if self.web is not None else None
        if ctx is None:
            return super().finish_request(request, client_address)
        tls = self._handshake(request, ctx, client_address)
        if tls is None:
            return None
        try:
            tls.settimeout(CONNECTION_TIMEOUT)
            super().finish_request(tls, client_address)
        finally:
            self.shutdown_request(tls)  # `request` gave its descriptor to `tls`

    def _handshake(self, sock: socket.socket, ctx: ssl.SSLContext, client_address) -> ssl.SSLSocket | None:
        deadline = time.monotonic() + self.handshake_timeout
        sock.settimeout(self.handshake_timeout)
        try:
            first = sock.recv(1, socket.MSG_PEEK)
            if not first:
                return None
            if first != b"\x16":  # not a TLS handshake record: plain HTTP to the HTTPS port, most likely
                self._answer_plain_http(sock)
                return None
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            tls = ctx.wrap_socket(sock, server_side=True)
        except (OSError, ValueError) as e:  # ssl.SSLError and timeouts are OSErrors
            log.debug("TLS handshake with %s failed: %s", client_address[0], e)
            return None
        if not self.web.client_allowed(tls.getpeercert()):
            log.debug("client certificate of %s has none of client_allowed_sans", client_address[0])
            self.shutdown_request(tls)
            return None
        return tls

    @staticmethod
    def _answer_plain_http(sock: socket.socket) -> None:
        """Say what went wrong, as Go's servers do, then read what the client sent before closing:
        closing with unread bytes would reset the connection and lose the answer."""
        sock.sendall(_PLAIN_HTTP_ANSWER)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(1.0)
        drained = 0
        while drained < 65536:
            chunk = sock.recv(4096)
            if not chunk:
                break
            drained += len(chunk)

    def handle_error(self, request, client_address):
        # A client that went away or timed out is not worth a traceback on stderr.
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            log.debug("connection from %s: %s", client_address[0], err)
        else:
            log.exception("error serving %s", client_address[0])


class PrometheusExporter(Exporter):
    name = "prometheus"

    def __init__(self, listen: str, web: "WebConfig | None" = None, max_requests: int = MAX_REQUESTS) -> None:
        self.host, self.port = parse_listen(listen)
        self.web = web
        self.max_requests = max_requests
        self.app = _MetricsApp()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.web is not None and self.web.ssl_context is not None else "http"

    def start(self) -> None:
        server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6}) if ":" in self.host \
            else _Server
        app = _Guard(self.app, self.web) if self.web is not None else self.app
        self._server = make_server(self.host, self.port, app, server_class, handler_class=_QuietHandler)
        self._server.web = self.web  # before serve_forever: no connection is handled yet
        self._server.max_requests = self.max_requests
        self.port = self._server.server_address[1]  # the real port when 0 was asked for
        self._thread = threading.Thread(target=self._server.serve_forever, name="prometheus-http", daemon=True)
        self._thread.start()
        log.info("serving Prometheus metrics on %s://%s:%d/metrics%s", self.scheme,
                 f"[{self.host}]" if ":" in self.host else self.host, self.port,
                 f" ({self.web.describe()}, from {self.web.path})" if self.web is not None else "")

    def publish(self, snapshot: Snapshot) -> None:
        self.app.snapshot = snapshot

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
