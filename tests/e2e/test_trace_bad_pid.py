"""`gpuwatch trace --pid` with PIDs it must refuse: a clear message and exit status 1 (2 for usage),
never a traceback, and nothing compiled or attached. No eBPF is used: every refusal comes before.

tests/ebpf/test_trace_cli.py has the same checks beside the real traces (it runs only where the
eBPF environment is complete); these run wherever root is, as root and as user nobody.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from gpuwatch.agent.trace.pids import pid_max

NOBODY = 65534


def trace(*args: str, as_nobody: bool = False, timeout: float = 30) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gpuwatch.agent.cli", "trace", *args]
    if as_nobody:
        if os.geteuid() != 0:
            pytest.skip("needs root to run the CLI as user nobody")
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) not installed")
        cmd = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
    # No agent answers on this socket: a refusal must come before asking one.
    env = dict(os.environ, GPUWATCH_SOCKET="/nonexistent/gpuwatch/control.sock")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd="/", env=env)
    assert "Traceback" not in r.stderr, r.stderr
    assert "compiling" not in r.stderr and "asking the gpuwatch agent" not in r.stderr, r.stderr
    return r


def _free_pid() -> int:
    pid = pid_max() - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def _kthreadd() -> bool:
    try:
        with open("/proc/2/status") as f:
            return f.readline().split()[1:] == ["kthreadd"]
    except OSError:
        return False


CASES = [
    ("0", "PID must be a positive integer (got 0)"),
    ("-1", "PID must be a positive integer (got -1)"),
    ("-99999999999", "PID must be a positive integer"),
    ("pid_max+1", "is above this system's largest PID"),
    ("2**40", "is above this system's largest PID"),
    ("free", "no such process: PID {pid}"),
    ("2", "PID 2 is a kernel thread: it runs no CUDA"),
]


def _value(pid: str) -> str:
    if pid == "2" and not _kthreadd():
        pytest.skip("PID 2 is not kthreadd here (a PID namespace without kernel threads)")
    return {"pid_max+1": str(pid_max() + 1), "2**40": str(2**40),
            "free": str(_free_pid())}.get(pid, pid)


@pytest.mark.parametrize("pid, message", CASES)
def test_bad_pid_exits_1_with_a_message(pid, message):
    value = _value(pid)
    r = trace("--pid", value)
    assert r.returncode == 1, r
    assert r.stderr.startswith("Error: ") and message.format(pid=value) in r.stderr, r.stderr


@pytest.mark.root
@pytest.mark.parametrize("pid, message", CASES)
def test_bad_pid_exits_1_with_a_message_for_a_non_root_caller(pid, message):
    value = _value(pid)
    r = trace("--pid", value, as_nobody=True)
    assert r.returncode == 1, r
    assert r.stderr.startswith("Error: ") and message.format(pid=value) in r.stderr, r.stderr


@pytest.mark.root
def test_another_users_process_is_refused_for_a_non_root_caller():
    p = subprocess.Popen(["sleep", "30"])  # root's
    try:
        r = trace("--pid", str(p.pid), as_nobody=True)
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 1, r
    assert (f"process {p.pid} belongs to user root: you can trace only your own processes (root can trace any)"
            in r.stderr), r.stderr


@pytest.mark.root
def test_pid_1_is_refused_for_a_non_root_caller():
    r = trace("--pid", "1", as_nobody=True)
    assert r.returncode == 1 and "you can trace only your own processes" in r.stderr, r.stderr


@pytest.mark.parametrize("args", [("--pid", "abc"), ("--pid", "1.5"), ("--pid", ""), ("--pid", "0x10"),
                                  ("--pid", "1\n2"), (), ("--pid", "1", "--duration", "0"),
                                  ("--pid", "1", "--duration", "nan"), ("--pid", "1", "--interval", "-1"),
                                  ("--pid", "1", "--interval", "nan")])
def test_usage_errors_exit_2(args):
    r = trace(*args)
    assert r.returncode == 2, r
    assert "Error:" in r.stderr or "Usage:" in r.stderr, r.stderr


_NAMED = """
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, ctypes.c_char_p(bytes.fromhex(sys.argv[1])), 0, 0, 0)  # PR_SET_NAME
print("ready", flush=True)
time.sleep(30)
"""


@pytest.mark.parametrize("name", [b"\x1b[31mred", b"two\nlines", b'q"uo\\te (x)', b"bad\xff\xfeutf8"])
def test_a_hostile_process_name_cannot_forge_terminal_output(name):
    p = subprocess.Popen([sys.executable, "-c", _NAMED, name.hex()], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        r = trace("--pid", str(p.pid))
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 1, r
    (line,) = r.stderr.splitlines()  # one line: no newline smuggled in
    assert "\x1b" not in line and f"process {p.pid} (" in line and "does not use CUDA" in line, line
