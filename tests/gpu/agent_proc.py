"""A real `gpuwatch agent` for the tests/gpu checks: real NVML, on a private socket and port, the
reference workload and device-wide CUPTI sampling off (they would share the GPU with the check's
jobs), its log in WORK/agent.log."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from gpuwatch.agent import control


def start_agent(work: str, port: int, ebpf: bool = False) -> tuple[subprocess.Popen, str]:
    """(the agent, its control socket) once it answers; SystemExit naming its log when it does not."""
    sock = os.path.join(work, "run", "control.sock")
    p = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "", "--listen",
                          f"127.0.0.1:{port}", "--state-dir", os.path.join(work, "state"), "--runtime-dir",
                          os.path.join(work, "run"), *([] if ebpf else ["--no-ebpf"]), "--no-cupti-sampling",
                          "--no-baseline"],
                         stdout=open(os.path.join(work, "agent.log"), "w"), stderr=subprocess.STDOUT)
    for _ in range(100):
        try:
            control.call(sock, "ping", timeout=1)
            return p, sock
        except control.ControlError:
            time.sleep(0.2)
    raise SystemExit(f"the agent did not answer on {sock}; see {work}/agent.log")
