"""/metrics against bad HTTP clients, on a real agent: wrong methods, oversized request lines and
headers, too many headers, garbage and foreign protocols, bad basic auth. Each gets a 4xx/5xx
answer or a closed connection, and the next scrape is served.

tests/unit/test_prometheus_exporter.py has the happy methods and paths, test_prometheus_tls.py the
TLS handshake failures, slow clients and the common wrong passwords.
"""
from __future__ import annotations

import base64
import gzip
import re
import socket
import ssl
import subprocess
import time

import pytest

from gpuwatch.agent.api import Sample
from gpuwatch.agent.snapshot import Snapshot
from gpuwatch.exporters.prometheus import PrometheusExporter
from gpuwatch.exporters.webconfig import load_web_config
from tests.conftest import FIXTURE, bcrypt_hash
from tests.http_floods import scrape


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    from tests.conftest import Agent

    a = Agent(tmp_path_factory.mktemp("http"), "--nvml-replay", str(FIXTURE), "--no-ebpf", "--no-cupti-sampling",
              "--no-baseline")
    end = time.monotonic() + 30
    while "hw_power_watts" not in a.metrics() and time.monotonic() < end:
        time.sleep(0.1)  # until the first snapshot with the replayed GPU is out
    yield a
    assert a.stop() == 0, a.output()
    assert "Traceback" not in a.output(), a.output()


def raw_http(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, return everything the server answers before it closes (or stops talking)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before reading it all
        buf = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            buf += chunk
        return buf
    finally:
        s.close()


def status_of(answer: bytes) -> int | None:
    m = re.match(rb"HTTP/1\.[01] (\d{3}) ", answer)
    return int(m[1]) if m else None


def still_serving(agent) -> None:
    assert agent.proc.poll() is None, agent.output()
    t0 = time.monotonic()
    assert "hw_power_watts" in agent.metrics(5)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "PROPFIND", "get",
                                    "X" * 200])
def test_wrong_methods_get_405(agent, method):
    answer = raw_http(agent.port, f"{method} /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                  f"Content-Length: 3\r\n\r\nabc".encode())
    assert status_of(answer) == 405, answer[:200]
    assert b"Allow: GET, HEAD" in answer and method.encode() not in answer.partition(b"\r\n\r\n")[2]
    still_serving(agent)


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),               # request line too long
    (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),       # a header line too long
    (b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n", 431),  # too many
    (b"GET /metrics HTTP/9.9\r\n\r\n", 505),
    (b"GET /metrics FOO/1.1\r\n\r\n", 400),
    (b"GET\r\n\r\n", 400),
    (b"\x00\x01\x02\x03 / HTTP/1.1\r\n\r\n", 405),                                 # a method of junk
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),                                         # HTTP/2 preface
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, 400),              # TLS to the plain port
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nBad Header Without Colon\r\n\r\n", None),
])
def test_malformed_requests_are_refused(agent, request_bytes, status):
    answer = raw_http(agent.port, request_bytes)
    if status is None:  # http.client tolerates some junk; whatever it answers, it is an HTTP answer or nothing
        assert answer == b"" or status_of(answer) is not None, answer[:200]
    else:
        assert status_of(answer) == status, answer[:300]
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"Content-Type: text/plain" in head and b"<html" not in body.lower(), answer[:300]
        assert request_bytes[:4] not in head.split(b"\r\n")[0] or status == 405  # no client words in the status
    still_serving(agent)


@pytest.mark.parametrize("accept,encoding", [
    ("application/openmetrics-text; version=abc", ""),          # prometheus_client's choose_encoder: TypeError
    ("application/openmetrics-text; version=1.0.x", "gzip"),
    ("text/plain; version=1.x.0, application/openmetrics-text; version=0.0.1", ""),
    ("\x01\x7f;;;;version==", "gzip;;q=\x01"),
])
def test_odd_accept_headers_get_the_text_format(agent, accept, encoding):
    """Headers no scraper sends get the text format, not a 500 and a traceback in the log for each
    (the module's agent is checked for tracebacks when it stops)."""
    extra = f"Accept-Encoding: {encoding}\r\n" if encoding else ""
    answer = raw_http(agent.port, f"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: {accept}\r\n{extra}"
                                  f"Connection: close\r\n\r\n".encode("latin-1"))
    assert status_of(answer) == 200, answer[:300]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Content-Type: text/plain; version=0.0.4" in head
    if encoding:
        body = gzip.decompress(body)
    assert b"hw_power_watts" in body
    still_serving(agent)


