"""`gpuwatch trace`'s live view in a real terminal: tmux at 80x24, read back with capture-pane.

The traced process is driver.c's "loop" (it calls without end), so the view has live numbers;
the trace itself is the CLI as a subprocess in the tmux pane, uprobes real (root).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[2]
WIDTH, HEIGHT = 80, 24


class Pane:
    """One tmux server of our own (-L) with one WIDTHxHEIGHT window running `command`."""

    def __init__(self, command: str) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux is not installed: apt-get install tmux (scripts/setup --test installs it)")
        self.sock = f"gwtest-{os.getpid()}-{time.monotonic_ns()}"
        self._tmux("new-session", "-d", "-s", "t", "-x", str(WIDTH), "-y", str(HEIGHT), command)

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.sock, *args], check=True, capture_output=True, text=True,
                              timeout=10).stdout

    def lines(self, joined: bool = False) -> list[str]:
        """The screen's lines; joined: lines the terminal wrapped put back together (-J)."""
        return self._tmux("capture-pane", "-p", *(["-J"] if joined else []), "-t", "t").rstrip("\n").split("\n")

    def history(self) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "t")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def wait_for(self, text: str, timeout: float) -> float:
        t0 = time.monotonic()
        while text not in self.history():
            assert time.monotonic() - t0 < timeout, f"{text!r} not seen:\n{self.history()}"
            time.sleep(0.05)
        return time.monotonic() - t0

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def pane():
    panes: list[Pane] = []

    def start(command: str) -> Pane:
        p = Pane(command)
        panes.append(p)
        return p

    yield start
    for p in panes:
        p.close()


def _start(fake_cuda, drivers, pane, interval: float = 0.2):
    d = drivers(None, "loop")
    cmd = (f"cd {REPO} && {sys.executable} -m gpuwatch.agent.cli trace --pid {d.pid} --library {fake_cuda['lib']} "
           f"--interval {interval}; echo EXIT=$?; stty -a; sleep 60")
    p = pane(cmd)
    p.wait_for(f"trace PID {d.pid} (driver) · ", 60)  # attached: the live view is up
    d.go()
    return d, p


def _screen_fits(p: Pane, pid: int) -> None:
    deadline = time.monotonic() + 10
    while True:  # a refresh with the workload's calls and the kernel named
        screen, joined = p.lines(), p.lines(joined=True)
        if p.lines() == screen and any(line.startswith("add_kernel(float*, int)") for line in screen):
            break  # (the same screen before and after: no refresh came between the two captures)
        assert time.monotonic() < deadline, "\n".join(screen)
        time.sleep(0.1)
    text = "\n".join(screen)
    head = [line for line in screen if line.startswith(f"trace PID {pid} (driver) · ")]
    assert len(head) == 1 and head[0].endswith(" uprobes"), text  # the header, whole, on one line
    # the live view, from its header down (above it: what was printed before, the startup line)
    view = screen[screen.index(head[0]):]
    assert joined[len(joined) - len(view):] == view, text  # no line of it wrapped by the terminal
    assert all(len(line) <= WIDTH for line in view), text
    rows = [line for line in view if line.strip()]
    assert len(rows) <= HEIGHT
    assert rows[-1].startswith("q or Ctrl-C: stop") and sum("Ctrl-C" in line for line in rows) == 1, text
    assert sum(line.startswith(("cuMemAlloc_v2 ", "cuLaunchKernel ", "cuMemFree_v2 ", "cuStreamSynchronize "))
               for line in rows) == 4, text
    assert any(line.startswith("device memory: ") for line in rows), text


def _restored(p: Pane) -> None:
    p.wait_for("speed", 10)  # stty -a after the trace exited: the terminal is as it was
    stty = p.history()[p.history().index("EXIT="):]
    assert " icanon " in f" {stty} " and " echo " in f" {stty} ", stty


