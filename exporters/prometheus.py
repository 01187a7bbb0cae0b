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

import contextlib
import email.utils
import errno
import gzip
import io
import ipaddress
import logging
import math
import selectors
import socket
import socketserver
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server, sys_version
from typing import TYPE_CHECKING

from gpuwatch.agent import metrics as registry
from gpuwatch.agent.api import Exporter, HistogramValue, Probe, Sample, printable
from gpuwatch.agent.config import parse_listen
from gpuwatch.agent.snapshot import EMPTY, Snapshot

if TYPE_CHECKING:
    from gpuwatch.exporters.webconfig import WebConfig

log = logging.getLogger("gpuwatch.prometheus")

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def wants_openmetrics(accept: str | None) -> bool:
    """Content negotiation as prometheus_client's choose_encoder decides it (the first media range
    that settles it: OpenMetrics without a version or at 1.0.0 and later, text/plain at 1.0.0 and
    later; else text 0.0.4), but total: choose_encoder raised TypeError on a version that is not
    all numbers ("version=abc"), a 500 and a traceback in the log for each such request.
    tests/unit/test_prometheus_exporter.py runs both over the same headers."""
    for accepted in (accept or "").split(","):
        params = accepted.split(";")
        kind = params[0].strip()
        if kind not in ("application/openmetrics-text", "text/plain"):
            continue
        version = ""
        for tok in params:  # the first version=, its value all after the first "=" (as theirs)
            key, eq, value = tok.strip().partition("=")
            if eq and key == "version":
                version = value
                break
        if kind == "application/openmetrics-text" and not version:
            return True
        if version and _at_least_1(version):
            return kind == "application/openmetrics-text"
    return False


def _at_least_1(version: str) -> bool:
    """version >= 1.0.0, compared as prometheus_client does (dotted parts, numbers where int()
    reads one); False where that comparison would meet a part that is not a number."""
    parts: list[int | str] = []
    for p in version.split("."):
        try:
            parts.append(int(p))
        except ValueError:
            parts.append(p)
    try:
        return tuple(parts) >= (1, 0, 0)
    except TypeError:
        return False


def gzip_accepted(accept_encoding: str | None) -> bool:
    """Whether the client takes gzip (as prometheus_client's gzip_accepted: a q of 0 is not read)."""
    return any(enc.split(";")[0].strip().lower() == "gzip" for enc in (accept_encoding or "").split(","))


def _escape_value(value: str) -> str:
    # Process names can hold invalid UTF-8 (surrogate escapes); the exposition must stay valid UTF-8.
    if not value.isascii():
        try:  # bytes that were undecodable in /proc come back as U+FFFD
            value = value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        except UnicodeEncodeError:  # a lone surrogate of another kind
            value = value.encode("utf-8", "replace").decode("utf-8")
    # Whatever a probe let through, no label carries a control to a terminal or a dashboard:
    # C0/C1 and bidi controls (a path or name reordered on screen, U+009B CSI) become "?".
    if not value.isprintable():
        value = printable(value)
    if "\\" in value or '"' in value:
        value = value.replace("\\", r"\\").replace('"', r"\"")
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
        openmetrics = wants_openmetrics(environ.get("HTTP_ACCEPT"))
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


# Until its request line and headers have arrived whole (after its TLS handshake, with TLS), a
# connection is "unfinished". One thread reads all unfinished connections through a selector, so
# they cost a buffer each, never a thread. A real Prometheus sends its request within milliseconds
# of connecting: the TLS handshake and the request's head must arrive within HEADER_TIMEOUT in all
# (a client trickling a byte a second is dropped too).
HEADER_TIMEOUT = 2.0
# The request line and headers of one request, all of them. The standard library's limits were per
# line (64 KiB) and per count (100): 6.4 MB a request, parsed by a thread each, and glibc kept it.
MAX_HEAD = 65536
# The heads being read, all connections together: past it the connection holding the most is
# closed (a scrape's head is a few hundred bytes: never the one).
HEAD_BUDGET = 1 << 20
# Unfinished connections held at once. Past it a new connection evicts the oldest unfinished one
# of the peer that holds the most, rather than being refused: connections that never finish
# cannot keep a scrape out, since a scrape's request comes with its connection and is read at once.
MAX_UNFINISHED = 256
# Unfinished connections one peer (an IPv4 address, an IPv6 /64) may hold; past it the peer's own
# oldest is evicted, so one remote host never evicts another's. Loopback peers are every local user
# at once, and an address cannot tell them apart: they share the whole pool.
MAX_UNFINISHED_PER_PEER = 16
LOOPBACK = "loopback"
# Each read or write of a request being answered: a client that stalls longer is dropped.
CONNECTION_TIMEOUT = 30.0
# After an answer given before the request was read (plain HTTP to the TLS port, a head too large),
# what the client still sends is read and thrown away, for this long and this much at most: closing
# with unread bytes would reset the connection and lose the answer.
DRAIN_SECONDS = 1.0
DRAIN_BYTES = 65536
_PLAIN_HTTP_ANSWER = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                      b"Connection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n")

