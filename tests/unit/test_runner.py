"""The runner: intervals, deadlines, late and failing probes, snapshots."""
import logging
import platform
import threading
import time

import pytest

from gpuwatch.agent import __version__
from gpuwatch.agent import oom as oom_mod
from gpuwatch.agent.api import (
    Detector, Event, Exporter, Finding, Probe, ProbeDisabled, ProbeUnavailable, Sample,
)
from gpuwatch.agent.history import History
from gpuwatch.agent.runner import Runner, finding_attrs, finding_key
from gpuwatch.agent.snapshot import EMPTY, ProbeStatus


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


def by_metric(snap, metric):
    return [s for s in snap.samples if s.metric == metric]


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
    up = {s.labels["probe"]: s.value for s in by_metric(r.snapshot, "gpuwatch.probe.up")}
    assert up == {"stuck": 0.0, "count": 1.0}
    late = {s.labels["probe"]: s.value for s in by_metric(r.snapshot, "gpuwatch.probe.late")}
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


def test_failing_probe_counts_errors_and_keeps_daemon_serving(monkeypatch):
    monkeypatch.setattr("gpuwatch.agent.runner.BACKOFF_START", 0.02)
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
               wallclock=lambda: 1_800_000_000.0 + now[0], on_event=events.append)  # the probe's time line
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
    from gpuwatch.agent.handlers import attach_stacks

    asked = []

    def stacks_of(pid, allocator):
        asked.append((pid, allocator))
        return [{"bytes": 2**30, "allocations": 3, "allocator": allocator, "frames": ["cuMemAlloc_v2+0x0", "leaky+0x10"]}]

    found = attach_stacks([{"kind": "memory_leak", "color": "black", "pid": "4242", "allocator": None},
                           {"kind": "memory_leak", "color": "white", "pid": "7"},
                           {"kind": "xid", "pid": "9"},
                           {"kind": "memory_leak", "color": "grey", "pid": "other"}], stacks_of)
    assert asked == [(4242, "none")]  # black: the stacks outside any allocator
    assert found[0]["stacks"][0]["frames"][1] == "leaky+0x10" and all("stacks" not in f for f in found[1:])
    # grey: the stacks of the pool that grows (eBPF named it), else of any pool (the in-process agent's grey)
    asked.clear()
    attach_stacks([{"kind": "memory_leak", "color": "grey", "pid": "5", "allocator": "pytorch"},
                   {"kind": "memory_leak", "color": "grey", "pid": "6", "allocator": None},
                   {"kind": "memory_leak", "color": "black", "pid": "8", "allocator": "none"}], stacks_of)
    assert asked == [(5, "pytorch"), (6, "*"), (8, "none")]


# -- exact rules on fake clocks ----------------------------------------------------------------------
# The runner reads time only from the clocks it is given, so the tests below set both by hand and wait
# for each worker thread to return before the next step: every boundary is hit exactly, no sleeps.

W0 = 1_800_000_000.0
EPS = 2.0 ** -10  # a binary fraction: t + EPS - t == EPS exactly at every time used here


class Clocks:
    """The runner's monotonic clock, and a wall clock that runs with it plus any step set by hand."""

    def __init__(self):
        self.t = 0.0
        self.step = 0.0

    def mono(self):
        return self.t

    def wall(self):
        return W0 + self.t + self.step


