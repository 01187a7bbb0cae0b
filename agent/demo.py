"""`gpuwatch demo`: a real agent on GPUs recorded on an H200, for a machine without one.

The agent is the real one (`gpuwatch agent` in a child process) with NVML and the reference
workload replayed from the recordings in the repository's tests/fixtures; eBPF is off, so it
attaches nothing to the host's processes. Its state and control socket live in one directory of
their own, and the CLI is pointed there with GPUWATCH_SOCKET. As root it first runs the reference
workload a few times on each GPU so that `baseline show` and the baselines dashboard have runs.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuwatch.agent.api import GpuwatchError

# The recordings live beside the tests that use them; a wheel does not carry them.
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
NVML_RECORDING = FIXTURES / "nvml-h200.json"
BASELINE_RECORDING = FIXTURES / "baseline-h200.json"
START_TIMEOUT = 30.0
SEED_ROUNDS = 3  # reference-workload runs per GPU before the demo says it is ready


def agent_command(directory: Path, gpus: int, listen: str) -> list[str]:
    for f in (NVML_RECORDING, BASELINE_RECORDING):
        if not f.is_file():
            raise GpuwatchError(f"the demo replays {f}, which is not here: run it from a clone of the gpuwatch "
                                "repository (pip install -e .), or start `gpuwatch agent --nvml-replay FILE` yourself")
    return [sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "",
            "--state-dir", str(directory / "state"), "--runtime-dir", str(directory),
            "--listen", listen, "--nvml-replay", str(NVML_RECORDING), "--nvml-replay-gpus", str(gpus),
            "--baseline-replay", str(BASELINE_RECORDING), "--no-ebpf"]


def _wait_ready(proc: subprocess.Popen, socket_path: str) -> None:
    from gpuwatch.agent import control

    end = time.monotonic() + START_TIMEOUT
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise GpuwatchError(f"the demo agent exited with status {proc.returncode} (its log is above)")
        try:
            if control.call(socket_path, "status", timeout=2.0).get("snapshot_age_seconds") is not None:
                return
        except control.ControlError:
            pass
        time.sleep(0.2)
    raise GpuwatchError(f"the demo agent did not answer on {socket_path} within {START_TIMEOUT:.0f} s")


def _seed(socket_path: str, say) -> None:
    from gpuwatch.agent import control

    if os.geteuid() != 0:
        say("(not root: no reference-workload runs seeded; `baseline show` stays empty until its schedule)")
        return
    for i in range(SEED_ROUNDS):
        say(f"replaying reference-workload run {i + 1}/{SEED_ROUNDS} on each GPU...")
        control.call(socket_path, "baseline.run", {}, timeout=120.0)


def run(directory: Path, gpus: int, listen: str, say) -> int:
    """Start the agent, seed it, say how to use it, and wait for Ctrl-C (or for the agent to exit)."""
    directory.mkdir(parents=True, exist_ok=True)
    socket_path = str(directory / "control.sock")

    def stop(signum, frame):  # SIGTERM as Ctrl-C: the agent is stopped, never left behind
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    # The agent's log goes to our stderr; our own lines to stdout, so `2>/dev/null` leaves the how-to.
    proc = subprocess.Popen(agent_command(directory, gpus, listen), stdin=subprocess.DEVNULL)
    try:
        _wait_ready(proc, socket_path)
        _seed(socket_path, say)
        host, _, port = listen.rpartition(":")
        say("")
        say(f"gpuwatch demo: a real agent on {gpus} replayed H200s (pid {proc.pid}); Ctrl-C stops it.")
        say(f"  metrics:  curl -s http://{host}:{port}/metrics | grep hw_power")
        say(f"  CLI:      export GPUWATCH_SOCKET={socket_path}")
        say("            gpuwatch status; gpuwatch top; gpuwatch findings; gpuwatch baseline show --gpu 0")
        say(f"  Grafana:  scrape {host}:{port} from Prometheus, import dashboards/grafana/*.json")
        say(f"  state:    {directory} (rm -r it when done)")
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
