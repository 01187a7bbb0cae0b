"""`gpuwatch leaks` and `gpuwatch findings` against a real agent (NVML replayed from the H200)."""
import json
import subprocess
import sys

import pytest

from gpuwatch.agent import control
from tests.conftest import FIXTURE


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
    with pytest.raises(control.ControlError, match=r'findings takes \{"kind": "memory_leak"\} or nothing'):
        control.call(str(agent.socket), "findings", {"kind": 3})


def test_leaks_without_an_agent_says_so(tmp_path):
    out = gpuwatch("leaks", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 1 and "no gpuwatch agent is listening" in out.stderr