class Timer:
    """Stands in for the worker's perf_counter: every collection takes exactly `took` seconds."""

    def __init__(self, took):
        self.took, self.n = took, 0

    def __call__(self):
        self.n += 1
        return 1000.0 * ((self.n + 1) // 2) + (self.took if self.n % 2 == 0 else 0.0)


def raising(exc):
    def read():
        raise exc
    return read


class Scripted(Probe):
    """A probe whose collections return read(); with gated=True each one waits for one gate.release()."""

    def __init__(self, name="p", interval=1.0, deadline=5.0, read=None, start_fails=0, gated=False):
        self.name, self.interval, self.deadline = name, interval, deadline
        self.read = read or (lambda: [Sample("hw.power", 100.0, f"GPU-{name}", {}, W0)])
        self.start_fails = start_fails  # start() raises ProbeUnavailable this many times first
        self.gate = threading.Semaphore(0) if gated else None
        self.starts = self.collects = self.shutdowns = 0
        self.pending_events = []
        self.entered = threading.Event()  # set once a collection has begun

    def start(self):
        self.starts += 1
        if self.starts <= self.start_fails:
            raise ProbeUnavailable("NVML library not found: install the NVIDIA driver")

    def collect(self):
        self.collects += 1
        self.entered.set()
        if self.gate is not None:
            assert self.gate.acquire(timeout=10)
        return self.read()

    def events(self):
        evs, self.pending_events = self.pending_events, []
        return evs

    def shutdown(self):
        self.shutdowns += 1


def clocked(probes, c, **kw):
    return Runner(probes, clock=c.mono, wallclock=c.wall, **kw)


def slot(r, name):
    return next(s for s in r.slots if s.probe.name == name)


def returned(r, *names):
    """Wait until these probes' running collections have returned (the next step collects them)."""
    for name in names:
        assert slot(r, name).done.wait(5)


def at(r, c, t):
    c.t = t
    return r.step()


def logged(caplog, level):
    return [rec.getMessage() for rec in caplog.records if rec.name == "gpuwatch.runner" and rec.levelno == level]


def test_probe_is_late_just_past_its_deadline_not_at_it_and_counted_once_per_collection(caplog):
    c = Clocks()
    p = Scripted("gated", interval=1.0, deadline=2.5, gated=True)
    r = clocked([p], c)
    assert at(r, c, 10.0) is False  # started: nothing to publish yet
    assert slot(r, "gated").busy_since == 10.0
    assert at(r, c, 12.5) is False  # running for exactly its deadline: not late yet
    assert slot(r, "gated").status.state == "starting" and r.snapshot is EMPTY
    assert at(r, c, 12.5 + EPS) is True
    assert status(r, "gated") == ProbeStatus(
        name="gated", up=False, reason="collection running for more than its 2.5 s deadline", state="late",
        late_total=1, interval=1.0)
    assert logged(caplog, logging.WARNING) == ["probe gated is late: still collecting after 2.5 s"]
    late = {s.labels["probe"]: s.value for s in by_metric(r.snapshot, "gpuwatch.probe.late")}
    assert late == {"gated": 1.0}
    # Still stuck later on: counted once per collection, not once per pass, and not started again.
    assert at(r, c, 20.0) is False and at(r, c, 30.0) is False
    assert slot(r, "gated").status.late_total == 1
    p.gate.release()
    returned(r, "gated")
    assert p.collects == 1
    assert at(r, c, 31.0) is True
    assert status(r, "gated").state == "up" and status(r, "gated").up and status(r, "gated").reason == ""
    assert status(r, "gated").late_total == 1  # a total: kept once the probe is back
    # The next collection (due at 32) is judged on its own deadline and counted again.
    assert at(r, c, 32.0) is False and slot(r, "gated").busy_since == 32.0
    assert at(r, c, 34.5) is False
    assert at(r, c, 34.5 + EPS) is True and status(r, "gated").late_total == 2
    assert status(r, "gated").state == "late" and not status(r, "gated").up  # it was up: down again
    p.gate.release()
    returned(r, "gated")
    assert at(r, c, 35.0) is True and status(r, "gated").late_total == 2 and p.collects == 2


def test_sleep_lasts_until_the_next_due_probe_or_deadline_but_not_past_a_late_one():
    c = Clocks()
    idle = Scripted("idle", interval=4.0)
    busy = Scripted("busy", interval=1.0, deadline=2.5, gated=True)
    r = clocked([idle, busy], c)
    at(r, c, 0.0)
    returned(r, "idle")
    assert at(r, c, 0.0) is True  # idle is back (due again at 4); busy is still in its first call
    assert status(r, "busy") == ProbeStatus(name="busy", up=False, reason="not started yet", interval=1.0)
    c.t = 1.0
    assert r._sleep_time(10.0) == 1.5  # until busy's deadline at 2.5 ...
    assert r._sleep_time(1.0) == 1.0  # ... or max_sleep, whichever is sooner
    c.t = 3.5
    assert r._sleep_time(10.0) == 0.001  # the deadline has passed, not yet reported: wake at once
    assert at(r, c, 3.5) is True and status(r, "busy").state == "late"
    assert r._sleep_time(10.0) == 0.5  # a late probe no longer wakes the loop: idle's due time does
    c.t = 5.0
    assert r._sleep_time(10.0) == 0.001  # idle is overdue: a floor, never 0 or negative
    busy.gate.release()
    returned(r, "busy")


def test_samples_leave_the_snapshot_just_past_three_intervals_or_the_deadline_whichever_is_longer():
    c = Clocks()
    slow = Scripted("slow", interval=2.0, deadline=5.0, gated=True)  # 3 x 2 s > 5 s: stale after 6 s
    fast = Scripted("fast", interval=1.0, deadline=5.0, gated=True)  # 3 x 1 s < 5 s: stale after 5 s
    r = clocked([slow, fast], c)
    at(r, c, 0.0)
    slow.gate.release()
    fast.gate.release()
    returned(r, "slow", "fast")
    at(r, c, 1.0)  # both collected at 1
    at(r, c, 3.0)  # both due again (fast at 2, slow at 3): the second calls hang

    def gpus(t):
        c.t = t
        r._publish()
        return sorted(s.resource for s in by_metric(r.snapshot, "hw.power"))

    assert gpus(6.0) == ["GPU-fast", "GPU-slow"]
    assert gpus(6.0 + EPS) == ["GPU-slow"]
    assert gpus(7.0) == ["GPU-slow"]
    assert gpus(7.0 + EPS) == []
    slow.gate.release()
    fast.gate.release()
    returned(r, "slow", "fast")


def test_unavailable_probe_retries_after_1_2_4_s_doubling_up_to_300_s_and_afresh_after_success(caplog):
    caplog.set_level(logging.INFO, logger="gpuwatch.runner")
    c = Clocks()
    p = Scripted("flaky", interval=5.0, start_fails=11)
    r = clocked([p], c)
    s = slot(r, "flaky")
    t = 0.0
    at(r, c, t)
    for wait in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 300.0, 300.0):
        returned(r, "flaky")
        at(r, c, t)  # the failed start is collected at t
        assert s.busy_since is None
        at(r, c, t + wait - EPS)
        assert s.busy_since is None  # not a moment early
        at(r, c, t + wait)
        assert s.busy_since == t + wait
        t += wait
    returned(r, "flaky")
    assert t == 1111.0 and p.starts == 12 and p.shutdowns == 0  # never started: nothing to shut down
    at(r, c, t)
    st = status(r, "flaky")
    assert st.up and st.state == "up" and st.reason == "" and st.errors_total == 0 and st.last_success == W0 + t
    down = [(e.kind, e.resource, dict(e.attrs)) for e in r.events]
    assert down == [("probe.down", "", {"probe": "flaky",
                                       "reason": "NVML library not found: install the NVIDIA driver"})]
    assert logged(caplog, logging.WARNING) == [
        "probe flaky unavailable: NVML library not found: install the NVIDIA driver (retrying in 1 s)"]
    assert logged(caplog, logging.INFO) == ["probe flaky is up"]
    at(r, c, t + 5.0)
    returned(r, "flaky")
    at(r, c, t + 5.0)
    assert logged(caplog, logging.INFO) == ["probe flaky is up"]  # said when it comes up, not at every collection
    t += 5.0
    # The source goes away after a success: shut down, retried 1 s later (the backoff starts over), started anew.
    p.read = raising(ProbeUnavailable("GPU is lost: reboot the node"))
    at(r, c, t + 5.0)
    returned(r, "flaky")
    at(r, c, t + 5.0)
    assert p.shutdowns == 1 and status(r, "flaky").state == "unavailable" and not status(r, "flaky").up
    assert status(r, "flaky").reason == "GPU is lost: reboot the node"
    assert by_metric(r.snapshot, "hw.power") == []  # a failed collection's samples leave at once
    at(r, c, t + 6.0 - EPS)
    assert s.busy_since is None
    at(r, c, t + 6.0)
    assert s.busy_since == t + 6.0
    returned(r, "flaky")
    assert p.starts == 13
    assert [dict(e.attrs)["reason"] for e in r.events] == [
        "NVML library not found: install the NVIDIA driver", "GPU is lost: reboot the node"]


