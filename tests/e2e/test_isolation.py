"""Issue 35 item 9: the tests never see an agent they did not start. An agent that is not this
run's descendant (as another engineer's, or the host's service, is) must not change what the
CLI tells a test."""
import os
import signal
import subprocess
import sys
import time

import psutil

from tests.conftest import free_port, wait_for
from tests.unit.test_cli_errors import test_a_refusal_of_the_agent_is_one_line_and_exit_1


def test_an_agent_this_run_did_not_start_is_not_named(tmp_path):
    run = tmp_path / "foreign-run"
    # setsid -f: the agent's parent exits at once, so it is nobody's child here, as a stranger's agent is
    subprocess.run(["setsid", "-f", sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "",
                    "--no-nvml", "--no-ebpf", "--no-baseline", "--listen", f"127.0.0.1:{free_port()}",
                    "--state-dir", str(tmp_path / "foreign-state"), "--runtime-dir", str(run)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def foreign():
        return [p for p in psutil.process_iter(["cmdline"]) if str(run) in (p.info["cmdline"] or [])]

    try:
        assert wait_for(lambda: (run / "control.sock").exists(), 20), "the foreign agent did not start"
        assert os.getpid() not in [a.pid for a in foreign()[0].parents()]
        test_a_refusal_of_the_agent_is_one_line_and_exit_1(tmp_path)
    finally:
        for p in foreign():
            os.kill(p.pid, signal.SIGTERM)
        wait_for(lambda: not foreign(), 10)
