"""Fault 17: twenty concurrent scrapes plus a client that sends one byte a second, against a real agent.

All twenty scrapes complete within 2 s each while the slow client trickles; the slow client is
dropped at the server's request timeout (exporters/prometheus.py HEADER_TIMEOUT: request line and
headers within 2 s); the agent's threads and RSS stay bounded.
"""
from __future__ import annotations

import socket
import threading
import time
import urllib.request

import psutil

from gpuwatch.exporters.prometheus import HEADER_TIMEOUT
from tests.conftest import FIXTURE

SCRAPE_BOUND = 2.0


def _scrape(url: str, out: list, i: int) -> None:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read()
        out[i] = (time.monotonic() - t0, r.status, len(body))
    except Exception as e:  # noqa: BLE001 - reported by the assertion
        out[i] = (time.monotonic() - t0, repr(e), 0)


class SlowClient(threading.Thread):
    """Sends a GET one byte a second; records when the server closed the connection on it."""

    REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: one-byte-a-second\r\nAccept: */*\r\n\r\n"

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.started = time.monotonic()
        self.dropped_after: float | None = None
        self.sent = 0

    def run(self) -> None:
        try:
            for b in self.REQUEST:
                self.sock.sendall(bytes([b]))
                self.sent += 1
                time.sleep(1.0)
                self.sock.setblocking(False)
                try:
                    if self.sock.recv(1) == b"":  # closed by the server
                        break
                except BlockingIOError:
                    pass
                finally:
                    self.sock.setblocking(True)
        except OSError:  # reset by the server
            pass
        self.dropped_after = time.monotonic() - self.started
        self.sock.close()


def test_twenty_scrapes_and_a_byte_a_second_client(agent_factory):
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--nvml-replay-gpus", "8", "--no-ebpf")
    agent.metrics()
    proc = psutil.Process(agent.proc.pid)
    for _ in range(20):  # warm: allocator and caches settle before the baseline
        agent.metrics()
    threads0, rss0 = proc.num_threads(), proc.memory_info().rss

    slow = [SlowClient(agent.port) for _ in range(3)]
    for s in slow:
        s.start()
    worst, rounds = 0.0, 0
    while any(s.dropped_after is None for s in slow) and rounds < 12:
        results: list = [None] * 20
        ts = [threading.Thread(target=_scrape, args=(agent.url, results, i)) for i in range(20)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(15)
        assert all(r is not None and r[1] == 200 and r[2] > 1000 for r in results), results
        worst = max(worst, max(r[0] for r in results))
        rounds += 1
        time.sleep(0.5)
    for s in slow:
        s.join(HEADER_TIMEOUT + 10)
    assert worst < SCRAPE_BOUND, f"a scrape took {worst:.2f} s among 20 concurrent ones"
    for s in slow:
        assert s.dropped_after is not None, "the slow client was never dropped"
        # dropped at the server's request timeout, long before it could finish its 70-byte request
        assert HEADER_TIMEOUT - 1 <= s.dropped_after <= HEADER_TIMEOUT + 3, s.dropped_after
        assert s.sent < len(SlowClient.REQUEST)
    time.sleep(1.0)  # the connection threads end
    threads1, rss1 = proc.num_threads(), proc.memory_info().rss
    assert threads1 <= threads0 + 2, (threads0, threads1)
    assert rss1 <= rss0 * 1.25 + (8 << 20), (rss0, rss1)
    print(f"{rounds} rounds of 20 scrapes: worst {worst * 1000:.0f} ms; threads {threads0}->{threads1}; "
          f"RSS {rss0 >> 20}->{rss1 >> 20} MiB; slow clients dropped after "
          f"{', '.join(f'{s.dropped_after:.1f}' for s in slow)} s")
