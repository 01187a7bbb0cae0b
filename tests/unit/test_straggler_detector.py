"""The straggler detector over real History objects fed the eBPF probe's NCCL counters."""
from __future__ import annotations

import pytest

from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History
from gpuwatch.agent.metrics import REGISTRY
from gpuwatch.detectors.straggler import KIND, StragglerDetector

COMM = "9e3779b97f4a7c15"
T0 = 1_000_000.0
GPU = "GPU-0af39ec1-0000-0000-0000-000000000001"
PEER = "GPU-00000000-0000-0000-0000-000000000000"  # sorts first: the order must come from memory


def feed(h: History, per_second: dict, seconds: int = 25, compared_per_second: float = 2.0, start: float = T0,
         base: dict | None = None) -> float:
    """Counters for `seconds` s: collectives compared at compared_per_second, and per (rank, pid)
    (last per second, lateness s per second). base: the counters' values at start."""
    base = base or {}
    for i in range(seconds + 1):
        t = start + i
        samples = [Sample("gpuwatch.nccl.collectives.compared", base.get("compared", 0) + compared_per_second * i, "",
                          {"comm": COMM}, t)]
        for (rank, pid), (last, late) in per_second.items():
            labels = {"comm": COMM, "rank": rank, "pid": pid, "process": "python3"}
            b_last, b_late = base.get((rank, pid), (0, 0))
            samples += [Sample("gpuwatch.nccl.rank.last", b_last + last * i, "", labels, t),
                        Sample("gpuwatch.nccl.rank.lateness", b_late + late * i, "", labels, t)]
        h.append(samples)
    return start + seconds


def test_a_rank_last_every_time_by_tens_of_ms_is_named_with_its_gpu_and_host():
    h = History()
    end = feed(h, {("1", "200"): (2.0, 2 * 0.030), ("0", "100"): (0.0, 0.0)})
    for i in range(26):  # NVML lists pid 200 on GPU; the host probe follows it: one core busy
        t = T0 + i
        h.append([Sample("gpuwatch.process.gpu.memory.usage", 2e9, GPU, {"pid": "200", "process": "python3"}, t),
                  # a peer's GPU, where NCCL's peer access puts it with a little memory
                  Sample("gpuwatch.process.gpu.memory.usage", 5e8, PEER, {"pid": "200", "process": "python3"}, t),
                  Sample("gpuwatch.process.cpu.time", 1.0 * i, "", {"pid": "200", "process": "python3",
                                                                      "mode": "user"}, t),
                  Sample("gpuwatch.process.paging.faults", 30.0 * i, "", {"pid": "200", "process": "python3",
                                                                           "type": "major"}, t)])
    (f,) = StragglerDetector().observe(h)
    assert (f.kind, f.resource, f.severity, f.ts) == (KIND, GPU, "warning", end)
    a = f.attrs
    assert (a["comm"], a["rank"], a["pid"], a["gpus"], a["compared"], a["entered_last"]) == (COMM, "1", "200", [GPU, PEER], 42, 42)
    assert a["lateness_seconds"] == pytest.approx(0.030)
    assert a["host"]["cpu_seconds_per_second"] == pytest.approx(1.0)
    assert a["host"]["major_faults_per_second"] == pytest.approx(30.0)
    assert a["host"]["throttled_seconds_per_second"] is None  # not followed: not said
    assert f.summary == (f"rank 1 of NCCL communicator {COMM} (pid 200, python3 on GPU {GPU}, {PEER}) entered 100% of the last "
                         "42 collectives last, 30.0 ms after the rank before it on average: the node's other ranks "
                         "wait for it; meanwhile it used 1.00 CPU cores (CPU-bound), made 30 major page faults/s")
    (s,) = StragglerDetector.samples([f])
    assert (s.metric, s.resource, s.value) == ("gpuwatch.nccl.straggler.lateness", GPU, pytest.approx(0.030))
    assert set(s.labels) == set(REGISTRY["gpuwatch.nccl.straggler.lateness"].labels[1:])


def test_balanced_ranks_are_not_named():
    h = History()
    feed(h, {("0", "100"): (1.0, 1 * 0.00002), ("1", "200"): (1.0, 1 * 0.00002)})
    assert StragglerDetector().observe(h) == []


@pytest.mark.parametrize("late, named", [(0.005, True), (0.0049, False)])
def test_the_lateness_threshold(late, named):
    h = History()
    feed(h, {("1", "200"): (2.0, 2 * late)})
    assert bool(StragglerDetector().observe(h)) is named


@pytest.mark.parametrize("last_per_second, named", [(1.5, True), (1.48, False)])
def test_the_share_threshold(last_per_second, named):
    h = History()  # 2 compared/s: 1.5 last/s is 75 %
    feed(h, {("1", "200"): (last_per_second, last_per_second * 0.05)})
    assert bool(StragglerDetector().observe(h)) is named


@pytest.mark.parametrize("compared, named", [(10, True), (9, False)])
def test_too_few_collectives_compared_say_nothing(compared, named):
    h = History()  # the 20 s window: compared / 20 per second
    rate = compared / 20
    feed(h, {("1", "200"): (rate, rate * 0.05)}, compared_per_second=rate)
    assert bool(StragglerDetector().observe(h)) is named


def test_a_counter_reset_is_no_rise():
    """The agent restarted: the counters start again from 0; the drop is not lateness."""
    h = History()
    end = feed(h, {("1", "200"): (0.0, 0.0)}, seconds=10, base={"compared": 500, ("1", "200"): (500, 50.0)})
    feed(h, {("1", "200"): (0.0, 0.0)}, seconds=15, start=end + 1)
    assert StragglerDetector().observe(h) == []


def test_lateness_long_ago_is_not_now():
    """Late for a while, then in step for longer than the window: no finding."""
    h = History()
    end = feed(h, {("1", "200"): (2.0, 0.1)}, seconds=20)
    feed(h, {("1", "200"): (1.0, 0.00001)}, seconds=25, start=end + 1, base={"compared": 40, ("1", "200"): (40, 2.0)})
    assert StragglerDetector().observe(h) == []


def test_nothing_compared_is_nothing_said():
    assert StragglerDetector().observe(History()) == []
