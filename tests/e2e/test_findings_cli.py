"""`gpuwatch leaks` and `gpuwatch findings` against a real agent (NVML replayed from the H200)."""
import json
import os
import subprocess
import sys
import time

import pytest

from gpuwatch.agent import control
from tests.conftest import FIXTURE, nvml_recording, series, wait_for


def gpuwatch(*args):
    return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", *args], capture_output=True, text=True,
                          timeout=30)


def test_leaks_and_findings_on_a_healthy_node(agent_factory):
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--no-ebpf")
    agent.metrics()
    out = gpuwatch("leaks", "--socket", str(agent.socket))
    assert out.returncode == 0 and out.stdout.strip() == "no open memory leaks", out.stderr
    out = gpuwatch("findings", "--socket", str(agent.socket), "--json")
    # eBPF is off, but the in-process reports (cupti) feed the launch detector; only the straggler
    # detector (NCCL through eBPF alone) is blind
    assert out.returncode == 0 and json.loads(out.stdout) == {
        "open": [], "recent": [], "ooms": [],
        "blind": [{"detector": "straggler", "kinds": ["straggler_rank"],
                   "reason": "probe ebpf is off in this agent's config"}],
        "seeing": ["leak", "thermal", "launch", "health", "host_bound", "nvlink"]}
    out = gpuwatch("findings", "--socket", str(agent.socket), "--kind", "memory_leak")
    assert out.stdout.strip() == "no open memory_leak findings"
    with pytest.raises(control.ControlError, match=r'findings refused: kind: must be a string, got int'):
        control.call(str(agent.socket), "findings", {"kind": 3})
    # A misspelt kind is an error with the nearest kind, not "no open memory_leek findings"
    out = gpuwatch("findings", "--socket", str(agent.socket), "--kind", "memory_leek")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("Error: no finding kind 'memory_leek' (did you mean 'memory_leak'?); the kinds are "
                                 "degenerate_grid, ecc_uncorrected, gpu_below_sku, gpu_lost,"), out.stderr
    out = gpuwatch("findings", "--socket", str(agent.socket), "--kind", "oom", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["seeing"] == ["leak"]


def test_blind_detectors_say_so_and_why_and_exit_2(agent_factory, tmp_path):
    """NVML down (here: given a file that is not a recording): "no open memory leaks" would be a
    claim nobody checked. The leak detector is blind, says why, and the exit status is 2 (unknown)."""
    bad = tmp_path / "not-a-recording.json"
    bad.write_text("{}")
    agent = agent_factory("--nvml-replay", str(bad), "--no-ebpf", "--no-baseline")
    agent.metrics()
    deadline = time.time() + 20
    while time.time() < deadline:  # the first tick: nvml down
        out = gpuwatch("leaks", "--socket", str(agent.socket))
        if out.returncode == 2:
            break
        time.sleep(0.2)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stdout.splitlines()
    assert lines[0] == "cannot tell whether there are memory leaks: the detectors that find them have no data"
    assert lines[1] == (f"blind leak detector (memory_leak): probe nvml unavailable: {bad} is not a gpuwatch NVML "
                        "recording (`gpuwatch debug record-nvml` writes them): format None, expected "
                        "'gpuwatch-nvml-recording/1'"), lines
    found = json.loads(gpuwatch("findings", "--socket", str(agent.socket), "--json").stdout)
    assert [b["detector"] for b in found["blind"]] == ["leak", "thermal", "health", "host_bound", "straggler", "nvlink"]
    assert found["seeing"] == ["launch"]  # the in-process reports still come
    health = next(b for b in found["blind"] if b["detector"] == "health")
    assert health["reason"] == "probe baseline is off in this agent's config"
    out = gpuwatch("findings", "--socket", str(agent.socket))
    assert out.returncode == 0 and out.stdout.startswith("no open findings\nblind leak detector")


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


# A training job whose tensors leak 20 MiB a second, as its in-process agent reports them (NVML's
# recording lists it on the GPU, so the bytes are verified), until its allocator raises
# OutOfMemoryError: argv[1] the socket, argv[2] the GPU; a line on stdin starts it, the next one is
# the OOM.
LEAKER = r"""
import os, sys, threading, time
from gpuwatch.agent import control
sock, uuid = sys.argv[1], sys.argv[2]
print(os.getpid(), flush=True)
sys.stdin.readline()
oom = []
threading.Thread(target=lambda: (sys.stdin.readline(), oom.append(1)), daemon=True).start()
t0 = time.time()
while True:
    held = int((1 << 30) + 20 * (1 << 20) * (time.time() - t0))
    report = {"version": 1, "cupti": {"state": "unavailable"}, "memory": [
        {"device": 0, "uuid": uuid, "allocated": held, "reserved": held, "ts": time.time(), "frameworks": ["torch"]}]}
    if oom:
        report["oom"] = {"count": 1, "framework": "torch", "how": "allocator", "device": 0,
                         "requested_bytes": 2 << 30}
    control.call(sock, "cupti.report", report)
    if oom:
        break
    time.sleep(0.5)
"""


def test_an_oom_is_shown_beside_the_forecast_its_leak_finding_made(agent_factory, tmp_path):
    """The whole way through a real agent: a leak finding opens with a time to OOM, the job's
    allocator raises OutOfMemoryError, and `gpuwatch findings` and `gpuwatch leaks` show the OOM
    with the forecast and when it came, its GPU counted in the histogram of forecast errors."""
    uuid = next(iter(json.loads(FIXTURE.read_text())["gpus"][0]["uuid"]))["value"]
    sock = tmp_path / "a0" / "run" / "control.sock"
    job = subprocess.Popen([sys.executable, "-c", LEAKER, str(sock), uuid], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        pid = int(job.stdout.readline())
        agent = agent_factory("--nvml-replay", str(nvml_recording(tmp_path, [pid])), "--no-ebpf")
        assert wait_for(lambda: "gpuwatch_gpu_up{" in agent.metrics(), 20)
        job.stdin.write("go\n")
        job.stdin.flush()

        def leak():
            found = control.call(str(agent.socket), "findings", {"kind": "memory_leak"})["open"]
            return [f for f in found if f["pid"] == str(pid)]

        (found,) = wait_for(leak, 90, 0.5)  # a 60 s window is the shortest the detector judges
        assert found["color"] == "white" and found["time_to_oom_seconds"] > 0
        time.sleep(3)
        job.stdin.write("oom\n")
        job.stdin.flush()
        assert job.wait(30) == 0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()

    def ooms():
        out = gpuwatch("findings", "--socket", str(agent.socket), "--json")
        return json.loads(out.stdout)["ooms"]

    (oom,) = wait_for(ooms, 20)
    comm = os.path.basename(sys.executable)[:15]
    assert (oom["pid"], oom["process"], oom["resource"], oom["cause"]) == (str(pid), comm, uuid, "out_of_memory_error")
    assert (oom["framework"], oom["how"], oom["device"], oom["requested_bytes"]) == ("torch", "allocator", 0, 2 << 30)
    # the forecast made when the leak was first found (this poll saw it then, or a judgement later)
    assert oom["forecast_seconds"] == pytest.approx(found["time_to_oom_seconds"], rel=0.1)
    assert 3 <= oom["came_after_seconds"] <= 40
    assert oom["forecast_error_ratio"] == round(oom["came_after_seconds"] / oom["forecast_seconds"] - 1, 4)
    score = (f"forecast {oom['forecast_seconds'] / 60:.1f} min when the leak was found, came at "
             f"{oom['came_after_seconds'] / 60:.1f} min ({oom['forecast_error_ratio']:+.0%})")
    assert oom["score"] == score
    for command in ("findings", "leaks"):  # leaks: what they foretold
        out = gpuwatch(command, "--socket", str(agent.socket))
        lines = out.stdout.splitlines()
        at = lines.index("out of memory:")
        assert lines[at + 1].endswith(f"  {comm} (pid {pid}) on {uuid}: {score}") and lines[at + 1].startswith("  20")
        assert lines[at + 2] == "      PyTorch's allocator raised torch.OutOfMemoryError allocating 2.00 GiB on CUDA device 0"
        assert not any("oom " in x and "ran out of GPU memory" in x for x in lines[at + 1:]), lines  # not twice
    thermal = gpuwatch("findings", "--socket", str(agent.socket), "--kind", "thermal_margin", "--json")
    assert json.loads(thermal.stdout)["ooms"] == []
    text = agent.metrics()
    assert series(text, "gpuwatch_oom_events_total") == {f'{{gpu="{uuid}",cause="out_of_memory_error"}}': 1.0}
    came = "early" if oom["forecast_error_ratio"] < 0 else "late"
    assert series(text, "gpuwatch_oom_forecast_error_ratio_count") == {f'{{gpu="{uuid}",came="{came}"}}': 1.0}
