"""A real agent (NVML replayed from the H200) exporting over OTLP to real receivers, gRPC and HTTP."""
import pytest

from gpuwatch.agent import control
from tests.conftest import FIXTURE
from tests.otlp_receiver import GrpcReceiver, HttpReceiver


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_agent_exports_gpu_metrics_and_events(agent_factory, protocol):
    r = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        agent = agent_factory("--nvml-replay", str(FIXTURE), "--nvml-replay-gpus", "2", "--no-ebpf", "--otlp",
                              "--otlp-protocol", protocol, "--otlp-endpoint", r.endpoint, "--otlp-interval", "1",
                              "--baseline-replay", str(FIXTURE.parent / "baseline-h200.json"))
        agent.metrics()
        assert r.wait_for(lambda: {"hw.power", "hw.gpu.memory.usage", "hw.temperature"} <= r.metric_names(), 20)
        gpus = {p[3]["hw.id"] for p in r.points if p[0] == "hw.power"}
        assert len(gpus) == 2 and all(g.startswith("GPU-") for g in gpus)
        power = next(p for p in r.points if p[0] == "hw.power")
        assert power[1] == "W" and power[3]["hw.type"] == "gpu" and power[3]["hw.model"]
        # Events arrive as log records: a run of the reference workload (replayed) makes one.
        control.call(str(agent.socket), "baseline.run", {"gpu": "1"}, timeout=60)
        assert r.wait_for(lambda: any(log["attributes"].get("event.name") == "gpuwatch.baseline.run"
                                      for log in r.logs), 20)
        run = next(log for log in r.logs if log["attributes"].get("event.name") == "gpuwatch.baseline.run")
        assert run["attributes"]["gpuwatch.result"] == "ok" and run["attributes"]["hw.id"].startswith("GPU-")
        assert r.wait_for(lambda: 'gpuwatch_otlp_items_total{signal="metrics",result="exported"}' in agent.metrics(), 20)
    finally:
        r.stop()


def test_a_bad_otlp_setting_stops_the_agent_with_the_reason(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "", "--state-dir",
                          str(tmp_path), "--runtime-dir", str(tmp_path), "--otlp", "--otlp-endpoint", "collector:4317"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "otlp.endpoint: expected http://HOST:PORT" in out.stderr


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_receiver_down_then_up_is_one_line_each_way_and_on_metrics(agent_factory, protocol):
    import re
    import time

    from tests.conftest import free_port

    port = free_port()  # nothing listens there yet
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--no-ebpf", "--otlp", "--otlp-protocol", protocol,
                          "--otlp-endpoint", f"http://127.0.0.1:{port}", "--otlp-interval", "1",
                          "--otlp-timeout", "1")

    def value(name: str) -> float | None:
        m = re.search(rf"^{re.escape(name)} (\S+)$", agent.metrics(), re.M)
        return float(m.group(1)) if m else None

    def wait(predicate, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, agent.output()
            time.sleep(0.2)

    failures = 'gpuwatch_otlp_export_failures_total{signal="metrics"}'
    wait(lambda: value("gpuwatch_otlp_up") == 0.0 and (value(failures) or 0) >= 3)  # down, and failing on
    down = f"OTLP export of metrics to http://127.0.0.1:{port} ({protocol}) is down: "
    log = agent.output()
    assert log.count(down) == 1, log  # one line, however many exports failed
    line = next(line for line in log.splitlines() if down in line)
    assert " WARNING gpuwatch.otlp: " in line and ("UNAVAILABLE" in line or "Connection refused" in line
                                                    or "NewConnectionError" in line), line
    assert "opentelemetry" not in log, log  # the library's WARNING + ERROR per failed export: silenced

    r = GrpcReceiver(port) if protocol == "grpc" else HttpReceiver(port)
    try:
        wait(lambda: value("gpuwatch_otlp_up") == 1.0)
        assert r.wait_for(lambda: "hw.power" in r.metric_names(), 20)
        up = f"OTLP export of metrics to http://127.0.0.1:{port} ({protocol}) is up again"
        wait(lambda: up in agent.output())
        log = agent.output()
        assert log.count(up) == 1 and log.count(down) == 1 and "opentelemetry" not in log, log
        n = value(failures)
        time.sleep(2.5)  # up it stays: no more failures, no more lines
        assert value(failures) == n and value("gpuwatch_otlp_up") == 1.0
        assert agent.output().count(" gpuwatch.otlp: ") == log.count(" gpuwatch.otlp: ")
    finally:
        r.stop()
