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


def _host(h: History, pid: str, metric: str, per_second: float, labels: dict | None = None, start: float = T0,
          seconds: int = 25) -> None:
    for i in range(seconds + 1):
        h.append([Sample(metric, per_second * i, "", {"pid": pid, "process": "python3", **(labels or {})}, start + i)])


def test_the_finding_whole_for_a_rank_the_probe_could_not_number():
    """Rank unknown (a split communicator), no GPU known: said so, named by its pid; throttled, not
    CPU-bound; another process's and old host series, minor faults and a one-point series say nothing."""
    h = History()
    h.append([Sample("gpuwatch.nccl.rank.last", 0, "", {"comm": COMM, "rank": "", "pid": "300"}, T0 - 1)])
    end = feed(h, {("", "300"): (2.0, 2 * 0.010)})
    _host(h, "300", "gpuwatch.process.cpu.time", 0.5, {"mode": "user"})
    _host(h, "300", "gpuwatch.process.cgroup.cpu.throttled.time", 0.25)
    _host(h, "300", "gpuwatch.process.paging.faults", 99.0, {"type": "minor"})
    _host(h, "301", "gpuwatch.process.paging.faults", 99.0, {"type": "major"})  # another process
    _host(h, "300", "gpuwatch.process.memory.swap", 5.0)  # not a host cause it reads
    h.append([Sample("gpuwatch.process.gpu.memory.usage", 1e9, GPU, {"pid": "301", "process": "x"}, end),
              Sample("gpuwatch.process.gpu.memory.usage", 1e9, PEER, {"pid": "300", "process": "x"}, T0 - 100)])
    (f,) = StragglerDetector().observe(h)
    assert (f.resource, f.ts) == ("", end)
    host = f.attrs.pop("host")
    assert host == {"cpu_seconds_per_second": pytest.approx(0.5), "throttled_seconds_per_second": pytest.approx(0.25),
                    "major_faults_per_second": None}
    assert f.attrs == {"id": f"{COMM}:300", "comm": COMM, "rank": "", "pid": "300", "process": "python3", "gpus": [],
                       "compared": 42, "entered_last": 42, "share": 1.0, "lateness_seconds": pytest.approx(0.010),
                       "window_seconds": 20.0}
    assert f.summary == (f"a rank of NCCL communicator {COMM} (pid 300, python3) entered 100% of the last 42 "
                         "collectives last, 10.0 ms after the rank before it on average: the node's other ranks wait "
                         "for it; meanwhile it used 0.50 CPU cores, was throttled by its CPU quota 0.25 s/s")
    (s,) = StragglerDetector.samples([f])
    assert (s.ts, s.labels) == (end, {"comm": COMM, "rank": "", "pid": "300", "process": "python3"})


@pytest.mark.parametrize("cores, words", [(0.9, "used 0.90 CPU cores (CPU-bound)"), (0.89, "used 0.89 CPU cores")])
def test_cpu_bound_from_nine_tenths_of_a_core(cores, words):
    h = History()
    feed(h, {("1", "200"): (2.0, 0.1)})
    _host(h, "200", "gpuwatch.process.cpu.time", cores, {"mode": "user"})
    (f,) = StragglerDetector().observe(h)
    assert f.summary.endswith("; meanwhile it " + words)


def test_host_series_too_short_or_old_say_nothing():
    h = History()
    end = feed(h, {("1", "200"): (2.0, 0.1)})
    h.append([Sample("gpuwatch.process.cpu.time", 3.0, "", {"pid": "200", "process": "p", "mode": "user"}, end)])
    _host(h, "200", "gpuwatch.process.paging.faults", 10.0, {"type": "major"}, start=T0 - 100, seconds=50)
    (f,) = StragglerDetector().observe(h)
    assert f.attrs["host"] == {"cpu_seconds_per_second": None, "throttled_seconds_per_second": None,
                               "major_faults_per_second": None}
    assert "meanwhile" not in f.summary and f.summary.endswith("wait for it")


def test_a_process_label_missing_is_empty():
    h = History()
    for i in range(26):
        t = T0 + i
        h.append([Sample("gpuwatch.nccl.collectives.compared", 2.0 * i, "", {"comm": COMM}, t),
                  Sample("gpuwatch.nccl.rank.last", 2.0 * i, "", {"comm": COMM, "rank": "2", "pid": "9"}, t),
                  Sample("gpuwatch.nccl.rank.lateness", 0.2 * i, "", {"comm": COMM, "rank": "2", "pid": "9"}, t)])
    (f,) = StragglerDetector().observe(h)
    assert f.attrs["process"] == "" and "(pid 9) entered" in f.summary


def test_the_host_rates_are_the_windows_and_summed_over_modes():
    """Busy before the window, idle in it: the window's rate; user and system time add up."""
    h = History()
    feed(h, {("1", "200"): (2.0, 0.1)})
    for i in range(101):  # 100 s before the end at 8 cores, then 0.25 + 0.5 cores in the last 25 s
        t = T0 - 75 + i
        user = 8.0 * min(i, 75) + 0.25 * max(0, i - 75)
        h.append([Sample("gpuwatch.process.cpu.time", user, "", {"pid": "200", "process": "p", "mode": "user"}, t),
                  Sample("gpuwatch.process.cpu.time", 0.5 * max(0, i - 75), "",
                         {"pid": "200", "process": "p", "mode": "system"}, t)])
    (f,) = StragglerDetector().observe(h)
    # the window: the last 20 s and the point before it (21 s), all after the busy part
    assert f.attrs["host"]["cpu_seconds_per_second"] == pytest.approx(0.75)


def test_each_communicator_and_rank_is_judged_on_its_own():
    """A balanced communicator first, a rank without lateness, one without compared collectives, then
    the late one: only it is named (none of the others stops the look, or is named by a default)."""
    h = History()
    for i in range(26):
        t = T0 + i
        h.append([Sample("gpuwatch.nccl.collectives.compared", 2.0 * i, "", {"comm": "aaaa"}, t),
                  Sample("gpuwatch.nccl.rank.last", 1.0 * i, "", {"comm": "aaaa", "rank": "0", "pid": "1"}, t),
                  Sample("gpuwatch.nccl.rank.lateness", 0.0, "", {"comm": "aaaa", "rank": "0", "pid": "1"}, t),
                  # last every time, but no lateness series (yet): not named
                  Sample("gpuwatch.nccl.collectives.compared", 2.0 * i, "", {"comm": "bbbb"}, t),
                  Sample("gpuwatch.nccl.rank.last", 2.0 * i, "", {"comm": "bbbb", "rank": "0", "pid": "2"}, t),
                  # a communicator with no compared series at all
                  Sample("gpuwatch.nccl.rank.last", 2.0 * i, "", {"comm": "cccc", "rank": "0", "pid": "3"}, t)])
    feed(h, {("1", "200"): (2.0, 0.1)})
    assert [(f.attrs["comm"], f.attrs["pid"]) for f in StragglerDetector().observe(h)] == [(COMM, "200")]
