"""`gpuwatch trace --pid` as an ordinary user, through a real agent: the agent (a subprocess, its eBPF
probe on a fake libcuda.so.1) counts every process, and nobody (uid and gid 65534) traces its own
driver (tests/ebpf/driver.c) through the control socket. Counts must be exactly driver.c's, counted
from the start of the trace.

The library, the driver and the agent's runtime directory live in a directory nobody can reach
(pytest's own temporary directories are root's alone). One agent serves the module: starting it
compiles the probe (~3 s), stopping it detaches the uprobes (~0.1 s each).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuwatch.agent.trace.pids import pid_max
from gpuwatch.agent.control import ControlError, call
from gpuwatch.agent.trace.output import read_summary
from tests.conftest import Agent
from . import test_ebpf_cuda as _base
from .conftest import _build, count_drops
from .test_ebpf_cuda import EXPECTED, LIVE_ALLOCATIONS, LIVE_BYTES
from .test_trace_cli import ALLOCATIONS, FREES, Collected, _assert_exact

pytestmark = pytest.mark.root

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
TRACE = (sys.executable, "-m", "gpuwatch.agent.cli", "trace")
KERNELS = getattr(_base, "KERNELS", None)
ERRORS_BY_CODE = getattr(_base, "ERRORS_BY_CODE", None)
TOTAL_CALLS = sum(c for c, _, _ in EXPECTED.values())


class AsNobody(Collected):
    """A command run as nobody."""

    def __init__(self, *cmd: str) -> None:
        super().__init__([*NOBODY, *cmd], cwd="/", stdin=subprocess.DEVNULL)

    def wait_for(self, text: str, lines: list[str], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in lines):
            if self.proc.poll() is not None:
                for t in self._threads:
                    t.join(5)
                assert any(text in line for line in lines), f"exited without {text!r}:\n{self.output}"
                return
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.output}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def world():
    """The fake library and driver, and a directory nobody may write summaries to, all reachable by nobody."""
    d = Path(tempfile.mkdtemp(prefix="gpuwatch-trace-daemon-"))
    try:
        d.chmod(0o755)
        built = _build(d)
        out = d / "out"
        out.mkdir()
        os.chown(out, 65534, 65534)
        yield SimpleNamespace(dir=d, lib=built["lib"], driver=built["driver"], out=out)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _wait_probe_up(agent: Agent, probe: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        try:
            state = call(str(agent.socket), "status")["probes"].get(probe, {})
            if state.get("state") == "up":
                return
        except ControlError:
            pass  # not listening yet
        time.sleep(0.1)
    raise AssertionError(f"the agent's {probe} probe is not up after {timeout} s ({state}):\n{agent.output()}")


@pytest.fixture(scope="module")
def agent(world):
    """An agent whose eBPF probe is on the fake library; its control socket open to group nogroup (65534)."""
    a = Agent(world.dir / "agent", "--no-nvml", "--ebpf-library", world.lib, "--socket-group", "65534")
    try:
        _wait_probe_up(a, "ebpf")
        yield a
    finally:
        a.stop()


def _trace(agent_socket, *args: str) -> AsNobody:
    return AsNobody(*TRACE, "--socket", str(agent_socket), *args)


def _ask_as_nobody(agent_socket, pid: int) -> str:
    """trace.snapshot asked by nobody directly, without the client's own checks: the agent's answer."""
    code = ("import sys; from gpuwatch.agent.control import ControlError, call\n"
            f"try: call({str(agent_socket)!r}, 'trace.snapshot', {{'pid': {pid}}}); print('answered')\n"
            "except ControlError as e: print(e)")
    p = AsNobody(sys.executable, "-c", code)
    assert p.wait() == 0, p.output
    return p.stdout.strip()


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "30"])
    yield p
    p.kill()
    p.wait()


def test_own_process_counts_exact_from_the_start_of_the_trace(agent, world, drivers):
    # "early": kernel C's handle is fetched before "ready", so before the trace: the agent counts
    # that call (it was attached already), the trace must not
    d = drivers(*NOBODY, world.driver, "early")
    out = world.out / "duration.json"
    t = _trace(agent.socket, "--pid", str(d.pid), "--summary-json", str(out), "--duration", "3", "--interval", "0.5")
    t.wait_for("tracing PID", t.err)
    d.go()
    assert t.wait() == 0, t.output
    summary = read_summary(str(out))
    assert summary["ended"] == "duration" and 2.9 <= summary["duration_seconds"] < 4.5
    assert summary["pid"] == d.pid and summary["process"] == "driver"
    calls, errors, nbytes = EXPECTED["cuModuleGetFunction"]
    expected = dict(EXPECTED, cuModuleGetFunction=(calls - 1, errors, nbytes))
    assert {api: (a["calls"], a["errors"], a["bytes"]) for api, a in summary["apis"].items()} == expected
    if ERRORS_BY_CODE is not None:
        assert {api: a["errors_by_code"] for api, a in summary["apis"].items() if a["errors_by_code"]} == ERRORS_BY_CODE
    assert summary["memory"] == {"live_bytes": LIVE_BYTES, "live_allocations": LIVE_ALLOCATIONS,
                                 "allocations": ALLOCATIONS, "frees": FREES}
    assert count_drops(summary) == {}
    assert summary["apis"]["cuMemAlloc_v2"]["mean_latency_s"] > 0
    assert summary["apis"]["cuMemAlloc_v2"]["p50_latency_s"] <= summary["apis"]["cuMemAlloc_v2"]["p99_latency_s"]
    if KERNELS is not None:
        assert _base.unstacked(summary["kernels"]) == KERNELS  # C named too: the agent saw it fetched
    assert f"asking the gpuwatch agent on {agent.socket}…" in t.stderr
    assert f"tracing PID {d.pid} (driver) through the gpuwatch agent: " in t.stderr
    assert f"calls {TOTAL_CALLS - 1} " in [line for line in t.out if line.startswith("[")][-1]
    assert "compiling" not in t.stderr and "detaching" not in t.stderr and "Traceback" not in t.stderr
    assert d.finish() == 0


def test_process_exit_ends_the_trace_with_the_last_counts(agent, world, drivers):
    d = drivers(*NOBODY, world.driver)
    out = world.out / "exit.json"
    t = _trace(agent.socket, "--pid", str(d.pid), "--summary-json", str(out), "--interval", "0.2")
    t.wait_for("tracing PID", t.err)
    d.go()
    t.wait_for(f"calls {TOTAL_CALLS} ", t.out)  # a refresh has seen the whole workload
    assert d.finish() == 0
    assert t.wait() == 0, t.output
    summary = read_summary(str(out))
    assert summary["ended"] == "process exited"
    _assert_exact(summary, d.pid)
    assert "Traceback" not in t.stderr


def test_wait_until_the_process_loads_libcuda(agent, world):
    code = f"import ctypes, time; time.sleep(0.5); ctypes.CDLL({world.lib!r}); time.sleep(30)"
    p = AsNobody(sys.executable, "-c", code)
    try:
        time.sleep(0.1)
        t = _trace(agent.socket, "--pid", str(p.proc.pid), "--wait", "--duration", "0.5")
        assert t.wait() == 0, t.output
        assert "waiting for process" in t.stderr and "through the gpuwatch agent" in t.stderr
        assert re.search(r"ended after [0-9.]+ s \(--duration\)", t.stdout), t.stdout
    finally:
        p.proc.kill()
        p.wait()


def test_another_users_process_is_refused(agent, sleeper):
    t = _trace(agent.socket, "--pid", str(sleeper.pid))
    assert t.wait() == 1
    assert (f"process {sleeper.pid} belongs to user root: you can trace only your own processes (root can "
            f"trace any)") in t.stderr and "Traceback" not in t.stderr
    # the agent refuses on its own, whatever the client checked
    assert _ask_as_nobody(agent.socket, sleeper.pid) == (f"process {sleeper.pid} belongs to user root: you can "
                                                         f"trace only your own processes")


def test_agent_answers_what_is_wrong(agent, sleeper):
    sock = str(agent.socket)
    for params, message in [({"pid": "1"}, "trace.snapshot refused: pid: must be an integer from 1 to 4194304, got '1'"),
                            ({"pid": pid_max() + 1}, "is above this system's largest PID"),
                            ({"pid": sleeper.pid}, f"process {sleeper.pid} (sleep) does not use CUDA")]:
        with pytest.raises(ControlError) as e:
            call(sock, "trace.snapshot", params)
        assert message in str(e.value)


def test_agent_without_the_ebpf_probe_says_so(tmp_path, drivers, world):
    a = Agent(tmp_path / "no-ebpf", "--no-nvml", "--no-ebpf")
    try:
        deadline = time.monotonic() + 20
        while not a.socket.exists():
            assert time.monotonic() < deadline and a.proc.poll() is None, a.output()
            time.sleep(0.1)
        d = drivers(*NOBODY, world.driver)
        with pytest.raises(ControlError, match=r"this gpuwatch agent does not run the eBPF probe \(ebpf.enabled is "
                                               r"false in its config\)"):
            call(str(a.socket), "trace.snapshot", {"pid": d.pid})
    finally:
        a.stop()


def test_no_agent_says_run_as_root_or_start_it(world, drivers):
    d = drivers(*NOBODY, world.driver)
    none = world.dir / "none.sock"
    t = _trace(none, "--pid", str(d.pid))
    assert t.wait() == 1
    assert f"attaching eBPF uprobes to process {d.pid} needs root, and the gpuwatch agent cannot be asked" in t.stderr
    assert f"no gpuwatch agent is listening on {none}" in t.stderr
    assert ("run as root, or start the gpuwatch daemon (systemctl start gpuwatch) to trace your own processes"
            in t.stderr)
    t = _trace(none, "--pid", str(d.pid), "--library", world.lib)
    assert t.wait() == 1 and "--library needs root" in t.stderr and "Traceback" not in t.stderr


def test_graphs_built_before_the_trace_are_known_through_the_agent(world, drivers):
    """The agent follows graphs from a process's first call: a trace through it, begun after a
    graph was captured and instantiated, counts that graph's kernels too."""
    from .test_ebpf_graphs import BEFORE_READY_NODES, GRAPH_KERNELS, REPLAYS, UNKNOWN_REPLAYS, A
    # every launch probed (no duty cycle): the capture before the trace is whole, deterministically
    a = Agent(world.dir / "agent-graphs", "--no-nvml", "--ebpf-library", world.lib, "--socket-group", "65534",
              "--ebpf-launch-sampling", "1")
    try:
        _wait_probe_up(a, "ebpf")
        d = drivers(*NOBODY, world.driver, "graphs")
        out = world.out / "graphs.json"
        t = _trace(a.socket, "-p", str(d.pid), "--summary-json", str(out), "--interval", "0.2")
        t.wait_for("tracing PID", t.err)
        d.go()
        t.wait_for(f"graphs {REPLAYS} replays", t.out)  # a refresh has seen the whole workload
        assert d.finish() == 0
        assert t.wait() == 0, t.output
    finally:
        a.stop()
    summary = read_summary(str(out))
    g = summary["graphs"]
    assert (g["launches"], g["unknown_content_launches"], g["partial_content_launches"]) == (REPLAYS, 0, 0)
    kernels = {k["handle"]: k["graph_launches"] for k in summary["kernels"]}
    want = {h: v[1] for h, v in GRAPH_KERNELS.items()}
    want[A] += UNKNOWN_REPLAYS * BEFORE_READY_NODES  # the graph made before the trace: known to the agent
    assert kernels == want
    assert g["kernel_launches"] == sum(want.values())
