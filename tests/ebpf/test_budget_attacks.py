"""Issue 31, breaks 2 and 3, played as nobody against a real agent (root, real uprobes on the fake
libcuda): a process that makes the agent keep the product of its per-dimension bounds (a graph of
many nodes instantiated many times), and a process that loads many private copies of libcuda.
The agent's budgets (agent/budget.py) are lowered here through their config keys so that a few
seconds prove the bound; bench/budget_attacks.py plays the full-size attacks at the default budget.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuwatch.agent.control import ControlError, call
from gpuwatch.probes.ebpf import loader
from tests.conftest import Agent, series

from .conftest import HERE, _build
from .test_ebpf_graphs import GRAPH_KERNELS, REPLAYS, UNKNOWN_REPLAYS, BEFORE_READY_NODES
from .test_trace_daemon import _wait_probe_up

pytestmark = pytest.mark.root

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
MIB = 1 << 20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def world():
    """The fake libcuda, its driver and the attacker (tests/ebpf/attacker.c), where nobody reaches them."""
    d = Path(tempfile.mkdtemp(prefix="gpuwatch-budget-"))
    try:
        d.chmod(0o755)
        built = _build(d)
        attacker = d / "attacker"
        subprocess.run([shutil.which("gcc") or "cc", "-O1", "-o", str(attacker), str(HERE / "attacker.c"), "-ldl"],
                       check=True)
        yield SimpleNamespace(dir=d, lib=built["lib"], driver=built["driver"], attacker=str(attacker))
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Proc:
    """A process that prints "ready PID" first; say() a line, expect() one back."""

    def __init__(self, *cmd: str) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        line = self.proc.stdout.readline().split()
        assert line[:1] == ["ready"], line
        self.pid = int(line[1])

    def go(self, answer: str = "done") -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _value(text: str, name: str, **labels: str) -> float:
    return sum(v for k, v in series(text, name).items() if all(f'{a}="{b}"' in k for a, b in labels.items()))


def _wait(predicate, what: str, agent: Agent, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, \
            f"{what} within {timeout} s:\n{agent.output()[-3000:]}\n" + \
            "\n".join(line for line in agent.metrics().splitlines() if "graph" in line or "budget" in line)
        time.sleep(0.2)


NODES, EXECS, FLOODERS = 2048, 512, 3  # each flooder: ~1M graph entries, ~55 MB in the agent without a budget


def test_a_graph_flood_is_bounded_to_its_users_share(world):
    """Three processes of nobody each capture a graph of 2,048 distinct nodes and instantiate it
    512 times (each bound of graphs.py holds alone; their product took ~55 MB a process). The
    agent's RSS stays within a few MiB of the budget, nobody's replays past their share are counted
    as of unknown content, the refusal is counted and said once; root's graphs, made after, are
    followed exactly."""
    a = Agent(world.dir / "agent-graphs", "--no-nvml", "--ebpf-library", world.lib,
              env={"GPUWATCH_EBPF_LAUNCH_SAMPLING": "1", "GPUWATCH_BUDGET_GRAPH_KIB_PER_USER": "2048",
                   "GPUWATCH_BUDGET_GRAPH_KIB": "4096"})
    flooders: list[Proc] = []
    try:
        _wait_probe_up(a, "ebpf", timeout=90)
        before = rss(a.proc.pid)
        for _ in range(FLOODERS):
            f = Proc(*NOBODY, world.attacker, "graphs", world.lib, str(NODES), str(EXECS))
            flooders.append(f)
            f.go()
            # every replay counted (as known, partial or unknown) before the next one floods the ring
            _wait(lambda f=f: _value(a.metrics(), "gpuwatch_cuda_graph_launches_total", pid=str(f.pid)) == EXECS,
                  f"all {EXECS} replays of process {f.pid} counted", a)
        grown = rss(a.proc.pid) - before
        print(f"agent RSS {before / MIB:.0f} -> {(before + grown) / MIB:.0f} MiB")
        # without the budget: ~165 MB; with it, the 2 MiB share and what Python keeps around it
        assert grown < 40 * MIB, f"agent RSS grew by {grown / MIB:.0f} MiB"
        text = a.metrics()
        assert _value(text, "gpuwatch_budget_refusals_total", budget="graphs", limit="user") > 0
        assert _value(text, "gpuwatch_budget_used", budget="graphs") <= 4096 * 1024
        for f in flooders:  # followed while there was room, then unknown: never counted as known
            known = _value(text, "gpuwatch_cuda_graph_launches_total", pid=str(f.pid), content="known")
            assert known < EXECS and _value(text, "gpuwatch_cuda_graph_launches_total", pid=str(f.pid)) == EXECS
        # another user (root) made graphs after: their share is their own, every replay exact
        victim = Proc(world.driver, "graphs")
        try:
            victim.go()
            def replays():
                try:  # the first snapshot names kernels (c++filt, the driver's names): it may take a while
                    s = call(str(a.socket), "trace.snapshot", {"pid": victim.pid}, timeout=30)
                except ControlError:
                    return None
                return s if s["graphs"]["launches"] == REPLAYS else None

            snap = _wait(replays, "the victim's replays", a, timeout=60)
            g = snap["graphs"]
            assert (g["partial_content_launches"], g["unknown_content_launches"]) == (0, 0)
            assert g["kernel_launches"] == sum(n for _, n, _ in GRAPH_KERNELS.values()) + \
                UNKNOWN_REPLAYS * BEFORE_READY_NODES
        finally:
            victim.stop()
        said = [line for line in a.output().splitlines() if "budget graphs:" in line]
        assert len(said) == 1 and "user 65534" in said[0], said
    finally:
        for f in flooders:
            f.stop()
        a.stop()


class LimitedAgent(Agent):
    """An agent started under a low open-files limit (prlimit), as a unit's LimitNOFILE sets one."""

    def __init__(self, tmp: Path, nofile: int, *args: str, env: dict | None = None) -> None:
        real = subprocess.Popen
        subprocess.Popen = lambda cmd, **kw: real(["prlimit", f"--nofile={nofile}", "--", *cmd], **kw)
        try:
            super().__init__(tmp, *args, env=env)
        finally:
            subprocess.Popen = real