def test_failing_probe_backs_off_counts_each_error_and_logs_each_distinct_error_once(caplog):
    c = Clocks()
    p = Scripted("boom", interval=2.0, read=raising(RuntimeError("bad answer")))
    r = clocked([p], c)
    slot(r, "boom").timer = Timer(0.25)
    at(r, c, 0.0)
    returned(r, "boom")
    assert at(r, c, 0.0) is True
    assert status(r, "boom") == ProbeStatus(name="boom", up=False, reason="RuntimeError: bad answer",
                                            state="failing", last_duration=0.25, errors_total=1, interval=2.0)
    assert p.shutdowns == 1  # started, then failed: shut down so the next try starts afresh
    # A probe that fails on every try backs off as an unavailable one does: 1 s, 2 s, 4 s, 8 s.
    t = 0.0
    for wait in (1.0, 2.0, 4.0, 8.0):
        at(r, c, t + wait - EPS)
        assert slot(r, "boom").busy_since is None
        at(r, c, t + wait)
        assert slot(r, "boom").busy_since == t + wait
        returned(r, "boom")
        t += wait
        at(r, c, t)
    assert status(r, "boom").errors_total == 5 and p.starts == 5 and p.shutdowns == 5
    errors = {s.labels["probe"]: s.value for s in by_metric(r.snapshot, "gpuwatch.probe.errors")}
    assert errors == {"boom": 5.0}
    assert [e.kind for e in r.events] == ["probe.down"]  # the same reason again: no new event
    # One warning and one traceback for five failures with the same error.
    assert logged(caplog, logging.WARNING) == ["probe boom failing: RuntimeError: bad answer (retrying in 1 s)"]
    tracebacks = logged(caplog, logging.ERROR)
    assert len(tracebacks) == 1 and tracebacks[0].startswith("probe boom failed with an error gpuwatch did not")
    assert "Traceback (most recent call last)" in tracebacks[0] and "RuntimeError: bad answer" in tracebacks[0]
    # Another error is another line; then the first error again is not said again.
    p.read = raising(KeyError("gpu"))
    at(r, c, t + 16.0)
    returned(r, "boom")
    t += 16.0
    at(r, c, t)
    p.read = raising(RuntimeError("bad answer"))
    at(r, c, t + 32.0)
    returned(r, "boom")
    t += 32.0
    at(r, c, t)
    assert logged(caplog, logging.WARNING) == ["probe boom failing: RuntimeError: bad answer (retrying in 1 s)",
                                               "probe boom failing: KeyError: 'gpu' (retrying in 32 s)"]
    assert len(logged(caplog, logging.ERROR)) == 2
    states = {s.labels["state"]: s.value for s in by_metric(r.snapshot, "gpuwatch.probe.state")}
    assert states == {"starting": 0.0, "up": 0.0, "late": 0.0, "disabled": 0.0, "unavailable": 0.0,
                      "failing": 1.0}
    # Up again, then the same error: said again (once), for it is news after a recovery.
    p.read = lambda: [Sample("hw.power", 100.0, "GPU-boom", {}, W0)]
    at(r, c, t + 64.0)
    returned(r, "boom")
    t += 64.0
    at(r, c, t)
    assert status(r, "boom").up
    p.read = raising(RuntimeError("bad answer"))
    at(r, c, t + 2.0)
    returned(r, "boom")
    at(r, c, t + 2.0)
    assert logged(caplog, logging.WARNING)[-1] == "probe boom failing: RuntimeError: bad answer (retrying in 1 s)"
    assert len(logged(caplog, logging.ERROR)) == 3


def test_a_probe_whose_extra_is_not_installed_is_disabled_not_down_said_once_and_looked_at_every_300_s(caplog):
    caplog.set_level(logging.INFO, logger="gpuwatch.runner")
    c = Clocks()
    p = Scripted("baseline", interval=5.0,
                 read=raising(ProbeDisabled("torch not importable: pip install 'gpuwatch[baseline]'")))
    r = clocked([p], c)
    t = 0.0
    for _ in range(3):
        at(r, c, t)
        returned(r, "baseline")
        at(r, c, t)
        st = status(r, "baseline")
        assert st.state == "disabled" and not st.up and st.errors_total == 0
        assert st.reason == "torch not importable: pip install 'gpuwatch[baseline]'"
        at(r, c, t + 300.0 - EPS)
        assert slot(r, "baseline").busy_since is None
        t += 300.0
    states = {s.labels["state"]: s.value for s in by_metric(r.snapshot, "gpuwatch.probe.state")}
    assert states["disabled"] == 1.0 and sum(states.values()) == 1.0
    assert logged(caplog, logging.INFO) == [
        "probe baseline disabled: torch not importable: pip install 'gpuwatch[baseline]'"]
    assert logged(caplog, logging.WARNING) == [] and list(r.events) == []  # not a probe going down


def test_a_probe_whose_shutdown_fails_is_still_started_afresh(caplog):
    class BadShutdown(Scripted):
        def shutdown(self):
            super().shutdown()
            raise OSError("device busy")

    c = Clocks()
    p = BadShutdown("bad", interval=1.0, read=raising(ProbeUnavailable("gone")))
    r = clocked([p], c)
    at(r, c, 0.0)
    returned(r, "bad")
    at(r, c, 0.0)
    assert logged(caplog, logging.ERROR) == ["probe bad shutdown failed"]
    at(r, c, 1.0)
    returned(r, "bad")
    assert p.starts == 2 and p.shutdowns == 1