# At most this many requests are answered at once (node_exporter's --web.max-requests), each in a
# thread of its own; past it a complete request is answered 503 by the reading thread.
MAX_REQUESTS = 40
_BUSY_ANSWER = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"Connection: close\r\nRetry-After: 1\r\n\r\ntoo many concurrent requests\n")

# How connections ended: the result label of gpuwatch_http_connections_total.
RESULTS = ("served", "busy", "evicted", "over_budget", "too_large", "timeout", "tls_failed", "closed")
_SAY_EVERY = 3600.0  # a bound that is hit is said in the log once, then at most once an hour


def _refusal(code: int) -> bytes:
    """The answer _QuietHandler.send_error gives, for a request refused before a thread parses it."""
    reason = WSGIRequestHandler.responses[code][0]
    body = f"{code} {reason}\n".encode()
    return (f"HTTP/1.0 {code} {reason}\r\nServer: {WSGIRequestHandler.server_version} {sys_version}\r\n"
            f"Date: {email.utils.formatdate(usegmt=True)}\r\nConnection: close\r\n"
            f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def peer_of(host: str) -> str:
    """Whom a connection counts against: its IPv4 address, its IPv6 /64 (one host gets a /64 to
    pick addresses from), or LOOPBACK for every local client."""
    if host.startswith("127.") or host == "::1" or host.startswith("::ffff:127."):
        return LOOPBACK
    if ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.partition("%")[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))


class _QuietHandler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT

    def setup(self) -> None:
        # The request is (socket, the bytes the reading thread took from it: the whole head): the
        # head is parsed from those bytes, the answer written to the socket.
        self.connection, head = self.request
        self.connection.settimeout(self.timeout)
        self.rfile = io.BytesIO(head)
        self.wfile = socketserver._SocketWriter(self.connection)

    def log_message(self, format, *args):  # noqa: A002 - scrapes are not worth a log line each
        pass

    def send_error(self, code, message=None, explain=None):
        """Requests refused before they reach the app (over 100 headers: 431; an unparsable request
        line: 400; HTTP/2 or another version: 505). The standard library would answer a request line
        it cannot parse without a status line (HTTP/0.9 style), put the client's words into the
        status line and send an HTML page: here always a status line with the standard reason, a
        short plain-text body, and the connection closed."""
        if getattr(self, "request_version", None) == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        reason = self.responses.get(code, ("Error",))[0]
        body = f"{code} {reason}\n".encode()
        self.close_connection = True
        self.send_response(code, reason)
        self.send_header("Connection", "close")
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if getattr(self, "command", None) != "HEAD":
            self.wfile.write(body)


# States of an unfinished connection.
_PEEK, _HANDSHAKE, _HEAD, _DRAIN = "peek", "handshake", "head", "drain"


class _Conn:
    """An unfinished connection: its socket, whom it counts against, its deadline, what it sent."""

    __slots__ = ("sock", "fd", "addr", "peer", "due", "state", "head", "drained", "events", "note")

    def __init__(self, sock: socket.socket, addr, due: float, state: str) -> None:
        self.sock, self.fd, self.addr, self.peer = sock, sock.fileno(), addr, peer_of(addr[0])
        self.due, self.state = due, state
        self.head = bytearray()
        self.drained = 0
        self.events = selectors.EVENT_READ
        self.note = ""  # logged at debug when a drain ends at its deadline


class _Peer:
    """A peer's unfinished connections, oldest first, in two groups: those a newcomer evicts first
    (a TLS handshake not done yet, or an answer given and the rest being drained), then those that
    got further (a plain connection, or a TLS one past its handshake, reading its request). A
    scrape that has done its handshake is thus safe from connections that never do theirs."""

    __slots__ = ("first", "then")

    def __init__(self) -> None:
        self.first: dict[int, _Conn] = {}
        self.then: dict[int, _Conn] = {}

    def __len__(self) -> int:
        return len(self.first) + len(self.then)

    def group(self, conn: _Conn) -> dict[int, _Conn]:
        return self.then if conn.state is _HEAD else self.first

    def oldest(self) -> _Conn:
        return next(iter((self.first or self.then).values()))


