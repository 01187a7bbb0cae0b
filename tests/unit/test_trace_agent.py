"""`gpuwatch trace` through the agent, without eBPF: the arithmetic that counts from the start of a
trace (since()), the client (AgentTrace) against a real control socket with a scripted agent, and
the agent's trace.snapshot handler with a stand-in for the eBPF probe (who may read what, what it
says when the probe is down, busy or restarting). tests/ebpf/test_trace_daemon.py does it for real.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from gpuwatch.agent import config as config_mod
from gpuwatch.agent import daemon as daemon_mod
from gpuwatch.agent import trace
from gpuwatch.agent.api import Probe, ProbeUnavailable
from gpuwatch.agent.control import ControlError, ControlServer, PeerCred
from gpuwatch.probes.ebpf import loader


def _api(calls, errors=0, nbytes=0, ns=0, hist=None, by_code=None):
    return {"calls": calls, "errors": errors, "bytes": nbytes, "seconds": ns * 1e-9,
            "mean_latency_s": ns * 1e-9 / calls if calls else 0.0, "histogram": hist or {}, "timed": True,
            "errors_by_code": by_code or {}}


START = {
    "pid": 7,
    "apis": {"cuMemAlloc_v2": _api(10, 2, 1000, 5000, {"10": 8, "12": 2}, {"CUDA_ERROR_OUT_OF_MEMORY": 2}),
             "cuCtxSynchronize": _api(4, ns=400, hist={"7": 4})},
    "memory": {"live_bytes": 600, "live_allocations": 6, "allocations": 8, "frees": 2},
    "kernels": [{"handle": "0xa000", "name": None, "launches": 50, "degenerate_launches": 1, "grid": [1, 1, 1],
                 "block": [32, 1, 1], "shared_mem_bytes": 0, "stream": "0x1", "name_source": None}],
    "dropped_events": 3,
    "libraries": [{"path": "/usr/lib/libcuda.so.1", "attached": ["cuMemAlloc_v2"], "skipped": [], "uprobes": 2}],
}
NOW = {
    "pid": 7,
    "apis": {"cuMemAlloc_v2": _api(15, 3, 1500, 8000, {"10": 11, "12": 2, "13": 2},
                                   {"CUDA_ERROR_OUT_OF_MEMORY": 2, "CUDA_ERROR_INVALID_VALUE": 1}),
             "cuCtxSynchronize": _api(4, ns=400, hist={"7": 4}),
             "cuMemFree_v2": _api(3, nbytes=300, ns=300, hist={"6": 3})},
    "memory": {"live_bytes": 800, "live_allocations": 5, "allocations": 12, "frees": 5},
    "kernels": [{"handle": "0xb000", "name": "gemm", "launches": 9, "degenerate_launches": 0, "grid": [4, 1, 1],
                 "block": [64, 1, 1], "shared_mem_bytes": 16, "stream": "0x2", "name_source": "hook"},
                {"handle": "0xa000", "name": "add", "launches": 57, "degenerate_launches": 3, "grid": [2, 1, 1],
                 "block": [32, 1, 1], "shared_mem_bytes": 0, "stream": "0x1", "name_source": "hook"}],
    "dropped_events": 3,
    "libraries": START["libraries"],
    "stacks": [{"bytes": 800, "frames": ["a", "b"]}],
}


# ---- since(): counted from the start of the trace -------------------------------------------------
def test_since_subtracts_counts_and_keeps_state():
    d = trace.since(NOW, START)
    alloc = d["apis"]["cuMemAlloc_v2"]
    assert (alloc["calls"], alloc["errors"], alloc["bytes"]) == (5, 1, 500)
    assert alloc["seconds"] == pytest.approx(3000e-9) and alloc["mean_latency_s"] == pytest.approx(600e-9)
    assert alloc["histogram"] == {10: 3, 13: 2}  # slots back as integers, empty ones left out
    assert alloc["errors_by_code"] == {"CUDA_ERROR_INVALID_VALUE": 1}
    assert alloc["timed"] is True
    assert "cuCtxSynchronize" not in d["apis"]  # not called during the trace
    assert d["apis"]["cuMemFree_v2"]["calls"] == 3 and d["apis"]["cuMemFree_v2"]["histogram"] == {6: 3}
    # live memory is the process's state now; allocations and frees happened during the trace
    assert d["memory"] == {"live_bytes": 800, "live_allocations": 5, "allocations": 4, "frees": 3}
    assert [(k["handle"], k["launches"], k["degenerate_launches"], k["name"], k["grid"]) for k in d["kernels"]] == [
        ("0xb000", 9, 0, "gemm", [4, 1, 1]), ("0xa000", 7, 2, "add", [2, 1, 1])]
    assert d["dropped_events"] == 0
    assert d["stacks"] == NOW["stacks"] and d["libraries"] == NOW["libraries"] and d["pid"] == 7
    assert NOW["apis"]["cuMemAlloc_v2"]["calls"] == 15  # the inputs are left alone


def test_since_itself_is_nothing_and_summarizes_like_a_fresh_probe():
    d = trace.since(NOW, NOW)
    assert d["apis"] == {} and d["kernels"] == [] and d["dropped_events"] == 0
    assert (d["memory"]["allocations"], d["memory"]["frees"]) == (0, 0)
    s = trace.summarize(trace.since(NOW, START), pid=7, process="x", duration=1.0, ended="duration")
    assert s["apis"]["cuMemAlloc_v2"]["p50_latency_s"] == 2 ** 10 * 1e-9
    assert s["apis"]["cuMemAlloc_v2"]["p99_latency_s"] == 2 ** 13 * 1e-9
    assert trace.totals(trace.since(NOW, START)) == (8, 1)


@pytest.mark.parametrize("now", [
    dict(START, apis={"cuMemAlloc_v2": _api(1), "cuCtxSynchronize": _api(4)}),  # fewer calls than at start
    dict(START, apis={"cuMemAlloc_v2": START["apis"]["cuMemAlloc_v2"]}),  # an API gone
    dict(START, kernels=[dict(START["kernels"][0], launches=3)]),
])
def test_since_counts_going_down_mean_the_agents_probe_restarted(now):
    with pytest.raises(trace.TraceError, match="restarted during the trace"):
        trace.since(now, START)


# ---- AgentTrace: the client, against a scripted agent ----------------------------------------------
@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "30"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def scripted(tmp_path):
    """A control socket whose trace.snapshot answers from a list (the last answer repeats)."""
    answers: list = []
    asked: list[dict] = []

    def snapshot(params, peer):
        asked.append(params)
        a = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(a, Exception):
            raise a
        return a

    server = ControlServer(str(tmp_path / "control.sock"), {"ping": lambda p, c: "pong", "trace.snapshot": snapshot})
    server.start()
    yield SimpleNamespace(path=server.path, answers=answers, asked=asked)
    server.stop()


def _target(p) -> trace.Target:
    return trace.Target(p.pid, "sleep", loader.read_stat(p.pid).start_time)


def test_agent_trace_counts_from_start(scripted, sleeper):
    scripted.answers[:] = [START, NOW]
    t = trace.AgentTrace(scripted.path, _target(sleeper))
    t.start()
    assert t.attached() == START["libraries"]
    snap = t.snapshot(sleeper.pid)
    assert snap == trace.since(NOW, START)
    assert scripted.asked == [{"pid": sleeper.pid}] * 2


def test_agent_trace_after_the_process_exits_keeps_the_last_counts(scripted, sleeper):
    scripted.answers[:] = [START, NOW, ControlError(f"no such process: PID {sleeper.pid}")]
    t = trace.AgentTrace(scripted.path, _target(sleeper))
    t.start()
    last = t.snapshot(sleeper.pid)
    with pytest.raises(trace.TraceError, match="no such process"):  # while it runs, an error is an error
        t.snapshot(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    assert t.snapshot(sleeper.pid) == last


def test_agent_trace_waits_for_the_agent_to_attach_only_with_wait(scripted, sleeper, monkeypatch):
    monkeypatch.setattr(trace, "AGENT_ATTACH_POLL_S", 0.01)
    pending = dict(START, libraries=[])
    scripted.answers[:] = [pending]
    with pytest.raises(trace.TraceError, match=r"has not attached to the libcuda of process \d+ \(sleep\) yet.*--wait"):
        trace.AgentTrace(scripted.path, _target(sleeper)).start()
    scripted.answers[:] = [pending, pending, START, NOW]
    t = trace.AgentTrace(scripted.path, _target(sleeper), wait=True)
    t.start()
    assert t.attached() == START["libraries"] and t.snapshot(sleeper.pid) == trace.since(NOW, START)


def test_unreachable_agent_and_library_say_what_to_do(tmp_path):
    with pytest.raises(trace.TraceError) as e:
        trace._agent_socket(4242, None, str(tmp_path / "none.sock"), None)
    assert str(e.value) == (f"attaching eBPF uprobes to process 4242 needs root, and the gpuwatch agent cannot be "
                            f"asked instead (no gpuwatch agent is listening on {tmp_path}/none.sock (is `gpuwatch "
                            f"agent` / the gpuwatch service running?)): {trace.NOT_ROOT}")
    assert "start the gpuwatch daemon (systemctl start gpuwatch)" in trace.NOT_ROOT
    with pytest.raises(trace.TraceError, match="--library needs root"):
        trace._agent_socket(4242, "/x/libcuda.so.1", str(tmp_path / "none.sock"), None)


# ---- the agent's trace.snapshot, with a stand-in probe ----------------------------------------------
class FakeLoader:
    def __init__(self, path: str) -> None:
        fid = loader.file_id(path)
        self.libraries = {fid: SimpleNamespace(path=path, file=fid)}
        self.closed = False


class FakeEbpf(Probe):
    """The parts of EbpfCudaProbe trace.snapshot uses; "attached" to a file this test process maps."""

    name = "ebpf"

    def __init__(self, path: str, fail: str | None = None) -> None:
        self.path, self.fail = path, fail
        self.libraries: tuple[str, ...] = ()
        self.loader: FakeLoader | None = None

    def start(self) -> None:
        if self.fail:
            raise ProbeUnavailable(self.fail)
        self.loader = FakeLoader(self.path)

    def collect(self):
        return []

    def shutdown(self) -> None:
        ld, self.loader = self.loader, None
        if ld is not None:
            ld.closed = True  # the real one frees the BPF maps here

    def snapshot(self, pid):
        ld = self.loader
        if ld is None:
            raise ProbeUnavailable("the eBPF probe is not started")
        time.sleep(0.0005)
        assert not ld.closed, "read the maps of a closed loader"
        return {"pid": pid, "apis": {"cuLaunchKernel": _api(1)}, "memory": {}, "kernels": [], "dropped_events": 0,
                "libraries": [{"path": p.path, "attached": ["cuLaunchKernel"], "skipped": [], "uprobes": 1}
                              for p in ld.libraries.values()]}


MINE = loader.mapped_files(os.getpid())[0]  # the python executable, mapped by this process
ME = PeerCred(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())


@pytest.fixture
def agent(tmp_path, monkeypatch):
    """A Daemon (not running: its handlers are called directly) around the probe `agent.fake`."""
    made = []

    def make(fake: Probe | None):
        monkeypatch.setattr(daemon_mod, "build_probes",
                            lambda cfg: [daemon_mod.LockedProbe(fake)] if fake is not None else [])
        cfg = config_mod.load("", {"agent.state_dir": str(tmp_path), "agent.runtime_dir": str(tmp_path),
                                   "nvml.enabled": False, "prometheus.enabled": False})
        d = daemon_mod.Daemon(cfg, None, {})
        made.append(d)
        return d

    yield make
    for d in made:
        d.runner.shutdown()
        if d.store is not None:
            d.store.close()


def test_snapshot_of_an_own_process_with_its_libraries_as_it_sees_them(agent):
    fake = FakeEbpf(f"/proc/{os.getpid()}/root{MINE}")  # as a rescan finds a library
    d = agent(fake)
    d.runner.tick_once()
    snap = d._trace_snapshot({"pid": os.getpid()}, ME)
    assert snap["apis"]["cuLaunchKernel"]["calls"] == 1
    assert snap["libraries"] == [{"path": MINE, "attached": ["cuLaunchKernel"], "skipped": [], "uprobes": 1}]


def test_snapshot_refused_for_another_users_process(agent):
    import pwd

    d = agent(FakeEbpf(MINE))
    d.runner.tick_once()
    other = PeerCred(pid=1, uid=os.geteuid() + 1, gid=os.getegid() + 1)
    with pytest.raises(ControlError) as e:
        d._trace_snapshot({"pid": os.getpid()}, other)
    assert str(e.value) == (f"process {os.getpid()} belongs to user {pwd.getpwuid(os.geteuid()).pw_name}: "
                            f"you can trace only your own processes")


def test_snapshot_errors_say_why(agent, sleeper):
    d = agent(FakeEbpf(MINE))
    d.runner.tick_once()
    for params, message in [({}, 'trace.snapshot needs {"pid": N} with N a process ID, got None'),
                            ({"pid": True}, "got True"),
                            ({"pid": trace.pid_max() + 1}, "is above this system's largest PID"),
                            ({"pid": sleeper.pid}, f"process {sleeper.pid} (sleep) does not use CUDA")]:
        with pytest.raises(ControlError, match=message.replace("(", r"\(").replace(")", r"\)")):
            d._trace_snapshot(params, ME)


def test_snapshot_when_the_probe_is_disabled_or_down(agent):
    with pytest.raises(ControlError, match=r"does not run the eBPF probe \(ebpf.enabled is false"):
        agent(None)._trace_snapshot({"pid": os.getpid()}, ME)
    d = agent(FakeEbpf(MINE, fail="bcc is missing: install python3-bpfcc"))
    with pytest.raises(ControlError, match="eBPF probe is not running: it is starting"):
        d._trace_snapshot({"pid": os.getpid()}, ME)
    d.runner.tick_once()
    with pytest.raises(ControlError) as e:
        d._trace_snapshot({"pid": os.getpid()}, ME)
    assert str(e.value) == "the gpuwatch agent's eBPF probe is not running: bcc is missing: install python3-bpfcc"


def test_snapshot_while_the_probe_starts_is_busy_not_stuck(agent, monkeypatch):
    monkeypatch.setattr(daemon_mod, "TRACE_LOCK_WAIT", 0.05)
    d = agent(FakeEbpf(MINE))
    d.runner.tick_once()
    with d.ebpf.lock:  # what a start (compiling, attaching) holds
        with pytest.raises(ControlError, match="eBPF probe is busy"):
            d._trace_snapshot({"pid": os.getpid()}, ME)
    assert d._trace_snapshot({"pid": os.getpid()}, ME)["libraries"]


def test_snapshots_during_restarts_are_answers_or_errors_never_a_freed_read(agent):
    fake = FakeEbpf(MINE)
    d = agent(fake)
    d.runner.tick_once()
    stop = threading.Event()
    failures: list[BaseException] = []
    answers = {"ok": 0, "refused": 0}

    def restart():  # what the runner does when a collection fails: shutdown, later start again
        while not stop.is_set():
            d.ebpf.shutdown()
            time.sleep(0.001)  # readers get in while it is down...
            d.ebpf.start()
            time.sleep(0.001)  # ...and while it is up

    def read():
        while not stop.is_set():
            try:
                d._trace_snapshot({"pid": os.getpid()}, ME)
                answers["ok"] += 1
            except ControlError as e:
                assert "not running" in str(e) or "busy" in str(e), e
                answers["refused"] += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)
                return

    threads = [threading.Thread(target=restart)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10  # until both answers were seen: on a loaded machine one can take a while
    time.sleep(0.5)
    while time.monotonic() < deadline and not (answers["ok"] and answers["refused"]) and not failures:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(5)
    assert not failures, failures
    assert answers["ok"] > 0 and answers["refused"] > 0
