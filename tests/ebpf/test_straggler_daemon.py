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
from gpuwatch.probes.ebpf.probe import MAX_COMMUNICATORS
from tests.ebpf.test_ebpf_nccl import MAIN_COLLECTIVES, MAIN_P2P, PER_LOOP, SPLIT_COLLECTIVES, Rank

pytestmark = pytest.mark.root
DELAY_MS = 20


def replayed_gpus(pid: int) -> list[str]:
    """The GPUs the replayed NVML lists `pid` on: its recording's pids are real pids here too (CI's
    rank once got pid 425, the recorded job's), and the finding then rightly names that GPU."""
    gpus = json.loads(FIXTURE.read_text())["gpus"]
    return [g["uuid"][0]["value"] for g in gpus
            if any(p["pid"] == pid for tick in g["compute_processes"] for p in tick["value"] or [])]


def wait_attached(agent: Agent) -> None:
    deadline = time.monotonic() + 60
    while 'gpuwatch_ebpf_attached{what="libraries"} 0' in (text := agent.metrics()) or \
            "gpuwatch_ebpf_attached" not in text:
        assert time.monotonic() < deadline, agent.output()[-3000:]
        time.sleep(0.2)


def test_the_rank_that_sleeps_before_each_collective_is_named(tmp_path, fake_nccl):
    uid = os.urandom(128).hex()
    # rank 1 sleeps 20 ms before each of its 36 collectives a loop: ~0.75 s a loop, 40 loops
    ranks = [Rank(fake_nccl["driver"], r, 2, uid, d, 40) for r, d in enumerate((0, DELAY_MS))]
    agent = Agent(tmp_path / "agent", "--nvml-replay", str(FIXTURE), "--no-baseline", "--no-cupti-sampling")
    try:
        wait_attached(agent)
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


def test_a_process_that_makes_thousands_of_communicators_gets_a_bounded_number_of_series(tmp_path, fake_nccl):
    """Any user can make communicators (a libnccl of their own will do): 2000 of them, each with one
    all-reduce, get the 32 busiest series of their own and comm="other" for the rest, with every
    call, byte and collective still counted, rather than 6000 series crowding History."""
    extra = 2000
    rank = Rank(fake_nccl["driver"], 0, 1, os.urandom(128).hex(), 0, 1, extra)
    agent = Agent(tmp_path / "agent", "--nvml-replay", str(FIXTURE), "--no-baseline", "--no-cupti-sampling")
    try:
        wait_attached(agent)
        rank.go()
        rank.done()
        want = {"collectives": MAIN_COLLECTIVES + SPLIT_COLLECTIVES + extra,
                "calls": MAIN_COLLECTIVES + MAIN_P2P + SPLIT_COLLECTIVES + extra,
                "bytes": sum(b for op, (_, b) in PER_LOOP.items()) + extra * 4 * 4}
        deadline = time.monotonic() + 30
        while True:
            text = agent.metrics()
            got = {what: {k: v for k, v in series(text, f"gpuwatch_nccl_communicator_{what}_total").items()
                          if f'pid="{rank.pid}"' in k} for what in want}
            if {what: sum(s.values()) for what, s in got.items()} == want:
                break
            assert time.monotonic() < deadline, ({what: sum(s.values()) for what, s in got.items()}, want)
            time.sleep(0.5)
        for what, s in got.items():
            assert len(s) == MAX_COMMUNICATORS + 1, (what, len(s))
        # the busiest have their own: the main communicator (34 collectives), its split (2) and 30
        # of the extra ones (1 each); the other 1970 are summed
        coll = got["collectives"]
        (other,) = [v for k, v in coll.items() if 'comm="other"' in k]
        own = sorted(v for k, v in coll.items() if 'comm="other"' not in k)
        assert (other, own) == (extra - (MAX_COMMUNICATORS - 2), [1] * (MAX_COMMUNICATORS - 2) + [2, MAIN_COLLECTIVES])
        assert series(text, "gpuwatch_history_series_evicted_total").get('{reason="cap"}', 0) == 0
    finally:
        agent.stop()
        rank.proc.kill()
        rank.proc.wait()
