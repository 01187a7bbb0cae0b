"""A user's terminal never becomes the agent's, and a signal nobody sends a service is a failure.

Under systemd the agent is a session leader without a controlling terminal: the first terminal it
opened without O_NOCTTY would become its own, and whoever holds the other end could type ^C at it.
The page-cache probe opens the files GPU processes hold (/proc/PID/fd/N), so a GPU process that
swaps such a fd for a pty it holds the master of could stop the agent, exit 0, for good
(Restart=on-failure does not restart a clean exit)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import Agent, nvml_listing, series, wait_for

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")

# Holds a file open as fd N, then (told so) swaps fd N for the slave of a pty of its own, then
# (told so) types ^C, ^Z and ^\ at the pty's master.
ATTACKER = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
print("ready", flush=True)
sys.stdin.readline()
master, slave = os.openpty()
os.dup2(slave, fd)
os.close(slave)
print("swapped", os.ttyname(fd), flush=True)
sys.stdin.readline()
for key in (b"\x03", b"\x1a", b"\x1c"):
    os.write(master, key)
    time.sleep(0.2)
print("typed", flush=True)
sys.stdin.readline()
"""


def tty_nr(pid: int) -> int:
    """The controlling terminal of a process (field 7 of /proc/PID/stat; 0: none)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[4])


def status(agent: Agent) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "status", "--socket", str(agent.socket)],
                          capture_output=True, text=True, timeout=30)


def test_a_pty_swapped_in_for_a_gpu_processs_file_never_becomes_the_agents_terminal():
    top = Path(tempfile.mkdtemp(prefix="gw-pty-"))
    top.chmod(0o755)  # nobody opens the file in it
    big = top / "weights.bin"
    big.write_bytes(b"\1" * (16 << 20))
    big.chmod(0o644)
    attacker = subprocess.Popen([*NOBODY, sys.executable, "-c", ATTACKER, str(big)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd="/")
    agent = None
    try:
        assert attacker.stdout.readline().strip() == "ready"
        # As systemd starts it: a session leader with no controlling terminal, stdin /dev/null.
        agent = Agent(top / "agent", "--nvml-replay", str(nvml_listing(top, [attacker.pid], rate=0)),
                      "--nvml-slow-interval", "1", "--page-cache-min-bytes", str(16 << 20), "--no-ebpf",
                      "--no-baseline", "--no-cupti-sampling", start_new_session=True, stdin=subprocess.DEVNULL)
        assert tty_nr(agent.proc.pid) == 0

        def file_series() -> list[str]:
            return [k for k in series(agent.metrics(), "gpuwatch_process_file_size_bytes")
                    if f'pid="{attacker.pid}"' in k and str(big) in k]

        assert wait_for(file_series, 30, step=0.5), f"the page-cache probe never listed the file:\n{agent.output()}"
        attacker.stdin.write("\n")
        attacker.stdin.flush()
        assert attacker.stdout.readline().startswith("swapped /dev/pts/")
        # The next collection opens what it listed: now the pty. Its series goes once it has looked.
        assert wait_for(lambda: not file_series(), 30, step=0.5), "the page-cache probe did not look again"
        terminal = tty_nr(agent.proc.pid)
        attacker.stdin.write("\n")
        attacker.stdin.flush()
        assert attacker.stdout.readline().strip() == "typed"
        time.sleep(1)
        assert agent.proc.poll() is None, (f"the agent stopped (exit {agent.proc.returncode}, its controlling "
                                           f"terminal was {terminal:#x}):\n{agent.output()[-2000:]}")
        assert terminal == 0 and tty_nr(agent.proc.pid) == 0
        assert 'gpuwatch_probe_up{probe="pagecache"} 1.0' in agent.metrics()
        out = status(agent)
        assert out.returncode == 0 and "nvml" in out.stdout, out.stderr
        assert "shutting down" not in agent.output()
    finally:
        attacker.kill()
        attacker.wait()
        if agent is not None:
            assert agent.stop() == 0, agent.output()[-2000:]
        shutil.rmtree(top, ignore_errors=True)


def test_signals_a_service_is_not_sent_stop_it_as_a_failure_and_sigterm_cleanly(tmp_path):
    args = ("--no-ebpf", "--no-baseline", "--no-cupti-sampling", "--no-host")
    replay = ("--nvml-replay", str(Path(__file__).parents[1] / "fixtures" / "nvml-h200.json"))
    # Not at a terminal (stdin /dev/null), not a session leader: as started by a script.
    service = Agent(tmp_path / "service", *replay, *args, stdin=subprocess.DEVNULL)
    termed = Agent(tmp_path / "termed", *replay, *args, stdin=subprocess.DEVNULL, start_new_session=True)
    # A person at a terminal: stdin is one, and Ctrl-C is theirs to press.
    main, tty = os.openpty()
    person = Agent(tmp_path / "person", *replay, *args, stdin=tty)
    os.close(tty)
    try:
        for a in (service, termed, person):
            a.metrics()
        service.proc.send_signal(signal.SIGTSTP)  # ignored: ^Z does not stop a service
        time.sleep(0.5)
        assert Path(f"/proc/{service.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T"
        service.metrics(timeout=5)
        service.proc.send_signal(signal.SIGINT)
        termed.proc.send_signal(signal.SIGTERM)
        person.proc.send_signal(signal.SIGINT)
        assert service.proc.wait(20) == 128 + signal.SIGINT, service.output()[-2000:]
        assert "stopping on SIGINT" in service.output() and "shutting down" in service.output()
        assert termed.proc.wait(20) == 0, termed.output()[-2000:]
        assert person.proc.wait(20) == 0, person.output()[-2000:]
        assert "stopping on" not in termed.output() + person.output()
    finally:
        for a in (service, termed, person):
            a.stop()
        os.close(main)
