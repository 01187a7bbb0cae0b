"""The agent says at start which probe, or part of one, is off for which missing capability.

Runs the real agent (NVML replayed, eBPF off) under setpriv with a reduced capability bounding set.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import FIXTURE, free_port, wait_http

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                 reason="needs root and setpriv to start the agent with fewer capabilities")]


def test_missing_cap_chown_is_named_at_start_and_the_agent_serves(tmp_path):
    port = free_port()
    log = tmp_path / "agent.log"
    cmd = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-m", "gpuwatch.agent.cli", "agent",
           "--config", "", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state"),
           "--runtime-dir", str(tmp_path / "run"), "--nvml-replay", str(FIXTURE), "--no-ebpf",
           "--no-cupti-sampling", "--no-baseline", "--socket-group", "0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 30
        while b"hw_power_watts" not in wait_http(f"http://127.0.0.1:{port}/metrics", 30, proc):
            assert time.monotonic() < end, log.read_text()  # the first answer may come before the first snapshot
            time.sleep(0.1)
        end = time.monotonic() + 20
        while "missing capability" not in log.read_text() and time.monotonic() < end:
            time.sleep(0.1)
        text = log.read_text()
        assert "missing capability CAP_CHOWN (control.group): the control socket cannot be given" in text, text
        assert "(eBPF probe" not in text, text  # eBPF is off: its capabilities are not asked for
    finally:
        proc.terminate()
        proc.wait(10)
    assert "Traceback" not in log.read_text()