def _end_of_head(buf: bytearray, start: int) -> bool:
    """Has the blank line that ends the headers arrived (CRLF or bare LF, as http.client reads)?"""
    return buf.find(b"\n\r\n", start) >= 0 or buf.find(b"\n\n", start) >= 0


class _Server(WSGIServer):
    """/metrics' server: one thread accepts every connection and reads every unfinished one (TLS
    handshakes included) through a selector; each complete request is answered in a thread of its
    own, max_requests of them at once."""

    # The listen backlog (socketserver's default is 5): a burst of scrapes and health checks must
    # not wait a second for a SYN retransmit.
    request_queue_size = 1024
    web: "WebConfig | None" = None
    max_requests = MAX_REQUESTS
    max_unfinished = MAX_UNFINISHED
    max_unfinished_per_peer = MAX_UNFINISHED_PER_PEER
    header_timeout = HEADER_TIMEOUT
    head_budget = HEAD_BUDGET

    def server_activate(self) -> None:
        super().server_activate()
        self.socket.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self.socket, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._pending: dict[int, _Conn] = {}  # by fd, oldest first
        self._by_peer: dict[str, _Peer] = {}  # the same, per peer
        self._head_bytes = 0
        self._next_sweep = math.inf
        self._active = 0
        self._active_lock = threading.Lock()
        self._counts = dict.fromkeys(RESULTS, 0)  # written by the reading thread only
        self._said: dict[str, float] = {}
        self._stopping = False
        self._stopped = threading.Event()
        self._stopped.set()

    # -- the reading thread ------------------------------------------------------------------

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        try:
            while not self._stopping:
                now = time.monotonic()
                if now >= self._next_sweep:
                    self._sweep(now)
                timeout = max(0.0, min(self._next_sweep, now + poll_interval) - now)
                for key, _ in self._selector.select(timeout):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    elif self._pending.get(key.data.fd) is key.data:  # not dropped earlier in this round
                        self._advance(key.data)
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._stopped.wait(5.0)

    def server_close(self) -> None:
        super().server_close()
        if not hasattr(self, "_selector"):  # the bind failed (port in use): server_activate never ran
            return
        for conn in list(self._pending.values()):
            self._forget(conn)
            self._close(conn.sock)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def stats(self) -> dict[str, int]:
        """How many connections ended how (RESULTS), since start."""
        return dict(self._counts)

    def _accept(self) -> None:
        tls = self.web is not None and self.web.ssl_context is not None
        for _ in range(64):  # then the connections already here get their turn
            try:
                sock, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._pending:
                    # Out of descriptors: the oldest unfinished connection gives its own up.
                    self._drop(next(iter(self._pending.values())), "evicted")
                    continue
                self._say("accept", "/metrics: cannot accept connections: %s", e)
                time.sleep(0.05)  # the listener stays readable: do not spin
                return
            self._admit(sock, addr, tls)

    def _admit(self, sock: socket.socket, addr, tls: bool) -> None:
        sock.setblocking(False)
        conn = _Conn(sock, addr, time.monotonic() + self.header_timeout, _PEEK if tls else _HEAD)
        self._make_room(conn.peer)
        self._pending[conn.fd] = conn
        peer = self._by_peer.setdefault(conn.peer, _Peer())
        peer.group(conn)[conn.fd] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self._next_sweep = min(self._next_sweep, conn.due)
        self._advance(conn)  # a scrape's request is usually here already

    def _make_room(self, peer: str) -> None:
        mine = self._by_peer.get(peer, ())
        cap = self.max_unfinished if peer == LOOPBACK else min(self.max_unfinished_per_peer, self.max_unfinished)
        if len(mine) >= cap:
            victim = mine.oldest()
        elif len(self._pending) >= self.max_unfinished:
            victim = max(self._by_peer.values(), key=len).oldest()
        else:
            return
        self._drop(victim, "evicted")
        self._say("evicted", "/metrics: %d connections from %s had not sent their request (%d at most, %d per "
                  "remote address); closing the oldest for each new one (clients that connect and do not send "
                  "a request?)", len(mine) + (victim.peer != peer), peer, self.max_unfinished,
                  self.max_unfinished_per_peer)

    def _advance(self, conn: _Conn) -> None:
        """Take the connection as far as what has arrived allows."""
        try:
            if conn.state is _PEEK:
                self._peek(conn)
            if conn.state is _HANDSHAKE:
                self._handshake(conn)
            if conn.state is _HEAD:
                self._read_head(conn)
            elif conn.state is _DRAIN:
                self._drain(conn)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            self._want(conn, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            if conn.state in (_PEEK, _HANDSHAKE):
                log.debug("TLS handshake with %s failed: %s", conn.addr[0], e)
                self._drop(conn, "tls_failed")
            elif conn.state is _DRAIN:
                self._forget(conn)
                self._close(conn.sock)
            else:
                log.debug("connection from %s: %s", conn.addr[0], e)
                self._drop(conn, "closed")

    def _want(self, conn: _Conn, events: int) -> None:
        if conn.events != events and self._pending.get(conn.fd) is conn:
            conn.events = events
            self._selector.modify(conn.sock, events, conn)

    def _peek(self, conn: _Conn) -> None:
        first = conn.sock.recv(1, socket.MSG_PEEK)
        if not first:
            self._drop(conn, "closed")
            return
        if first != b"\x16":  # not a TLS handshake record: plain HTTP to the HTTPS port, most likely
            conn.sock.send(_PLAIN_HTTP_ANSWER)  # a fresh socket's buffer takes these bytes whole
            conn.sock.shutdown(socket.SHUT_WR)
            self._count("tls_failed")
            self._start_drain(conn, note="TLS handshake with %s failed: timed out")
            return
        self._selector.unregister(conn.sock)
        conn.sock = self.web.ssl_context.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        conn.events, conn.state = selectors.EVENT_READ, _HANDSHAKE

    def _handshake(self, conn: _Conn) -> None:
        conn.sock.do_handshake()
        if not self.web.client_allowed(conn.sock.getpeercert()):
            log.debug("client certificate of %s has none of client_allowed_sans", conn.addr[0])
            self._drop(conn, "tls_failed")
            return
        self._set_state(conn, _HEAD)
        self._want(conn, selectors.EVENT_READ)

    def _read_head(self, conn: _Conn) -> None:
        # Until the socket has nothing more: TLS keeps decrypted bytes the selector cannot see.
        while True:
            chunk = conn.sock.recv(min(MAX_HEAD + 1 - len(conn.head), 16384))
            if not chunk:  # the client closed: what it sent, if anything, is parsed and answered
                if conn.head:
                    self._complete(conn)
                else:
                    self._drop(conn, "closed")
                return
            start = max(0, len(conn.head) - 2)
            conn.head += chunk
            self._head_bytes += len(chunk)
            if _end_of_head(conn.head, start):
                self._complete(conn)
                return
            if len(conn.head) > MAX_HEAD:
                self._too_large(conn)
                return
            if self._head_bytes > self.head_budget:
                self._over_budget()
                if self._pending.get(conn.fd) is not conn:
                    return

    def _too_large(self, conn: _Conn) -> None:
        line_ends = conn.head.find(b"\n", 0, MAX_HEAD) >= 0
        self._count("too_large")
        self._say("too_large", "/metrics: a request from %s had more than %d bytes of request line and headers; "
                  "answered %d", conn.addr[0], MAX_HEAD, 431 if line_ends else 414)
        conn.sock.send(_refusal(431 if line_ends else 414))
        self._head_bytes -= len(conn.head)
        conn.head = bytearray()
        if isinstance(conn.sock, ssl.SSLSocket):
            self._forget(conn)
            self._close(conn.sock)
            return
        conn.sock.shutdown(socket.SHUT_WR)
        self._start_drain(conn)

    def _over_budget(self) -> None:
        while self._head_bytes > self.head_budget and self._pending:
            victim = max(self._pending.values(), key=lambda c: len(c.head))
            self._drop(victim, "over_budget")
            self._say("over_budget", "/metrics: the request heads being read reached %d bytes in all; closing "
                      "the connection that sent the most (from %s)", self.head_budget, victim.addr[0])

    def _start_drain(self, conn: _Conn, note: str = "") -> None:
        self._set_state(conn, _DRAIN)
        conn.note, conn.drained = note, 0
        conn.due = time.monotonic() + DRAIN_SECONDS
        self._next_sweep = min(self._next_sweep, conn.due)

    def _drain(self, conn: _Conn) -> None:
        while True:
            chunk = conn.sock.recv(4096)
            conn.drained += len(chunk)
            if not chunk or conn.drained >= DRAIN_BYTES:
                self._forget(conn)
                self._close(conn.sock)
                return

    def _complete(self, conn: _Conn) -> None:
        """The request's head is here: answer it in a thread of its own, or 503 past max_requests."""
        self._forget(conn)
        with self._active_lock:
            busy = self._active >= self.max_requests
            if not busy:
                self._active += 1
        if busy:
            self._count("busy")
            self._say("busy", "/metrics: %d requests being answered at once (prometheus.max_requests); answering "
                      "503 to new ones (clients that do not read their answers?)", self.max_requests)
            with contextlib.suppress(OSError):
                conn.sock.send(_BUSY_ANSWER)
            self._close(conn.sock)
            return
        self._count("served")
        threading.Thread(target=self._serve, args=(conn.sock, conn.addr, bytes(conn.head)),
                         name="prometheus-request", daemon=True).start()

    def _sweep(self, now: float) -> None:
        """Drop connections past their deadline."""
        nearest = math.inf
        for conn in list(self._pending.values()):
            if conn.due > now:
                nearest = min(nearest, conn.due)
            elif conn.state is _DRAIN:
                if conn.note:
                    log.debug(conn.note, conn.addr[0])
                self._forget(conn)
                self._close(conn.sock)
            else:
                if conn.state is not _HEAD:
                    log.debug("TLS handshake with %s failed: timed out", conn.addr[0])
                self._drop(conn, "timeout")
                self._say("timeout", "/metrics: a connection from %s did not send its request within %.1f s; "
                          "closed", conn.addr[0], self.header_timeout)
        self._next_sweep = max(nearest, now + 0.02)  # deadlines to 20 ms, not a scan per event

    def _set_state(self, conn: _Conn, state: str) -> None:
        mine = self._by_peer[conn.peer]
        del mine.group(conn)[conn.fd]
        conn.state = state
        mine.group(conn)[conn.fd] = conn

    def _forget(self, conn: _Conn) -> None:
        if self._pending.pop(conn.fd, None) is not conn:
            return
        mine = self._by_peer[conn.peer]
        del mine.group(conn)[conn.fd]
        if not mine:
            del self._by_peer[conn.peer]
        self._head_bytes -= len(conn.head)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)

    def _drop(self, conn: _Conn, result: str) -> None:
        self._forget(conn)
        self._close(conn.sock)
        self._count(result)

    @staticmethod
    def _close(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.close()

    def _count(self, result: str) -> None:
        self._counts[result] += 1

    def _say(self, cause: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._said.get(cause, -math.inf) >= _SAY_EVERY:
            self._said[cause] = now
            log.warning(message + " (counted in gpuwatch_http_connections_total; said at most once an hour)",
                        *args)

    # -- a request's own thread ----------------------------------------------------------------

    def _serve(self, sock: socket.socket, addr, head: bytes) -> None:
        try:
            self.RequestHandlerClass((sock, head), addr, self)
        except Exception:  # noqa: BLE001 - a client's trouble ends its own thread only
            self.handle_error(sock, addr)
        finally:
            self.shutdown_request(sock)
            with self._active_lock:
                self._active -= 1

    def handle_error(self, request, client_address):
        # A client that went away or timed out is not worth a traceback on stderr.
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            log.debug("connection from %s: %s", client_address[0], err)
        else:
            log.exception("error serving %s", client_address[0])


class PrometheusStatsProbe(Probe):
    """How /metrics connections ended: gpuwatch_http_connections_total{result}."""

    name = "http"
    interval = 1.0

    def __init__(self, exporter: "PrometheusExporter") -> None:
        self.exporter = exporter

    def collect(self) -> list[Sample]:
        server = self.exporter._server
        counts = server.stats() if server is not None else dict.fromkeys(RESULTS, 0)
        return [Sample("gpuwatch.http.connections", float(counts[r]), "", {"result": r}) for r in RESULTS]


class PrometheusExporter(Exporter):
    name = "prometheus"

    def __init__(self, listen: str, web: "WebConfig | None" = None, max_requests: int = MAX_REQUESTS,
                 max_unfinished: int = MAX_UNFINISHED, header_timeout: float = HEADER_TIMEOUT) -> None:
        self.host, self.port = parse_listen(listen)
        self.web = web
        self.max_requests = max_requests
        self.max_unfinished = max_unfinished
        self.header_timeout = header_timeout
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
        self._server.max_unfinished = self.max_unfinished
        self._server.header_timeout = self.header_timeout
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
