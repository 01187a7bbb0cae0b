"""Issue 35 item 8, against real agents: `status` lists processes in GPU order; `top` with no agent
where it looks names the agents that run (as `status` does)."""
import os
import re
import subprocess
import sys

from tests.conftest import FIXTURE, wait_for


def gpuwatch(*args):
    return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, COLUMNS="200"))


def test_status_lists_processes_in_gpu_order(agent_factory):
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--nvml-replay-gpus", "8", "--no-ebpf", "--no-baseline")
    agent.metrics()

    def gpus_of_425():
        out = gpuwatch("status", "--socket", str(agent.socket)).stdout
        rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+425\s", line)]
        return [int(r[0]) for r in rows] if len(rows) == 8 else None
    order = wait_for(gpus_of_425, 20, 0.5)
    assert order == list(range(8)), order  # was 7, 0, 2, 3, 1, ...


def test_top_without_an_agent_names_the_ones_that_run(agent_factory, tmp_path):
    agent = agent_factory("--no-nvml", "--no-ebpf", "--no-baseline")
    agent.metrics()
    out = gpuwatch("top", "--socket", str(tmp_path / "none.sock"), "--once")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    # was: "no gpuwatch agent is listening on ... (is `gpuwatch agent` / the gpuwatch service running?)"
    assert f"the agent pid {agent.proc.pid} listens on {agent.socket}" in out.stderr, out.stderr
    assert "gpuwatch top --standalone" in out.stderr
