"""The runner: intervals, deadlines, late and failing probes, snapshots."""
import threading
import time

from gpuwatch.agent.api import Probe, ProbeUnavailable, Sample
from gpuwatch.agent.runner import Runner


class CountingProbe(Probe):
    def __init__(self, name="count", interval=0.05):
        self.name = name
        self.interval = interval
        self.calls = 0
        self.shutdowns = 0

    def collect(self):
        self.calls += 1
        return [Sample("gpuwatch.gpu.up", 1.0, resource="GPU-a")]

    def shutdown(self):
        self.shutdowns += 1


class BlockingProbe(Probe):
    name = "stuck"
    interval = 0.05
    deadline = 0.2

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0

    def collect(self):
        self.calls += 1
        self.release.wait(10)
        return [Sample("hw.power", 100.0, resource="GPU-b")]


class FlakyStartProbe(Probe):
    name = "flaky"
    interval = 0.05

    def __init__(self, failures):
        self.failures = failures
        self.starts = 0

    def start(self):
        self.starts += 1
        if self.starts <= self.failures:
            raise ProbeUnavailable("NVML library not found: install the NVIDIA driver")

    def collect(self):
        return [Sample("hw.power", 1.0, resource="GPU-c")]


def run_for(runner, seconds):
    stop = threading.Event()
    t = threading.Thread(target=runner.run, kwargs={"stop": stop})
    t.start()
    time.sleep(seconds)
    stop.set()
    t.join(2)


def status(runner, name):
    return runner.snapshot.probes[name]


def test_probe_ticks_on_its_interval_and_history_fills():
    p = CountingProbe(interval=0.05)
    r = Runner([p])
    run_for(r, 0.5)
    # ~10 ticks expected at 50 ms; allow scheduling slack on a loaded 2-core CI machine.
    assert 4 <= p.calls <= 12
    assert status(r, "count").up
    (key, points), = list(r.history.series("gpuwatch.gpu.up"))
    # The last collection may still be in flight when the runner stops.
    assert p.calls - 1 <= len(points) <= p.calls


def test_stuck_probe_is_marked_late_while_others_go_on():
    stuck, ok = BlockingProbe(), CountingProbe(interval=0.02)
    r = Runner([stuck, ok])
    run_for(r, 0.6)
    st = status(r, "stuck")
    assert st.state == "late" and not st.up and st.late_total == 1
    assert "deadline" in st.reason
    assert stuck.calls == 1, "a stuck probe must not be started again while its call hangs"
    assert ok.calls >= 5 and status(r, "count").up
    up = {s.labels["probe"]: s.value for s in r.snapshot.by_metric("gpuwatch.probe.up")}
    assert up == {"stuck": 0.0, "count": 1.0}
    late = {s.labels["probe"]: s.value for s in r.snapshot.by_metric("gpuwatch.probe.late")}
    assert late["stuck"] == 1.0
    stuck.release.set()
    run_for(r, 0.2)
    assert status(r, "stuck").up and stuck.calls >= 2


def test_unavailable_probe_is_retried_with_backoff(monkeypatch):
    monkeypatch.setattr("gpuwatch.agent.runner.BACKOFF_START", 0.05)
    p = FlakyStartProbe(failures=2)
    r = Runner([p])
    run_for(r, 0.1)
    st = status(r, "flaky")
    assert not st.up and st.state == "unavailable" and "install the NVIDIA driver" in st.reason
    run_for(r, 0.6)  # retries at +0.05 s then +0.1 s
    assert p.starts == 3 and status(r, "flaky").up


def test_failing_probe_counts_errors_and_keeps_daemon_serving():
    class Boom(Probe):
        name = "boom"
        interval = 0.02

        def collect(self):
            raise RuntimeError("bad answer")

    ok = CountingProbe(interval=0.02)
    r = Runner([Boom(), ok])
    run_for(r, 0.3)
    st = status(r, "boom")
    assert st.state == "failing" and st.errors_total >= 2 and "bad answer" in st.reason
    assert status(r, "count").up
    assert any(e.kind == "probe.down" for e in r.snapshot.events)


