"""`gpuwatch leaks` and `gpuwatch findings` against a real agent (NVML replayed from the H200)."""
import json
import subprocess
import sys

import pytest

from gpuwatch.agent import control
from tests.conftest import FIXTURE, wait_for


def gpuwatch(*args):
    return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", *args], capture_output=True, text=True,
                          timeout=30)


def test_leaks_and_findings_on_a_healthy_node(agent_factory):
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--no-ebpf")
    agent.metrics()
    out = gpuwatch("leaks", "--socket", str(agent.socket))
    assert out.returncode == 0 and out.stdout.strip() == "no open memory leaks", out.stderr
    out = gpuwatch("findings", "--socket", str(agent.socket), "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == {"open": [], "recent": []}
    out = gpuwatch("findings", "--socket", str(agent.socket), "--kind", "memory_leak")
    assert out.stdout.strip() == "no open memory_leak findings"
    with pytest.raises(control.ControlError, match=r'findings refused: kind: must be a string, got int'):
        control.call(str(agent.socket), "findings", {"kind": 3})


def test_leaks_without_an_agent_says_so(tmp_path):
    out = gpuwatch("leaks", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 1 and "no gpuwatch agent is listening" in out.stderr


def _hot_recording(tmp_path):
    """The H200 recording with two answers edited (not recorded): 85 °C, 4 °C under the slowdown
    threshold (89 °C), and an uncorrectable ECC error more at every tick."""
    rec = json.loads(FIXTURE.read_text())
    gpu = rec["gpus"][0]
    gpu["temperature"] = [{"value": 85} for _ in gpu["temperature"]]
    gpu["ecc_errors uncorrected volatile"] = [{"value": i} for i in range(len(gpu["temperature"]))]
    path = tmp_path / "nvml-hot.json"
    path.write_text(json.dumps(rec))
    return path, gpu


def test_findings_on_a_node_with_a_hot_gpu_and_ecc_errors(agent_factory, tmp_path):
    path, _ = _hot_recording(tmp_path)
    agent = agent_factory("--nvml-replay", str(path), "--no-ebpf")
    agent.metrics()

    def open_findings():
        out = gpuwatch("findings", "--socket", str(agent.socket), "--json")
        assert out.returncode == 0, out.stderr
        found = json.loads(out.stdout)["open"]
        return found if {f["kind"] for f in found} >= {"thermal_margin", "ecc_uncorrected"} else None

    found = wait_for(open_findings, 30)
    assert found, "no thermal findings within 30 s"
    by_kind = {f["kind"]: f for f in found}
    gpu = by_kind["thermal_margin"]["resource"]
    assert by_kind["thermal_margin"] == {
        "kind": "thermal_margin", "id": "slowdown", "resource": gpu, "severity": "warning",
        "celsius": 85.0, "slowdown_celsius": 89.0, "margin_celsius": 4.0, "ts": by_kind["thermal_margin"]["ts"],
        "summary": f"GPU {gpu} is at 85 °C, 4 °C from its slowdown threshold (89 °C): check its cooling and airflow"}
    ecc = by_kind["ecc_uncorrected"]
    # one error more per replayed tick (1 s): as many as ticks went by before the detector ran
    n = ecc["count"]
    assert n >= 1 and n == int(n)
    assert ecc == {"kind": "ecc_uncorrected", "id": "uncorrected", "resource": gpu, "severity": "critical",
                   "count": n, "ts": ecc["ts"],
                   "summary": f"GPU {gpu} had {n:.0f} uncorrectable ECC errors in the last 10 min: the work on it "
                              f"may have read corrupt memory; drain it"}
    out = gpuwatch("findings", "--socket", str(agent.socket), "--kind", "memory_leak")
    assert out.stdout.strip() == "no open memory_leak findings"
    lines = gpuwatch("findings", "--socket", str(agent.socket)).stdout.splitlines()
    assert f"WARNING {by_kind['thermal_margin']['summary']}" in lines
    assert any(line.startswith(f"CRITICAL GPU {gpu} had ") and line.endswith(" uncorrectable ECC errors in the "
               "last 10 min: the work on it may have read corrupt memory; drain it") for line in lines), lines
    assert any(line.endswith(f"opened   {by_kind['thermal_margin']['summary']}") for line in lines), lines
