"""The /metrics floods of issue 31 (breaks 4 and 5), shared by tests/e2e/test_http_bad_input.py and
bench/http_floods.py: a flood client run as an unprivileged user, a scraper, the agent's RSS.

Floods (FLOOD's first argument), each from N connections at once:
- partial: a request line and some headers, never the blank line; reconnect when dropped.
- tls: the first 3 bytes of a TLS record header; reconnect when dropped.
- headers: a whole request of 99 headers of 65 KB each (6.4 MB); again as soon as it is answered
  or dropped.
- tls-partial, tls-headers: the same inside a completed TLS handshake.
"""
from __future__ import annotations

import base64
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")

FLOOD = r"""
import socket, ssl, sys, threading, time
mode, port, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
tls = None
if mode.startswith("tls-"):  # the whole handshake (any certificate), then the flood's bytes inside TLS
    mode, tls = mode[4:], ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
payload = {
    "partial": b"GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: flood\r\n",
    "tls": b"\x16\x03\x01",
    "headers": b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-Big-%d: " % i + b"a" * 65000 + b"\r\n" for i in range(99)) + b"\r\n",
}[mode]
end = time.monotonic() + seconds
connections = [0] * n

def hold(i):
    while time.monotonic() < end:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=max(0.1, end - time.monotonic()))
        except OSError:
            time.sleep(0.01)
            continue
        connections[i] += 1
        try:
            if tls is not None:
                s = tls.wrap_socket(s)
            s.sendall(payload)
            while s.recv(65536):  # until the server drops us (or answers and closes)
                pass
        except OSError:
            pass
        finally:
            s.close()

threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join(max(0.0, end - time.monotonic()) + 1)
print(sum(connections), flush=True)
"""


def start_flood(mode: str, port: int, n: int, seconds: float) -> subprocess.Popen:
    """The flood, from uid 65534 (nobody): it prints how many connections it made when it ends."""
    return subprocess.Popen([*NOBODY, sys.executable, "-c", FLOOD, mode, str(port), str(n), str(seconds)],
                            cwd="/", stdout=subprocess.PIPE, text=True)


def scrape(url: str, ctx: ssl.SSLContext | None = None, user: str = "", password: str = "",
           timeout: float = 5.0) -> tuple[bool, float, str]:
    """One scrape as Prometheus makes it (a new connection, the request at once): (200 with the
    replayed GPU's power?, seconds, what went wrong)."""
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    if user:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            ok = r.status == 200 and b"hw_power_watts" in r.read()
            return ok, time.monotonic() - t, "" if ok else f"status {r.status}"
    except Exception as e:  # noqa: BLE001 - counted as a failed scrape
        return False, time.monotonic() - t, repr(e)[:120]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def scrapes_under(flood: subprocess.Popen, pid: int, url: str, count: int, every: float = 1.0,
                  **kw) -> dict:
    """`count` scrapes, one every `every` seconds, while the flood runs; the agent's RSS sampled
    every 0.1 s meanwhile: {"ok", "latencies", "errors", "rss_peak"}."""
    results, peak = [], rss_mib(pid)
    next_at = time.monotonic() + every
    for _ in range(count):
        while time.monotonic() < next_at:
            peak = max(peak, rss_mib(pid))
            time.sleep(min(0.1, max(0.0, next_at - time.monotonic())))
        next_at += every
        results.append(scrape(url, **kw))
        peak = max(peak, rss_mib(pid))
    assert flood.poll() is None, "the flood ended before the scrapes did"
    return {"ok": sum(r[0] for r in results), "latencies": [r[1] for r in results],
            "errors": sorted({r[2] for r in results if r[2]}), "rss_peak": peak}