def test_interval_uses_the_monotonic_clock_not_wall_time():
    p = CountingProbe(interval=100.0)
    wall = [1_000_000.0]
    r = Runner([p], wallclock=lambda: wall[0])
    r.tick_once()
    assert p.calls == 1
    wall[0] += 3600  # wall clock stepped an hour: the probe is not due
    for _ in range(5):
        r.step()
        time.sleep(0.01)
    assert p.calls == 1


def test_snapshot_is_replaced_not_mutated():
    r = Runner([CountingProbe()])
    first = r.tick_once()
    second = r.tick_once()
    assert first is not second and first.samples and second.samples
    assert first.ts <= second.ts


class MemorySeriesProbe(Probe):
    """Plays back one process's NVML memory, one point (a second apart) per collection."""

    name = "mem"
    interval = 1.0

    def __init__(self, values, t0=1_800_000_000.0):
        self.values = list(values)
        self.t0 = t0
        self.i = 0

    def collect(self):
        t, v = self.t0 + self.i, self.values[min(self.i, len(self.values) - 1)]
        self.i += 1
        gpu, limit = "GPU-leak", 141 * 2**30
        return [Sample("gpuwatch.process.gpu.memory.usage", v, gpu, {"pid": "4242", "process": "python3"}, t),
                Sample("hw.gpu.memory.limit", float(limit), gpu, {}, t),
                Sample("hw.gpu.memory.usage", v, gpu, {}, t)]


def test_findings_open_update_and_close_as_events_and_export_their_metrics():
    from gpuwatch.detectors.leak import LeakDetector

    leak = [8 * 2**30 + i * 500 * 2**20 / 60 for i in range(400)]  # 500 MiB a minute for 400 s...
    values = leak + [leak[-1]] * 300  # ... then it stops
    now = [0.0]
    events = []
    r = Runner([MemorySeriesProbe(values)], detectors=[LeakDetector()], clock=lambda: now[0],
               on_event=events.append)
    judged_open, exported = [], set()
    for tick in range(len(values)):
        now[0] = float(tick)
        snap = r.tick_once()
        if snap.findings:
            judged_open.append(tick)
            exported |= {s.metric for s in snap.samples if s.metric.startswith("gpuwatch.leak.")}
    kinds = [e.kind for e in events if e.kind.startswith("finding.")]
    assert kinds[0] == "finding.opened" and kinds[-1] == "finding.closed"
    opened = next(e for e in events if e.kind == "finding.opened")
    assert opened.attrs["color"] == "black" and opened.attrs["pid"] == "4242" and opened.resource == "GPU-leak"
    assert 45 <= judged_open[0] <= 90  # judged every 10 s, seen once most of a 60 s window shows growth
    assert 400 < judged_open[-1] < 400 + 120  # closes once the growth has stopped
    assert exported == {"gpuwatch.leak.suspected", "gpuwatch.leak.growth.rate", "gpuwatch.leak.time_to_oom"}


def test_leak_findings_get_the_stacks_that_hold_their_bytes_where_they_tell_something():
    from gpuwatch.agent.daemon import attach_stacks

    asked = []

    def stacks_of(pid):
        asked.append(pid)
        return [{"bytes": 2**30, "allocations": 3, "frames": ["cuMemAlloc_v2+0x0", "leaky+0x10"]}]

    found = attach_stacks([{"kind": "memory_leak", "color": "black", "pid": "4242"},
                           {"kind": "memory_leak", "color": "white", "pid": "7"},
                           {"kind": "xid", "pid": "9"},
                           {"kind": "memory_leak", "color": "grey", "pid": "other"}], stacks_of)
    assert asked == [4242]
    assert found[0]["stacks"][0]["frames"][1] == "leaky+0x10" and all("stacks" not in f for f in found[1:])
