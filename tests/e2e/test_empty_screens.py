"""Issue 35 item 3: every screen says why it is empty, with the reason `status` gives (as nvitop and
nvidia-smi print NVML's error): `top`, `leaks` and `findings` against a real agent whose NVML probe
is unavailable; `gpus` (NVML read here) with NVML's own error."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import wait_for

README = Path(__file__).resolve().parents[2] / "README.md"


def gpuwatch(*args, env=None):
    return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, **(env or {})))


def test_top_leaks_and_findings_say_what_status_says(agent_factory):
    agent = agent_factory("--nvml-replay", str(README), "--no-ebpf", "--no-baseline")
    agent.metrics()
    sock = str(agent.socket)

    def nvml_reason():
        st = json.loads(gpuwatch("status", "--socket", sock, "--json").stdout or "{}")
        nvml = (st.get("probes") or {}).get("nvml") or {}
        return nvml.get("reason") if nvml.get("state") == "unavailable" else None
    reason = wait_for(nvml_reason, 20, 0.3)
    assert reason and "is not a gpuwatch NVML recording" in reason
    top = gpuwatch("top", "--socket", sock, "--once")
    assert top.returncode == 0, top.stderr
    # Was: "  no GPUs".
    assert f"no GPUs: NVML probe unavailable: {reason[:40]}" in " ".join(top.stdout.split()), top.stdout
    view = json.loads(gpuwatch("top", "--socket", sock, "--json").stdout)
    assert view["no_gpus_reason"] == f"NVML probe unavailable: {reason}"
    for cmd in ("leaks", "findings"):
        out = gpuwatch(cmd, "--socket", sock)
        assert "blind" in out.stdout and reason[:40] in " ".join(out.stdout.split()), (cmd, out.stdout)


def test_top_of_an_agent_without_the_nvml_probe_says_so(agent_factory):
    agent = agent_factory("--no-nvml", "--no-ebpf", "--no-baseline")
    agent.metrics()
    top = gpuwatch("top", "--socket", str(agent.socket), "--once")
    assert "no GPUs: the NVML probe does not run in this agent" in " ".join(top.stdout.split()), top.stdout


def test_gpus_without_nvml_prints_nvmls_error(tmp_path):
    out = gpuwatch("gpus", "--nvml-replay", str(README))
    assert out.returncode == 1 and out.stderr.startswith(f"Error: {README} is not a gpuwatch NVML recording")
