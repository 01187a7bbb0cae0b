"""/metrics against bad HTTP clients, on a real agent: wrong methods, oversized request lines and
headers, too many headers, garbage and foreign protocols, bad basic auth. Each gets a 4xx/5xx
answer or a closed connection, and the next scrape is served.

tests/unit/test_prometheus_exporter.py has the happy methods and paths, test_prometheus_tls.py the
TLS handshake failures, slow clients and the common wrong passwords.
"""
from __future__ import annotations

import base64
import re
import socket
import time

import pytest

from gpuwatch.agent.api import Sample
from gpuwatch.agent.snapshot import Snapshot
from gpuwatch.exporters.prometheus import PrometheusExporter
from gpuwatch.exporters.webconfig import load_web_config
from tests.conftest import FIXTURE, bcrypt_hash


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


def test_a_flood_of_idle_connections_costs_bounded_threads_and_is_answered_503(agent):
    import resource

    from gpuwatch.exporters.prometheus import MAX_REQUESTS

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    pid = agent.proc.pid
    before = _threads(pid)
    socks = []
    try:
        for _ in range(2000):  # connections that never send a request
            socks.append(socket.create_connection(("127.0.0.1", agent.port), timeout=5))
        time.sleep(0.5)
        during = _threads(pid)
        # One thread per connection served, MAX_REQUESTS of them at most (the old server spent
        # two threads on each: 2,000 connections, 610 threads and growing).
        assert during <= before + MAX_REQUESTS + 2, (before, during)
        # Past the cap a client is told at once, not left hanging.
        t = time.monotonic()
        answer = raw_http(agent.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", timeout=5)
        assert answer.startswith(b"HTTP/1.0 503 Service Unavailable"), answer[:80]
        assert time.monotonic() - t < 1.0
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # Once they are gone, scrapes are served again and the threads come back down.
    end = time.monotonic() + 15
    while time.monotonic() < end and ("hw_power_watts" not in _try_metrics(agent) or _threads(pid) > before + 2):
        time.sleep(0.2)
    assert "hw_power_watts" in agent.metrics()
    assert _threads(pid) <= before + 2
    assert agent.output().count("more than 40 connections at once") == 1


def _try_metrics(agent) -> str:
    try:
        return agent.metrics(timeout=1)
    except Exception:  # noqa: BLE001 - still refused: try again
        return ""
