"""A late rank named by a real agent: its eBPF probe finds the fake libnccl.so.2 in the ranks' maps
(no --ebpf-library: the /proc scan), lines their collectives up, and the straggler detector names
the rank that sleeps before each collective, through `gpuwatch findings` and the metrics."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpuwatch.agent.control import ControlError, call
from tests.conftest import FIXTURE, Agent, series
from tests.ebpf.test_ebpf_nccl import Rank

pytestmark = pytest.mark.root
DELAY_MS = 20


def replayed_gpus(pid: int) -> list[str]:
    """The GPUs the replayed NVML lists `pid` on: its recording's pids are real pids here too (CI's
    rank once got pid 425, the recorded job's), and the finding then rightly names that GPU."""
    gpus = json.loads(FIXTURE.read_text())["gpus"]
    return [g["uuid"][0]["value"] for g in gpus
            if any(p["pid"] == pid for tick in g["compute_processes"] for p in tick["value"] or [])]


def test_the_rank_that_sleeps_before_each_collective_is_named(tmp_path, fake_nccl):
    uid = os.urandom(128).hex()
    # rank 1 sleeps 20 ms before each of its 36 collectives a loop: ~0.75 s a loop, 40 loops
    ranks = [Rank(fake_nccl["driver"], r, 2, uid, d, 40) for r, d in enumerate((0, DELAY_MS))]
    agent = Agent(tmp_path / "agent", "--nvml-replay", str(FIXTURE), "--no-baseline", "--no-cupti-sampling")
    try:
        deadline = time.monotonic() + 60
        while 'gpuwatch_ebpf_attached{what="libraries"} 0' in (text := agent.metrics()) or \
                "gpuwatch_ebpf_attached" not in text:
            assert time.monotonic() < deadline, agent.output()[-3000:]
            time.sleep(0.2)
        t0 = time.monotonic()
        for r in ranks:
            r.go()
        found = []
        while not found:
            assert time.monotonic() < t0 + 30, f"no straggler_rank after 30 s:\n{agent.output()[-3000:]}"
            time.sleep(1)
            try:
                found = call(str(agent.socket), "findings", {"kind": "straggler_rank"})["open"]
            except ControlError:
                pass
        (f,) = found
        assert (f["rank"], f["pid"], f["process"]) == ("1", str(ranks[1].pid), "nccl_driver")
        assert 0.5 * DELAY_MS / 1000 < f["lateness_seconds"] < 5 * DELAY_MS / 1000
        assert f["share"] == 1.0 and f["compared"] >= 10
        assert f["gpus"] == replayed_gpus(ranks[1].pid)
        on = f" on GPU {', '.join(f['gpus'])}" if f["gpus"] else ""
        assert f["summary"].startswith(f"rank 1 of NCCL communicator {f['comm']} (pid {ranks[1].pid}, nccl_driver{on}) "
                                       "entered 100% of the last")
        out = subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "findings", "--socket", str(agent.socket),
                              "--kind", "straggler_rank"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and f"rank 1 of NCCL communicator {f['comm']}" in out.stdout, out
        text = agent.metrics()
        late = series(text, "gpuwatch_nccl_straggler_lateness_seconds")
        assert [k for k in late if f'pid="{ranks[1].pid}"' in k and 'rank="1"' in k], late
        calls = series(text, "gpuwatch_nccl_calls_total")
        assert any(f'pid="{ranks[0].pid}"' in k and 'op="ncclAllReduce"' in k for k in calls), calls
    finally:
        agent.stop()
        for r in ranks:
            r.proc.kill()
            r.proc.wait()