COPIES, NOFILE = 100, 256  # without the budget: ~3 fds a copy, past the limit


def test_private_copies_of_libcuda_are_capped(world):
    """nobody loads 100 private copies of libcuda (RTLD_LOCAL, 100 inodes) and the agent, under a
    256-file limit, scans for libraries: 4 of them are attached (nobody's share here), the rest
    refused, counted and said once; the agent's fds stay far below the limit, the control socket
    and /metrics answer, and it stops cleanly on SIGTERM."""
    copies = world.dir / "copies"
    copies.mkdir()
    for i in range(COPIES):
        (copies / str(i)).mkdir()
        shutil.copy(world.lib, copies / str(i) / "libcuda.so.1")
    subprocess.run(["chown", "-R", "65534:65534", str(copies)], check=True)
    attacker = Proc(*NOBODY, world.attacker, "copies", str(copies), str(COPIES))
    a = LimitedAgent(world.dir / "agent-copies", NOFILE, "--no-nvml", "--no-host",
                     env={"GPUWATCH_BUDGET_LIBRARIES_PER_USER": "4", "GPUWATCH_BUDGET_LIBRARIES": "64",
                          "GPUWATCH_BUDGET_UPROBES": "100000"})
    try:
        _wait_probe_up(a, "ebpf", timeout=90)
        snap = call(str(a.socket), "trace.snapshot", {"pid": attacker.pid})
        mine = [lib for lib in snap["libraries"] if lib["path"].startswith(str(copies))]
        assert len(mine) == 4, [lib["path"] for lib in snap["libraries"]]
        assert sum(lib["uprobes"] for lib in mine) <= 4 * 200
        assert fds(a.proc.pid) < NOFILE // 2
        _wait(lambda: _value(a.metrics(), "gpuwatch_budget_refusals_total", budget="libraries", limit="user")
              >= COPIES - 4, "the refusals counted", a)  # at the budget's next collection
        assert call(str(a.socket), "status")["probes"]["ebpf"]["state"] == "up"
        said = [line for line in a.output().splitlines() if "budget libraries:" in line]
        assert len(said) == 1 and "user 65534" in said[0], said
        assert not [line for line in a.output().splitlines() if "cannot accept" in line or "Errno 24" in line]
        # the refused copies were never read: only the admitted ones have a symbol table in the eBPF
        # cache (which keeps at most MAX_SYMBOL_FILES, however many copies come and go)
        cache = os.listdir(os.environ["GPUWATCH_BPF_CACHE"])
        tabled = [i for i in range(COPIES)
                  if loader.symbols_cache_name(os.stat(copies / str(i) / "libcuda.so.1"))[1] in cache]
        assert len(tabled) == 4 and sum(n.startswith("symbols-") for n in cache) <= loader.MAX_SYMBOL_FILES
    finally:
        attacker.stop()
        rc = a.stop()
    assert rc == 0, a.output()[-3000:]  # stopped on SIGTERM within Agent.stop's wait, not killed
