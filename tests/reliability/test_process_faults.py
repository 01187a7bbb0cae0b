"""Faults 7 (PID reuse) and 16 (profiling counters held by another tool), against real processes.

7: a PID really reused. As root, /proc/sys/kernel/ns_last_pid makes the kernel hand out a chosen
   PID next (what CRIU uses to restore processes): a process is killed and a new one started under
   its PID. `gpuwatch trace` (agent/trace/pids.py alive(), check_pid()) and the daemon's eBPF probe
   (probes/ebpf/probe.py _prune()) tell the two apart by /proc/PID/stat's start time. Without root,
   the same checks run against a fake /proc tree.
16: CUPTI is not installed here (cupti-python needs a GPU machine), so the daemon-side sampler runs
   as CuptiSamplerProbe supervising tests/fixtures/fake_cupti_sampler.py (the sampler's protocol)
   with the default arbiter reading the real /proc: a real process named `ncu` (a copy of sleep)
   makes it yield, and gpuwatch_profiling_state{state="yielded"} is 1 in the Prometheus rendering.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.agent.trace.pids import alive, check_pid
from gpuwatch.agent.snapshot import Snapshot
from gpuwatch.exporters.prometheus import render
from gpuwatch.probes.cupti.arbitration import Arbiter
from gpuwatch.probes.cupti.devicewide import CuptiSamplerProbe
from gpuwatch.probes.process import identity
from tests.conftest import NS_LAST_PID, spawn_at_pid, wait_for

ROOT = Path(__file__).resolve().parents[2]
FAKE_SAMPLER = ROOT / "tests" / "fixtures" / "fake_cupti_sampler.py"



# ---- 7. PID reuse ----------------------------------------------------------------------------------
@pytest.fixture
def root_only():
    if os.geteuid() != 0 or not os.access(NS_LAST_PID, os.W_OK):
        pytest.skip("reusing a PID on purpose needs root (ns_last_pid); the fake /proc test covers the logic")


def test_a_reused_pid_is_not_the_traced_process(root_only):
    old = subprocess.Popen(["sleep", "30"])
    pid = old.pid
    target = check_pid(pid)
    assert alive(pid, target.start_time)
    old.kill()
    old.wait()
    time.sleep(0.02)  # start times are in clock ticks (10 ms): the new process must get another
    new = spawn_at_pid(pid, ["sleep", "30"])
    try:
        assert os.path.exists(f"/proc/{pid}") and new.pid == pid
        # same PID, same command name, another process: the trace of the old one has ended
        assert not alive(pid, target.start_time)
        again = check_pid(pid)
        assert again.start_time != target.start_time and alive(pid, again.start_time)
    finally:
        new.kill()
        new.wait()


class _FakeLoader:
    def __init__(self) -> None:
        self.forgotten: list[set[int]] = []

    def forget(self, pids) -> None:
        self.forgotten.append(set(pids))


def _probe_for_prune():
    from gpuwatch.probes.ebpf.probe import EbpfCudaProbe

    p = EbpfCudaProbe.__new__(EbpfCudaProbe)  # only the bookkeeping _prune uses, no BPF
    p._starts, p._names, p._driver_named, p._loader = {}, {}, {}, _FakeLoader()
    p._python, p._resolvers = {}, {}
    from gpuwatch.probes.ebpf import pools
    p._pools, p._allocators = pools.Classifier(), {}
    return p


def test_daemon_forgets_a_pid_whose_process_was_replaced(root_only):
    """The daemon's eBPF probe drops a PID's kernel map entries (and its cached name) once the PID
    belongs to another process, so the new process's counts start from zero under its own name."""
    p = _probe_for_prune()
    old = subprocess.Popen(["sleep", "30"])
    pid = old.pid
    assert p._prune({}, {pid}) == set()
    p._names[pid] = "old-name"
    old.kill()
    old.wait()
    time.sleep(0.02)
    new = spawn_at_pid(pid, ["sleep", "30"])
    try:
        assert p._prune({}, {pid}) == {pid}
        assert p._loader.forgotten == [{pid}] and pid not in p._names and pid not in p._starts
        assert p._prune({}, {pid}) == set()  # the new process, from now on, is tracked afresh
    finally:
        new.kill()
        new.wait()


def _fake_proc(root: Path, pid: int, start: int, comm: str = "python3") -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S", "1", "1", "1", "0", "-1", "4194560"] + ["0"] * 12 + [str(start)] + ["0"] * 30
    (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")
    (d / "comm").write_text(comm + "\n")
    (d / "status").write_text(f"Name:\t{comm}\nTgid:\t{pid}\n")


def test_start_time_check_on_a_fake_proc_tree(tmp_path):
    """Without root: the same PID with another start time is another process."""
    proc = tmp_path / "proc"
    _fake_proc(proc, 4242, 1000)
    assert identity.read_stat(4242, str(proc)).start_time == 1000
    assert alive(4242, 1000, str(proc))
    _fake_proc(proc, 4242, 1234)  # the PID reused
    assert not alive(4242, 1000, str(proc))
    shutil.rmtree(proc / "4242")
    assert not alive(4242, 1000, str(proc))


# ---- 16. profiling counters held by another tool -----------------------------------------------------
def test_sampler_yields_to_a_real_ncu_process(tmp_path):
    probe = CuptiSamplerProbe(command=[sys.executable, str(FAKE_SAMPLER), "good"],
                              env=dict(os.environ), arbiter=Arbiter())  # default names, the real /proc
    ncu_bin = tmp_path / "ncu"
    shutil.copy("/bin/sleep", ncu_bin)
    ncu = None
    try:
        probe.start()
        assert wait_for(lambda: probe.state == "sampling" and probe.child_pid, 10), probe.state
        ncu = subprocess.Popen([str(ncu_bin), "30"])
        t0 = time.monotonic()
        assert wait_for(lambda: probe.state == "yielded", 5), probe.state
        assert time.monotonic() - t0 < 2.0, "did not yield within the scan interval"
        assert probe.holder.name == "ncu" and probe.holder.pid == ncu.pid
        text = render(Snapshot(ts=time.time(), samples=tuple(probe.collect())), openmetrics=False).decode()
        assert 'gpuwatch_profiling_state{state="yielded"} 1' in text, text
        assert 'gpuwatch_profiling_state{state="sampling"} 0' in text
        assert not any(line.startswith("gpuwatch_gpu_") for line in text.splitlines())  # no counters while yielded
    finally:
        if ncu is not None:
            ncu.kill()
            ncu.wait()
    assert wait_for(lambda: probe.state == "sampling", 10), "did not resume after ncu exited"
    probe.shutdown()