def test_a_good_collection_publishes_its_samples_status_events_and_the_agents_own_metrics():
    c = Clocks()
    xid = Event("xid", "GPU-ok", {"xid": 79}, W0)
    p = Scripted("ok", interval=2.0)
    p.pending_events = [xid]
    r = clocked([p], c)
    slot(r, "ok").timer = Timer(0.25)
    assert slot(r, "ok").thread.name == "probe-ok" and slot(r, "ok").thread.daemon  # a stuck call never holds exit
    at(r, c, 3.0)
    returned(r, "ok")
    assert at(r, c, 3.5) is True
    wall, lab = W0 + 3.5, {"probe": "ok"}
    snap = r.snapshot
    assert snap.ts == wall and snap.events == (xid,) and snap.findings == ()
    assert snap.probes == {"ok": ProbeStatus(name="ok", up=True, reason="", state="up", last_duration=0.25,
                                             last_success=wall, interval=2.0)}
    assert list(snap.samples) == [
        Sample("hw.power", 100.0, "GPU-ok", {}, W0),
        Sample("gpuwatch.build", 1.0, "", {"version": __version__, "python": platform.python_version()}, wall),
        Sample("gpuwatch.probe.up", 1.0, "", lab, wall),
        *(Sample("gpuwatch.probe.state", 1.0 if state == "up" else 0.0, "", {**lab, "state": state}, wall)
          for state in ("starting", "up", "late", "disabled", "unavailable", "failing")),
        Sample("gpuwatch.probe.duration", 0.25, "", lab, wall),
        Sample("gpuwatch.probe.late", 0.0, "", lab, wall),
        Sample("gpuwatch.probe.errors", 0.0, "", lab, wall),
        Sample("gpuwatch.history.points.future", 0.0, "", lab, wall),
        Sample("gpuwatch.history.series", 1.0, "", {}, wall),
        Sample("gpuwatch.history.series.evicted", 0.0, "", {"reason": "expired"}, wall),
        Sample("gpuwatch.history.series.evicted", 0.0, "", {"reason": "cap"}, wall),
        Sample("gpuwatch.findings.dropped", 0.0, "", {}, wall),
    ]
    assert [(k, pts) for k, pts in r.history.series("hw.power")] == [(("hw.power", "GPU-ok", ()), [(W0, 100.0)])]
    # Due again one interval after it was collected (3.5), not after it was started.
    assert at(r, c, 5.5 - EPS) is False and slot(r, "ok").busy_since is None
    at(r, c, 5.5)
    assert slot(r, "ok").busy_since == 5.5
    returned(r, "ok")


def test_history_keeps_each_point_once_and_none_older_than_the_newest_already_kept():
    c = Clocks()
    reads = [
        [Sample("hw.power", 1.0, "GPU-h", {}, W0), Sample("hw.clock", 2.0, "GPU-h", {}, W0 - 10)],
        # re-emitted between reads, and a first point older than the newest kept (W0): all skipped
        [Sample("hw.power", 1.0, "GPU-h", {}, W0), Sample("hw.clock", 2.0, "GPU-h", {}, W0 - 10),
         Sample("hw.fan", 3.0, "GPU-h", {}, W0 - 5)],
        [Sample("hw.power", 4.0, "GPU-h", {}, W0 + 1)],
        [],  # nothing this time
    ]
    p = Scripted("h", interval=1.0, read=lambda: reads.pop(0))
    r = clocked([p], c)
    for t in (0.0, 1.0, 2.0, 3.0):
        at(r, c, t)
        returned(r, "h")
        at(r, c, t)
    pts = {m: [p for _, p in r.history.series(m)] for m in ("hw.power", "hw.clock", "hw.fan")}
    assert pts == {"hw.power": [[(W0, 1.0), (W0 + 1, 4.0)]], "hw.clock": [[(W0 - 10, 2.0)]], "hw.fan": []}
    assert status(r, "h").up


def test_a_wall_clock_step_of_more_than_a_minute_moves_history_with_it_and_a_minute_does_not(caplog):
    c = Clocks()
    p = Scripted("w", interval=100.0, read=lambda: [Sample("hw.power", 1.0, "GPU-w", {}, c.wall())])
    r = clocked([p], c)
    at(r, c, 0.0)
    returned(r, "w")
    at(r, c, 0.0)

    def points():
        (_, pts), = r.history.series("hw.power")
        return [t for t, _ in pts]

    assert points() == [W0]
    c.step = 60.0
    at(r, c, 1.0)
    assert points() == [W0]  # a minute is drift: left alone
    c.step = 120.25
    at(r, c, 2.0)
    assert points() == [W0 + 60.25]
    c.step = 60.25
    at(r, c, 3.0)
    assert points() == [W0 + 60.25]  # a minute back: left alone too
    c.step = -3600.0
    at(r, c, 4.0)
    assert points() == [W0 - 3600.0]
    assert logged(caplog, logging.WARNING) == [
        "the wall clock stepped by +60 s: moving history with it so trends stay continuous",
        "the wall clock stepped by -3660 s: moving history with it so trends stay continuous"]
    # A point read after the step back is newer than the (moved) newest one: kept.
    at(r, c, 100.0)
    returned(r, "w")
    at(r, c, 100.0)
    assert points() == [W0 - 3600.0, W0 + 100.0 - 3600.0]


def test_a_value_re_emitted_after_a_wall_step_is_not_added_to_history_again():
    c = Clocks()
    # A static value, read once at W0 and re-emitted with that time by every collection.
    p = Scripted("s", interval=10.0, read=lambda: [Sample("hw.gpu.memory.limit", 141.0, "GPU-s", {}, W0)])
    r = clocked([p], c)
    at(r, c, 0.0)
    returned(r, "s")
    at(r, c, 0.0)
    c.step = 3600.0
    at(r, c, 10.0)
    returned(r, "s")
    at(r, c, 10.0)
    (_, pts), = r.history.series("hw.gpu.memory.limit")
    assert pts == [(W0 + 3600.0, 141.0)]


def test_points_of_a_collection_begun_before_a_wall_step_stay_out_of_history():
    c = Clocks()
    p = Scripted("g", interval=10.0, gated=True, read=lambda: [Sample("hw.power", 1.0, "GPU-g", {}, c.wall())])
    r = clocked([p], c)

    def collect(t_start, t_end, step=None):
        at(r, c, t_start)
        if step is not None:
            c.step = step
            at(r, c, t_end)
        p.gate.release()
        returned(r, "g")
        at(r, c, t_end)

    def points():
        return [t for _, pts in r.history.series("hw.power") for t, _ in pts]

    collect(0.0, 0.0)
    assert points() == [W0]
    # The step is seen in the same pass that starts the collection: it reads the new time line, kept.
    c.step = 3600.0
    collect(10.0, 10.0)
    assert points() == [W0 + 3600.0, W0 + 3610.0]
    # Started at 20, the step seen at 21 while it runs: its points may be on either time line, not kept.
    collect(20.0, 21.0, step=7200.0)
    assert points() == [W0 + 7200.0, W0 + 7210.0]
    assert [s.ts for s in by_metric(r.snapshot, "hw.power")] == [W0 + 21.0 + 7200.0]  # still served
    collect(31.0, 31.0)
    assert points() == [W0 + 7200.0, W0 + 7210.0, W0 + 7231.0]


