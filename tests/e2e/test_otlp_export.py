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
        control.call(str(agent.socket), "baseline.run", {"gpu": 1}, timeout=60)
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