def test_live_view_fits_80x24_and_q_quits(fake_cuda, drivers, pane):
    d, p = _start(fake_cuda, drivers, pane)
    try:
        _screen_fits(p, d.pid)
        p.keys("q")
        took = p.wait_for("ended: q pressed after ", 5)
        assert took < 1.5, took
        p.wait_for("EXIT=0", 10)
        _restored(p)
        history = p.history()
        assert "Traceback" not in history
        # the startup line said what it was doing until the probe was up, then went
        assert f"tracing PID {d.pid} (driver)" in history and "loading the eBPF probe" not in history, history
        assert d.proc.poll() is None  # q stops the trace, not the traced process
    finally:
        d.proc.kill()


def test_ctrl_c_still_ends_the_live_view(fake_cuda, drivers, pane):
    d, p = _start(fake_cuda, drivers, pane)
    try:
        _screen_fits(p, d.pid)
        p.keys("C-c")
        p.wait_for("ended: interrupted (Ctrl-C or SIGTERM) after ", 5)
        p.wait_for("EXIT=0", 10)
        _restored(p)
        assert "Traceback" not in p.history()
    finally:
        d.proc.kill()


# ---- under load ----------------------------------------------------------------------------------
MEMORY = re.compile(r"device memory: .+? in (\d+) live · (\d+) allocations, (\d+) frees$")
KERNEL_ROW = re.compile(r"add_kernel\(float\*, int\)\s+\d+\s+(\d+)\s")


@pytest.fixture
def cpu_burners():
    """Two busy-looping neighbours (as many as CI's cores) for the test's duration: the trace and
    tmux get the CPU late, as in a full suite run on a busy machine."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in procs:
        p.kill()
        p.wait()


def _check_frame(screen: list[str]) -> bool:
    """One frame of the live view agrees with itself: the kernel table's launches are no more than
    the cuLaunchKernel calls, and the live allocations are the allocations less the frees (the
    loop's allocations all start after the trace attached). True when it had all those numbers."""
    text = "\n".join(screen)
    calls = [int(line.split()[2]) for line in screen if line.startswith("cuLaunchKernel ")]  # API, calls/s, calls
    launches = [int(m.group(1)) for m in map(KERNEL_ROW.match, screen) if m]
    if calls and launches:
        assert len(calls) == 1 and sum(launches) <= calls[0], (sum(launches), calls, text)
    memory = [[int(g) for g in m.groups()] for m in map(MEMORY.match, screen) if m]
    if memory:
        (live, allocations, frees), = memory
        assert live == allocations - frees, (live, allocations, frees, text)
    return bool(calls and launches and memory)


def test_live_view_is_one_consistent_frame_under_load(fake_cuda, drivers, pane, cpu_burners):
    """With the CPU taken by two neighbours, every frame captured is one frame (one header, one
    footer, nothing wrapped, inside 80x24) and agrees with itself (_check_frame)."""
    d, p = _start(fake_cuda, drivers, pane, interval=0.5)  # time for three captures between refreshes
    try:
        checked, stood_still, deadline, screen = 0, 0, time.monotonic() + 6, []
        while time.monotonic() < deadline or checked < 5:
            assert time.monotonic() < deadline + 20, \
                f"{checked} frames with the workload's numbers in 26 s ({stood_still} stood still):\n" + "\n".join(screen)
            screen, joined = p.lines(), p.lines(joined=True)
            if p.lines() != screen:
                continue  # a refresh came in between: compare only screens that stood still
            stood_still += 1
            text = "\n".join(screen)
            head = [line for line in screen if line.startswith(f"trace PID {d.pid} (driver) · ")]
            assert len(head) == 1, text  # one frame: not two stacked
            view = screen[screen.index(head[0]):]  # above it: the lines printed before the view
            assert sum(line.startswith("q or Ctrl-C: stop") for line in view) == 1, text
            assert all(len(line) <= WIDTH for line in view), text
            assert joined[len(joined) - len(view):] == view, text  # no line of it wrapped by the terminal
            if _check_frame(screen):
                checked += 1
            time.sleep(0.05)
        p.keys("q")
        p.wait_for("EXIT=0", 20)
        assert "Traceback" not in p.history()
    finally:
        d.proc.kill()