class ScriptedDetector(Detector):
    """Judges by script: each judgement takes the next entry, findings or an exception to raise."""

    def __init__(self, interval, script):
        self.name, self.interval = "scripted", interval
        self.script = list(script)
        self.judged = 0

    def observe(self, history):
        self.judged += 1
        out = self.script.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    def samples(self, findings):
        return [Sample("gpuwatch.test.finding", 1.0, f.resource, {"kind": f.kind}, W0) for f in findings]


def test_a_detector_judges_on_its_interval_and_its_findings_stand_between_and_after_a_failure(caplog):
    c = Clocks()
    f = Finding("memory_leak", "GPU-a", "warning", "grows", {"pid": "1", "color": "black"}, W0)
    d = ScriptedDetector(10.0, [[f], RuntimeError("bug"), []])
    r = clocked([], c, detectors=[d])

    def judge(t):
        c.t = t
        r._publish()
        return d.judged, r.snapshot.findings, [s.resource for s in by_metric(r.snapshot, "gpuwatch.test.finding")]

    assert judge(0.0) == (1, (f,), ["GPU-a"])
    assert judge(10.0 - EPS) == (1, (f,), ["GPU-a"])
    assert judge(10.0) == (2, (f,), ["GPU-a"])  # failed: its last findings stand
    assert logged(caplog, logging.ERROR) == ["detector scripted failed"]
    assert judge(20.0 - EPS) == (2, (f,), ["GPU-a"])  # a failure is not retried every pass
    assert judge(20.0) == (3, (), [])


def test_findings_open_update_on_a_new_severity_and_close_as_events_keyed_by_kind_resource_and_identity():
    c = Clocks()
    a = Finding("memory_leak", "GPU-a", "warning", "grows 10 MiB/s", {"pid": 4242, "color": "black"})
    a_crit = Finding("memory_leak", "GPU-a", "critical", "grows 90 MiB/s", {"pid": 4242, "color": "black"})
    a_more = Finding("memory_leak", "GPU-a", "critical", "grows 95 MiB/s", {"pid": "4242", "color": "black"})
    b = Finding("memory_leak", "GPU-a", "warning", "grows 1 MiB/s", {"pid": 7, "color": "black"})
    events = []
    d = ScriptedDetector(0.0, [[a], [a_crit], [a_more, b], [b], []])
    r = clocked([], c, detectors=[d], on_event=events.append)
    for t in range(5):
        c.t = float(t)
        r._publish()

    def ev(kind, f, t):
        return Event(kind, "GPU-a", {"kind": "memory_leak", "severity": f.severity, "summary": f.summary, **f.attrs},
                     W0 + t)

    # a_more is a_crit with a new summary: the same finding (pid 4242 either way), no event.
    assert events == [ev("finding.opened", a, 0), ev("finding.updated", a_crit, 1), ev("finding.opened", b, 2),
                      ev("finding.closed", a_more, 3), ev("finding.closed", b, 4)]
    assert r.snapshot.events == tuple(events)


def test_finding_key_is_kind_resource_and_the_identity_attributes_as_text():
    assert finding_key(Finding("xid", "GPU-a", "critical", "XID 79", {"id": 79})) == ("xid", "GPU-a", "79", "", "")
    assert finding_key(Finding("memory_leak", "GPU-b", "warning", "s", {"pid": 4242, "color": "black", "rate": 1.5})) \
        == ("memory_leak", "GPU-b", "", "4242", "black")
    assert finding_attrs(Finding("xid", "GPU-a", "critical", "XID 79", {"id": 79})) == {
        "kind": "xid", "severity": "critical", "summary": "XID 79", "id": 79}


def test_history_expires_old_series_on_every_hundredth_publish():
    c = Clocks()
    h = History(expire_after=30.0)
    h.append([Sample("hw.power", 1.0, "GPU-x", {}, W0)])
    r = clocked([], c, history=h)
    c.t = 30.0 + EPS  # its newest point is now just past expire_after old (by the wall clock)
    for _ in range(99):
        r._publish()
    assert len(h) == 1
    r._publish()
    assert len(h) == 0 and r.ticks == 100


def test_events_keep_the_newest_max_events_and_a_failing_handler_is_logged_not_raised(caplog):
    seen = []

    def handler(ev):
        seen.append(ev)
        raise ValueError("handler bug")

    c = Clocks()
    p = Scripted("e", read=lambda: [])
    xids = [Event("xid", "GPU-e", {"xid": n}, W0) for n in (13, 31, 79)]
    p.pending_events = list(xids)
    r = clocked([p], c, max_events=2, on_event=handler)
    at(r, c, 0.0)
    returned(r, "e")
    assert at(r, c, 0.0) is True
    assert seen == xids and r.snapshot.events == tuple(xids[1:])
    assert logged(caplog, logging.ERROR) == ["event handler failed"] * 3


class RecordingExporter(Exporter):
    def __init__(self, name, fail=False):
        self.name, self.fail = name, fail
        self.got, self.shutdowns = [], 0

    def publish(self, snapshot):
        self.got.append(snapshot)
        if self.fail:
            raise RuntimeError("socket closed")

    def shutdown(self):
        self.shutdowns += 1
        if self.fail:
            raise RuntimeError("socket closed")


def test_a_failing_exporter_is_logged_and_the_others_still_get_each_snapshot_and_shut_down(caplog):
    c = Clocks()
    bad, good = RecordingExporter("bad", fail=True), RecordingExporter("good")
    p = Scripted("x")
    r = clocked([p], c, exporters=[bad, good])
    at(r, c, 0.0)
    returned(r, "x")
    at(r, c, 0.0)
    assert len(good.got) == 1 and good.got[0] is r.snapshot and bad.got[0] is r.snapshot
    r.shutdown()
    assert bad.shutdowns == 1 and good.shutdowns == 1 and p.shutdowns == 1
    assert not slot(r, "x").thread.is_alive()
    assert logged(caplog, logging.ERROR) == ["exporter bad failed to publish", "exporter bad shutdown failed"]


