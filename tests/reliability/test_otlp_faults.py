"""Fault 11: the OTLP receiver refuses, hangs, answers 429 or 503 — against a real agent with --otlp.

Each case: /metrics keeps answering within 2 s while the exporter fails, the failures are counted
(gpuwatch_otlp_items_total{signal="metrics",result="failed"}), and SIGTERM ends the agent within
its bound (the OTLP timeout per signal, docs/otlp.md, plus the agent's own shutdown).
"""
from __future__ import annotations

import re
import time
import urllib.request

import pytest

from tests.conftest import FIXTURE, free_port
from tests.otlp_receiver import GrpcReceiver, HttpReceiver

OTLP_TIMEOUT = 2.0
SCRAPE_BOUND = 2.0
FAILED = re.compile(r'^gpuwatch_otlp_items_total\{signal="metrics",result="failed"\} (\S+)$', re.M)


def scrape(url: str) -> tuple[str, float]:
    t0 = time.monotonic()
    with urllib.request.urlopen(url, timeout=SCRAPE_BOUND + 3) as r:
        body = r.read().decode()
    return body, time.monotonic() - t0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("fault", ["refused", "hang", "429", "503"])
def test_otlp_fault_keeps_scrapes_fast_counts_failures_and_stops_in_time(agent_factory, fault, protocol):
    receiver = None
    if fault == "refused":
        endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    else:
        receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
        receiver.hang_seconds = 60.0
        # gRPC has no HTTP status: its codes for 429 and 503 (OTLP spec) are RESOURCE_EXHAUSTED, UNAVAILABLE
        receiver.default = ({"hang": "hang", "429": "RESOURCE_EXHAUSTED", "503": "UNAVAILABLE"} if protocol == "grpc"
                            else {"hang": "hang", "429": "429:1", "503": "503"})[fault]
        endpoint = receiver.endpoint
    try:
        agent = agent_factory("--nvml-replay", str(FIXTURE), "--nvml-replay-gpus", "2", "--no-ebpf", "--otlp",
                              "--otlp-protocol", protocol, "--otlp-endpoint", endpoint, "--otlp-interval", "1",
                              "--otlp-timeout", str(OTLP_TIMEOUT))
        agent.metrics()
        deadline = time.monotonic() + 45
        worst, failed = 0.0, 0.0
        while time.monotonic() < deadline:
            body, took = scrape(agent.url)
            worst = max(worst, took)
            m = FAILED.search(body)
            failed = float(m.group(1)) if m else 0.0
            if failed > 0:
                break
            time.sleep(0.2)
        assert failed > 0, f"no failed OTLP export counted:\n{agent.output()[-3000:]}"
        for _ in range(5):  # still failing, still fast
            worst = max(worst, scrape(agent.url)[1])
            time.sleep(0.2)
        assert worst < SCRAPE_BOUND, f"a scrape took {worst:.2f} s during the OTLP fault {fault}"
        assert 'gpuwatch_otlp_items_total{signal="metrics",result="exported"}' not in body
        if receiver is not None:
            assert receiver.requests, "the agent never reached the receiver"
        t0 = time.monotonic()
        agent.proc.terminate()
        # bound: one last export per signal (metrics, logs), each within the OTLP timeout, + 5 s slack
        rc = agent.proc.wait(2 * OTLP_TIMEOUT + 5 + 10)
        took = time.monotonic() - t0
        assert rc == 0, agent.output()[-3000:]
        assert took < 2 * OTLP_TIMEOUT + 5, f"SIGTERM took {took:.1f} s with the receiver {fault}"
        assert "Traceback" not in agent.output()
    finally:
        if receiver is not None:
            receiver.stop() if fault != "hang" else _stop_quietly(receiver)


def _stop_quietly(receiver) -> None:
    """A hanging receiver's handler threads sleep on; shutting the server down is enough (daemon threads)."""
    try:
        receiver.stop()
    except Exception:  # noqa: BLE001 - cleanup
        pass
