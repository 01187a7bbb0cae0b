"""`gpuwatch baseline run|show` against a real agent whose workload children replay runs recorded on
the H200 (baseline.replay), NVML replayed too: judged, kept, exported, and a wrong answer found."""
import copy
import json
import subprocess
import sys
import time

import pytest

from gpuwatch.agent import control
from tests.conftest import FIXTURE

BASELINE = FIXTURE.parent / "baseline-h200.json"


def gpuwatch(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_runs_are_judged_kept_exported_and_a_wrong_answer_is_a_finding(agent_factory, tmp_path):
    runs = json.loads(BASELINE.read_text())["runs"][:6]
    wrong = copy.deepcopy(runs[0])
    wrong["check"].update(ok=False, mismatches=2)
    replay = tmp_path / "runs.json"
    replay.write_text(json.dumps({"runs": runs + [wrong]}))
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--no-ebpf", "--baseline-replay", str(replay))
    agent.metrics()  # up and serving
    sock = str(agent.socket)
    for _ in range(6):
        out = gpuwatch("baseline", "run", "--socket", sock, "--json")
        assert out.returncode == 0, out.stderr
    (last,) = json.loads(out.stdout)
    assert last["result"] == "ok" and last["verdict"]["metrics"]["gemm_flop_per_cycle"]["own_ratio"] is not None
    out = gpuwatch("baseline", "show", "--socket", sock)
    assert out.returncode == 0 and out.stdout.count(" ok ") >= 6 and "against its own baseline" in out.stdout
    shown = json.loads(gpuwatch("baseline", "show", "--socket", sock, "--json", "--last", "2").stdout)
    assert [r["gemm_flop_per_cycle"] for r in shown] == [r["gemm_flop_per_cycle"] for r in runs[4:6]]

    out = gpuwatch("baseline", "run", "--socket", sock, "--gpu", "0")
    assert out.returncode == 1 and "wrong" in out.stdout  # the table says it; the exit status too
    deadline = time.time() + 20
    while time.time() < deadline:
        found = json.loads(gpuwatch("findings", "--socket", sock, "--json").stdout)["open"]
        if found:
            break
        time.sleep(0.5)
    assert [f["kind"] for f in found] == ["silent_data_corruption"] and found[0]["severity"] == "critical"
    # Kept under the replayed GPU's UUID (NVML's), not the one the recorded run carries: the agent
    # names the GPU it asked the workload to run on.
    uuid = json.loads(FIXTURE.read_text())["gpus"][0]["uuid"][0]["value"]
    assert uuid != runs[0]["uuid"] and found[0]["resource"] == uuid
    text = agent.metrics()
    assert 'gpuwatch_baseline_wrong_answers{gpu="' + uuid + '"} 2.0' in text
    assert 'gpuwatch_baseline_runs_total{gpu="' + uuid + '",result="wrong"} 1.0' in text
    # Either name of a GPU, everywhere one is named
    by_index = json.loads(gpuwatch("baseline", "show", "--socket", sock, "--json", "--gpu", "0").stdout)
    by_uuid = json.loads(gpuwatch("baseline", "show", "--socket", sock, "--json", "--gpu", uuid).stdout)
    assert len(by_index) == 7 and by_index == by_uuid and {r["uuid"] for r in by_index} == {uuid}
    out = gpuwatch("baseline", "run", "--socket", sock, "--gpu", uuid, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)[0]["uuid"] == uuid


def test_bad_requests_get_clear_errors(agent_factory, tmp_path):
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--no-ebpf", "--baseline-replay", str(BASELINE))
    agent.metrics()
    sock = str(agent.socket)
    with pytest.raises(control.ControlError, match="baseline.run refused: gpu: must be a string, got int"):
        control.call(sock, "baseline.run", {"gpu": -1})
    with pytest.raises(control.ControlError, match=r"no GPU -1 on this node; its GPUs are 0 \(GPU-0af39ec1-"):
        control.call(sock, "baseline.run", {"gpu": "-1"})
    with pytest.raises(control.ControlError, match="force"):
        control.call(sock, "baseline.run", {"force": "yes"})
    with pytest.raises(control.ControlError, match="baseline.show refused: limit: must be an integer from 1 to 1000, got 0"):
        control.call(sock, "baseline.show", {"limit": 0})
    out = gpuwatch("baseline", "run", "--socket", sock, "--gpu", "3")
    assert out.returncode == 1 and "\nError: no GPU 3 on this node; its GPUs are 0 (GPU-0af39ec1-" in out.stderr
    out = gpuwatch("baseline", "show", "--socket", sock, "--gpu", "1")  # was "no runs kept yet"
    assert out.returncode == 1 and out.stderr.startswith("Error: no GPU 1 on this node")
    out = gpuwatch("baseline", "show", "--socket", sock)
    assert out.returncode == 0 and "no runs kept yet" in out.stdout


def test_an_agent_without_the_workload_says_so(agent_factory):
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--no-ebpf", "--no-baseline")
    agent.metrics()
    out = gpuwatch("baseline", "run", "--socket", str(agent.socket))
    assert out.returncode == 1 and "baseline.enabled is false" in out.stderr