def test_shutdown_stops_idle_probes_and_leaves_one_stuck_in_a_call(caplog):
    class BadShutdown(Scripted):
        def shutdown(self):
            super().shutdown()
            raise OSError("device busy")

    c = Clocks()
    bad, stuck, ok = BadShutdown("bad"), Scripted("stuck", gated=True), Scripted("ok")
    r = clocked([bad, stuck, ok], c)
    at(r, c, 0.0)
    returned(r, "bad", "ok")
    at(r, c, 0.0)
    assert stuck.entered.wait(5)  # inside its call, not merely told to start
    t0 = time.monotonic()
    r.shutdown(timeout=0.05)
    assert time.monotonic() - t0 < 1.0  # the stuck call is not waited on past the timeout
    assert (bad.shutdowns, stuck.shutdowns, ok.shutdowns) == (1, 0, 1)
    assert logged(caplog, logging.ERROR) == ["probe bad shutdown failed"]
    assert slot(r, "stuck").thread.is_alive() and not slot(r, "ok").thread.is_alive()
    stuck.gate.release()
    assert slot(r, "stuck").done.wait(5)
    slot(r, "stuck").thread.join(5)
    assert not slot(r, "stuck").thread.is_alive()  # returns to find the stop flag: exits, no new call
    assert stuck.collects == 1


def test_shutdown_shuts_down_a_probe_whose_stuck_call_returned_meanwhile():
    c = Clocks()
    p = Scripted("slow", gated=True)
    r = clocked([p], c)
    at(r, c, 0.0)
    assert p.entered.wait(5)
    p.gate.release()
    returned(r, "slow")  # returned, but no step has collected it: still busy to the runner
    r.shutdown()
    assert p.shutdowns == 1 and not slot(r, "slow").thread.is_alive()


def test_the_snapshot_keeps_the_newest_256_events_by_default():
    c = Clocks()
    p = Scripted("many", read=lambda: [])
    p.pending_events = [Event("xid", "GPU-m", {"n": n}, W0) for n in range(300)]
    r = clocked([p], c)
    at(r, c, 0.0)
    returned(r, "many")
    at(r, c, 0.0)
    assert [e.attrs["n"] for e in r.snapshot.events] == list(range(44, 300))


def test_probe_names_must_be_unique():
    with pytest.raises(ValueError) as e:
        Runner([Scripted("a"), Scripted("b"), Scripted("a")])
    assert str(e.value) == "probe names must be unique: ['a', 'b', 'a']"


def test_tick_once_runs_every_probe_now_and_gives_up_on_a_stuck_one_after_its_timeout():
    c = Clocks()
    ok, stuck = Scripted("ok", interval=100.0), Scripted("stuck", interval=100.0, gated=True)
    r = clocked([ok, stuck], c)
    stuck.gate.release()
    snap = r.tick_once()
    assert ok.collects == 1 and stuck.collects == 1 and snap is r.snapshot and snap.probes["stuck"].up
    c.t = 1.0  # not due again for 99 s: tick_once runs them anyway
    t0 = time.monotonic()
    snap = r.tick_once(timeout=0.05)
    assert time.monotonic() - t0 < 1.0
    assert ok.collects == 2 and slot(r, "stuck").busy_since == 1.0
    stuck.gate.release()
    returned(r, "stuck")


def test_run_steps_and_beats_every_pass_until_stopped():
    c = Clocks()
    p = Scripted("r", interval=100.0)
    r = clocked([p], c)
    beats = []

    def heartbeat():
        beats.append(r.ticks)
        if len(beats) == 2:
            r.stop()

    # Pass 1 starts the probe, whose return wakes the loop; pass 2 publishes it; stop() wakes and ends it.
    r.run(heartbeat=heartbeat, max_sleep=5.0)
    assert beats == [0, 1] and p.collects == 1 and status(r, "r").up

    own = threading.Event()
    r2 = clocked([Scripted("r2", interval=100.0)], c)
    r2.run(stop=own, heartbeat=own.set, max_sleep=0.01)  # a stop event of the caller's own
    assert own.is_set()


class ManyFindings:
    """A detector that finds `n` findings; the first `critical` of them critical."""

    name = "many"
    interval = 0.0

    def __init__(self, n, critical=0):
        self.n, self.critical = n, critical

    def observe(self, history):
        return [Finding("memory_leak", f"GPU-{i}", "critical" if i < self.critical else "warning", f"finding {i}",
                        {"pid": str(i)}, 0.0) for i in range(self.n)]

    def samples(self, findings):
        return [Sample("gpuwatch.leak.suspected", 1.0, f.resource, {"pid": f.attrs["pid"], "process": "x",
                                                                   "color": "white"}, 0.0) for f in findings]


def test_findings_open_at_once_are_capped_and_the_rest_counted_once(caplog):
    from gpuwatch.agent.runner import MAX_OPEN_FINDINGS

    events = []
    det = ManyFindings(10, critical=0)
    r = Runner([CountingProbe()], detectors=[det], on_event=events.append)
    r.tick_once()
    det.n, det.critical = 3 * MAX_OPEN_FINDINGS, 2 * MAX_OPEN_FINDINGS  # a flood, the critical ones last
    for _ in range(3):
        r.tick_once()
        r._detector_due = [0.0]
    snap = r.snapshot
    assert len(snap.findings) == MAX_OPEN_FINDINGS
    # Those open before stay open; then the critical ones.
    assert {f.resource for f in snap.findings} >= {f"GPU-{i}" for i in range(10)}
    assert all(f.severity == "critical" for f in snap.findings if int(f.resource[4:]) >= 10)
    assert sum(1 for e in events if e.kind == "finding.opened") == MAX_OPEN_FINDINGS
    assert len([s for s in snap.samples if s.metric == "gpuwatch.leak.suspected"]) == MAX_OPEN_FINDINGS
    dropped = next(s.value for s in snap.samples if s.metric == "gpuwatch.findings.dropped")
    assert dropped == 3 * MAX_OPEN_FINDINGS - MAX_OPEN_FINDINGS  # each left out once, not once per pass
    assert len([x for x in caplog.records if "findings at once" in x.getMessage()]) == 1