def test_a_request_that_never_ends_does_not_block_scrapes(agent):
    s = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")  # and nothing more
        still_serving(agent)
    finally:
        s.close()


def test_paths_that_try_to_escape(agent):
    for path in ("/../../etc/passwd", "/metrics/../../etc/passwd", "/%2e%2e/etc/passwd", "//etc/passwd",
                 "/metrics?x=" + "%00" * 100, "http://evil.example/metrics"):
        answer = raw_http(agent.port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        assert status_of(answer) in (200, 404), (path, answer[:200])
        assert b"root:" not in answer
    still_serving(agent)


# -- bad basic auth: the forms test_prometheus_tls.py does not send ----------------------------------

@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    d = tmp_path_factory.mktemp("web")
    (d / "web.yml").write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    exp = PrometheusExporter("127.0.0.1:0", load_web_config(str(d / "web.yml")))
    exp.start()
    exp.publish(Snapshot(ts=1.0, samples=(Sample("hw.power", 300.0, "GPU-1"),)))
    yield exp
    exp.shutdown()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize("header", [
    "Bearer " + _b64(b"prometheus:s3cret"),
    "Basic",
    "Basic ",
    "Basic " + _b64(b"prometheus"),                     # no colon
    "Basic " + _b64(b":s3cret"),                         # no user
    "Basic " + _b64(b"prometheus:s3cret\x00"),           # NUL after the password
    "Basic " + _b64(b"prometheus\x00:s3cret"),
    "Basic " + _b64(b"prometheus:" + b"s" * 73),         # longer than bcrypt reads
    "Basic " + _b64(b"\xff\xfe:\xff"),                    # not UTF-8
    "Basic " + _b64(b"prometheus:s3cret")[:-2],          # truncated base64
    "Basic " + _b64(b"prometheus:s3cret") + "!!",
    "Basic " + _b64(b"prometheus:" + b"x" * 30_000),     # huge (under the header line limit)
    "basic " + _b64(b"prometheus:wrong"),
    "Digest username=\"prometheus\"",
])
def test_bad_authorization_headers_get_401(guarded, header):
    answer = raw_http(guarded.port, f"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                    f"Authorization: {header}\r\n\r\n".encode())
    assert status_of(answer) == 401, answer[:200]
    assert b'WWW-Authenticate: Basic realm="gpuwatch"' in answer
    assert answer.endswith(b"\r\n\r\nUnauthorized\n")
    assert b"hw_power" not in answer


def test_two_authorization_headers_do_not_let_a_wrong_one_in(guarded):
    bad, good = _b64(b"prometheus:wrong"), _b64(b"prometheus:s3cret")
    answer = raw_http(guarded.port, f"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                    f"Authorization: Basic {bad}\r\nAuthorization: Basic {good}\r\n\r\n".encode())
    assert status_of(answer) == 401, answer[:200]


def test_the_right_password_still_works_after_the_bad_ones(guarded):
    answer = raw_http(guarded.port, f"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                    f"Authorization: Basic {_b64(b'prometheus:s3cret')}\r\n\r\n".encode())
    assert status_of(answer) == 200 and b"hw_power_watts" in answer


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_a_burst_of_connects_is_queued_not_retransmitted(agent):
    # socketserver's default backlog of 5 made every few connects of a burst wait a second for the
    # SYN to be retransmitted. Each connect here must be taken at once.
    slow, socks = [], []
    try:
        for _ in range(200):
            t = time.monotonic()
            socks.append(socket.create_connection(("127.0.0.1", agent.port), timeout=5))
            if time.monotonic() - t > 0.5:
                slow.append(round(time.monotonic() - t, 2))
    finally:
        for s in socks:
            s.close()
    assert slow == []
    assert "hw_power_watts" in agent.metrics()


def test_a_flood_of_idle_connections_costs_no_threads_and_scrapes_go_on(agent):
    import resource

    from gpuwatch.exporters.prometheus import MAX_UNFINISHED

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    pid = agent.proc.pid
    before = _threads(pid)
    socks = []
    try:
        for _ in range(2000):  # connections that never send a request
            socks.append(socket.create_connection(("127.0.0.1", agent.port), timeout=5))
        time.sleep(0.5)
        # One thread reads every unfinished connection (the old server spent a thread on each of
        # 40, then answered 503 to everyone else, scrapes included).
        assert _threads(pid) <= before + 2, (before, _threads(pid))
        # Past MAX_UNFINISHED, each new connection closed the oldest: a scrape evicts one and is served.
        answer = raw_http(agent.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", timeout=5)
        assert status_of(answer) == 200 and b"hw_power_watts" in answer, answer[:80]
        closed = 0
        for s in socks[:2000 - MAX_UNFINISHED]:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed += 1
        assert closed >= 2000 - MAX_UNFINISHED - 1, closed
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "hw_power_watts" in agent.metrics()
    assert _threads(pid) <= before + 2
    assert agent.output().count("had not sent their request") == 1


# -- floods of issue 31: partial requests, partial TLS handshakes, huge headers, as nobody ------------

from tests.http_floods import rss_mib, scrapes_under, start_flood  # noqa: E402

FLOOD_SECONDS = 8.0  # 1.5 s to fill up, then 10 scrapes half a second apart


def play(mode: str, agent, url: str, **kw) -> dict:
    flood = start_flood(mode, agent.port, 40, FLOOD_SECONDS)
    try:
        time.sleep(1.5)
        got = scrapes_under(flood, agent.proc.pid, url, 10, every=0.5, **kw)
    finally:
        try:
            out, _ = flood.communicate(timeout=FLOOD_SECONDS + 10)
        except subprocess.TimeoutExpired:
            flood.kill()
            out, _ = flood.communicate()
    got["connections"] = int(out.strip() or 0)
    assert agent.proc.poll() is None, agent.output()
    return got


def test_partial_requests_reconnecting_do_not_blind_scrapes(agent):
    # 40 connections that send part of a request and reconnect when dropped took every one of the
    # old server's 40 places, for 10 s each: every scrape got 503.
    got = play("partial", agent, agent.url)
    assert got["ok"] >= 9, got
    assert got["connections"] >= 40, got


@pytest.fixture(scope="module")
def tls_agent(tmp_path_factory, pki):
    from tests.conftest import Agent

    d = tmp_path_factory.mktemp("tls-agent")
    (d / "web.yml").write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
                               f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    a = Agent(d, "--nvml-replay", str(FIXTURE), "--no-ebpf", "--no-cupti-sampling", "--no-baseline",
              "--web-config", str(d / "web.yml"))
    a.url = f"https://127.0.0.1:{a.port}/metrics"
    a.client = {"ctx": ssl.create_default_context(cafile=str(pki.ca)), "user": "prometheus", "password": "s3cret"}
    end = time.monotonic() + 30
    while not scrape(a.url, **a.client)[0] and time.monotonic() < end:
        assert a.proc.poll() is None, a.output()
        time.sleep(0.2)
    yield a
    assert a.stop() == 0, a.output()
    assert "Traceback" not in a.output(), a.output()


def test_partial_tls_handshakes_reconnecting_do_not_blind_scrapes_over_tls(tls_agent):
    # 3 bytes of a TLS record header held the old server's place for its 10 s handshake timeout.
    got = play("tls", tls_agent, tls_agent.url, **tls_agent.client)
    assert got["ok"] >= 9, got
    got = play("partial", tls_agent, tls_agent.url, **tls_agent.client)  # plain HTTP to the TLS port
    assert got["ok"] >= 9, got


def test_huge_headers_neither_bloat_the_agent_nor_blind_scrapes(agent):
    # 40 requests of 99 headers of 65 KB each: the old server read them all, a thread each, and
    # its RSS went 115 -> ~500 MB and stayed there.
    for _ in range(5):
        agent.metrics()
    before = rss_mib(agent.proc.pid)
    got = play("headers", agent, agent.url)
    time.sleep(1.0)
    after = rss_mib(agent.proc.pid)
    print(f"huge headers: RSS {before:.1f} -> peak {got['rss_peak']:.1f} -> {after:.1f} MiB; "
          f"{got['ok']}/10 scrapes; {got['connections']} flood connections")
    assert got["ok"] >= 9, got
    assert got["rss_peak"] <= before + 40, (before, got["rss_peak"])
    assert after <= before + 20, (before, after)
    assert agent.output().count("bytes of request line and headers") == 1


def _try_metrics(agent) -> str:
    try:
        return agent.metrics(timeout=1)
    except Exception:  # noqa: BLE001 - still refused: try again
        return ""