def test_points_from_the_future_are_not_kept_and_do_not_blind_the_probe(caplog):
    class Forger(Probe):
        name, interval = "forger", 1.0

        def __init__(self):
            self.forge = True

        def collect(self):
            now = time.time()
            out = [Sample("hw.power", 1.0, "GPU-a", {}, now)]
            if self.forge:
                out.append(Sample("hw.power", 1.0, "GPU-b", {}, 4e9))
            return out

    p = Forger()
    r = Runner([p])
    r.tick_once()
    p.forge = False
    time.sleep(0.01)
    r.tick_once()
    ((_, pts),) = list(r.history.series("hw.power", "GPU-a"))
    assert len(pts) == 2 and not list(r.history.series("hw.power", "GPU-b"))
    assert r.slots[0].appended_until < time.time() + 1
    assert next(s.value for s in r.snapshot.samples if s.metric == "gpuwatch.history.points.future") == 1.0


class _PidMemoryProbe(MemorySeriesProbe):
    def __init__(self, values, pid: int):
        super().__init__(values)
        self.pid = str(pid)

    def collect(self):
        out = super().collect()
        return [Sample(s.metric, s.value, s.resource, dict(s.labels, pid=self.pid) if s.labels else s.labels, s.ts)
                for s in out]


def test_a_processs_finding_closes_the_moment_it_exits_and_stays_closed():
    """A real process leaks (its memory series grows); once it has exited its finding closes at
    the next pass, says why, and is not opened again while the detector still judges the history
    it left."""
    import subprocess

    from gpuwatch.detectors.leak import LeakDetector
    child = subprocess.Popen(["sleep", "600"])
    try:
        values = [8 * 2**30 + i * 500 * 2**20 / 60 for i in range(600)]  # growing all along
        now = [0.0]
        events = []
        r = Runner([_PidMemoryProbe(values, child.pid)], detectors=[LeakDetector()], clock=lambda: now[0],
                   wallclock=lambda: 1_800_000_000.0 + now[0], on_event=events.append)
        tick = 0
        while not r.snapshot.findings:
            assert tick < 300, "the leak was never found"
            now[0] = float(tick)
            r.tick_once()
            tick += 1
        child.kill()
        child.wait()
        for _ in range(30):  # the detector keeps seeing the growth in the history
            now[0] = float(tick)
            snap = r.tick_once()
            tick += 1
            assert snap.findings == ()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    kinds = [e.kind for e in events if e.kind.startswith("finding.")]
    assert kinds.count("finding.opened") == 1 and kinds[-1] == "finding.closed"
    closed = [e for e in events if e.kind == "finding.closed"]
    assert closed[-1].attrs["closed_because"] == "process exited" and closed[-1].attrs["pid"] == str(child.pid)


def test_findings_about_processes_this_machine_does_not_have_are_left_to_the_detector():
    """An NVML replay names processes of another machine: no process to watch, so the finding
    lives as long as the detector reports it."""
    from gpuwatch.detectors.leak import LeakDetector
    pid = 1 << 22  # above the default pid_max: no such process
    values = [8 * 2**30 + i * 500 * 2**20 / 60 for i in range(300)]
    now = [0.0]
    r = Runner([_PidMemoryProbe(values, pid)], detectors=[LeakDetector()], clock=lambda: now[0],
               wallclock=lambda: 1_800_000_000.0 + now[0])
    open_ticks = 0
    for tick in range(300):
        now[0] = float(tick)
        open_ticks += bool(r.tick_once().findings)
    assert open_ticks > 100


class _FillingGpuProbe(Probe):
    """A process whose memory grows 1 GiB a minute on a GPU of `limit` bytes, one point a second."""
    name = "filling"

    def __init__(self, pid: int, base: float, limit: float, t0: float = 1_800_000_000.0):
        self.pid, self.base, self.limit, self.t0, self.i = str(pid), base, limit, t0, 0

    def collect(self):
        t, v = self.t0 + self.i, self.base + self.i * 2**30 / 60
        self.i += 1
        gpu = "GPU-oom"
        return [Sample("gpuwatch.process.gpu.memory.usage", v, gpu, {"pid": self.pid, "process": "leaker"}, t),
                Sample("hw.gpu.memory.limit", self.limit, gpu, {}, t),
                Sample("hw.gpu.memory.usage", v, gpu, {}, t)]


def test_a_leaking_process_gone_with_its_gpu_full_is_an_oom_scored_against_its_forecast():
    """The OOM the forecast predicted: the process exits when its GPU is full; the event says when
    it came against the forecast made when the leak was found, and is counted per GPU and cause."""
    import subprocess

    from gpuwatch.detectors.leak import LeakDetector
    limit = 20 * 2**30
    child = subprocess.Popen(["sleep", "600"])
    try:
        probe = _FillingGpuProbe(child.pid, 10 * 2**30, limit)  # full after 600 s at 1 GiB/min
        now = [0.0]
        events = []
        r = Runner([probe], detectors=[LeakDetector()], clock=lambda: now[0],
                   wallclock=lambda: 1_800_000_000.0 + now[0], on_event=events.append)
        tick, found_at = 0, None
        while probe.base + probe.i * 2**30 / 60 < 0.97 * limit:  # until 97 % full
            now[0] = float(tick)
            snap = r.tick_once()
            if snap.findings and found_at is None:
                found_at, forecast = tick, snap.findings[0].attrs["time_to_oom_seconds"]
            tick += 1
        child.kill()
        child.wait()
        now[0] = float(tick)
        r.tick_once()  # the exit: its OOM waits for better evidence (none comes here)
        now[0] = tick + oom_mod.EXIT_HOLD_S
        snap = r.tick_once()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert found_at is not None and forecast is not None
    oom = [e for e in events if e.kind == "finding.oom"]
    assert len(oom) == 1, [e.kind for e in events]
    a = oom[0].attrs
    assert oom[0].resource == "GPU-oom" and a["cause"] == "gpu_full_at_exit" and a["pid"] == str(child.pid)
    assert a["forecast_seconds"] == round(forecast, 1)
    came = a["came_after_seconds"]
    assert abs(came - (tick - found_at)) <= 1.0  # from the first pass that saw the finding
    assert a["forecast_error_ratio"] == pytest.approx(came / forecast - 1, abs=1e-3)
    assert "ran out of GPU memory" in a["summary"] and "GPU 9" in a["summary"]
    counted = {(s.resource, s.labels["cause"]): s.value for s in snap.samples if s.metric == "gpuwatch.oom.events"}
    assert counted == {("GPU-oom", "gpu_full_at_exit"): 1.0}
    (error,) = [s for s in snap.samples if s.metric == "gpuwatch.oom.forecast.error"]
    assert error.labels == {"came": "early" if a["forecast_error_ratio"] < 0 else "late"}
    assert error.histogram.count == 1 and error.histogram.sum == pytest.approx(abs(a["forecast_error_ratio"]), abs=1e-3)
    assert error.histogram.start == 1_800_000_000.0  # the runner's wall clock when it started


def test_a_driver_oom_event_is_scored_once_and_a_leak_ending_without_a_full_gpu_is_none():
    from gpuwatch.agent.oom import OomRecorder
    rec = OomRecorder(History(), alive=lambda pid: False)  # the process died of it
    ev = Event("cuda.oom", "", {"pid": "77", "process": "jax", "api": "cuMemAlloc_v2", "errors": 3}, 100.0)
    assert rec.driver_oom(ev, 100.0) is None  # held: due() judges it
    (first,) = rec.due(100.0)
    assert first.attrs["cause"] == "driver" and "no leak was forecast" in first.attrs["summary"]
    assert "cuMemAlloc_v2 (3 calls)" in first.attrs["summary"]
    rec.driver_oom(ev, 130.0)
    assert rec.due(130.0) == []  # the same OOM, retried
    rec.driver_oom(ev, 200.0)
    assert len(rec.due(200.0)) == 1  # a later one
    leak = Finding("memory_leak", "GPU-x", "warning", "leak", {"pid": "78", "process": "p", "time_to_oom_seconds": 90.0})
    rec.leak_seen(leak, 10.0)
    rec.leak_closed(leak, exited=True, wall=50.0)
    assert rec.due(100.0) == []  # no GPU memory series: not judged full


class _FixedFindings(Detector):
    """Reports the same findings at every pass."""
    name = "fixed"

    def __init__(self, findings):
        self.findings = findings

    def observe(self, history):
        return list(self.findings)


def test_each_finding_about_a_process_is_judged_on_its_own():
    """One pass with a finding without a process, one whose process has exited and one whose
    process runs: only the exited one closes, and the runner keeps no state for closed ones."""
    import subprocess
    gone, alive = subprocess.Popen(["sleep", "600"]), subprocess.Popen(["sleep", "600"])
    try:
        found = [Finding("thermal", "GPU-t", "warning", "hot", {}),
                 Finding("memory_leak", "GPU-t", "warning", "gone", {"pid": str(gone.pid)}),
                 Finding("memory_leak", "GPU-t", "warning", "alive", {"pid": str(alive.pid)}),
                 Finding("memory_leak", "GPU-t", "warning", "later", {"pid": str(alive.pid), "color": "grey"})]
        events = []
        r = Runner([CountingProbe()], detectors=[_FixedFindings(found)], on_event=events.append)
        r.tick_once()
        assert {f.summary for f in r.snapshot.findings} == {"hot", "gone", "alive", "later"}
        gone.kill()
        gone.wait()
        r.tick_once()
        r.tick_once()
        assert [f.summary for f in r.snapshot.findings] == ["hot", "alive", "later"]
        assert [e.attrs["summary"] for e in events if e.kind == "finding.closed"] == ["gone"]
        assert len(r._finding_starts) == 2  # the two findings of the running process
    finally:
        for p in (gone, alive):
            if p.poll() is None:
                p.kill()
                p.wait()


class _OomEventsProbe(Probe):
    """A probe that reports what the eBPF probe does when the driver returns an OOM."""
    name = "oomy"

    def __init__(self):
        self.pending = [Event("cuda.oom", "", {"pid": "31", "process": "p", "api": "cuMemAlloc_v2", "errors": 1}, 0.0)]

    def collect(self):
        return []

    def events(self):
        out, self.pending = self.pending, []
        return out


def test_a_driver_oom_from_a_probe_becomes_one_scored_oom_event():
    """Held while its process runs (it may back off and go on), made when it exits, dated at the refusal."""
    events = []
    wall = [1_800_000_000.0]
    r = Runner([_OomEventsProbe()], on_event=events.append, wallclock=lambda: wall[0])
    running = {"31"}
    r.leaks.alive = lambda pid: pid in running
    r.tick_once()
    assert events == []  # the evidence itself is not an event of its own
    refused_at = wall[0]
    wall[0] += 1
    running.clear()
    snap = r.tick_once()
    assert [e.kind for e in events] == ["finding.oom"]
    assert events[0].attrs["cause"] == "driver" and events[0].ts == refused_at
    counted = [s for s in snap.samples if s.metric == "gpuwatch.oom.events"]
    assert [(s.resource, s.labels, s.value, s.ts) for s in counted] == [("", {"cause": "driver"}, 1.0, wall[0])]


def test_shutdown_shuts_every_probe_down_at_once_and_the_exporters_after_them():
    """One probe's shutdown waiting (NVML's event wait, uprobes detaching) does not hold up the
    others': here the first waits for the second's to have begun, which a stop one probe after
    another never lets happen. Every probe is shut down once, before any exporter."""
    order: list[str] = []
    second_began = threading.Event()

    class WaitsForTheOther(Scripted):
        def shutdown(self):
            self.saw_the_other = second_began.wait(10)
            super().shutdown()
            order.append(self.name)

    class Second(Scripted):
        def shutdown(self):
            second_began.set()
            super().shutdown()
            order.append(self.name)

    class Last(RecordingExporter):
        def shutdown(self):
            order.append(self.name)
            super().shutdown()

    c = Clocks()
    first, second = WaitsForTheOther("first"), Second("second")
    exporter = Last("exporter")
    r = clocked([first, second], c, exporters=[exporter])
    at(r, c, 0.0)
    returned(r, "first", "second")
    at(r, c, 0.0)
    r.shutdown()
    assert first.saw_the_other and (first.shutdowns, second.shutdowns, exporter.shutdowns) == (1, 1, 1)
    assert order == ["second", "first", "exporter"]
