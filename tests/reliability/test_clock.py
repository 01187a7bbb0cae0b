"""Fault 13 of issue 8: the wall clock stepped by an hour, forward and back. The system clock cannot
be changed safely in a test, so the runner gets an injected wall clock that jumps (its `wallclock`
parameter) and a simulated monotonic clock (`clock`); probes stamp samples with the same wall clock."""
from __future__ import annotations

import pytest

from gpuwatch.agent.api import Probe, Sample
from gpuwatch.agent.runner import Runner
from gpuwatch.detectors.leak import LeakDetector


class Clocks:
    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = 1_800_000_000.0

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


class LeakingProcess(Probe):
    """A process whose GPU memory grows 500 MiB a minute, read at the (stepping) wall clock."""

    name = "mem"
    interval = 1.0

    def __init__(self, clocks: Clocks) -> None:
        self.clocks = clocks
        self.collections: list[float] = []  # monotonic time of each collection

    def collect(self):
        self.collections.append(self.clocks.mono)
        v = 8 * 2**30 + len(self.collections) * 500 * 2**20 / 60
        t, gpu = self.clocks.wall, "GPU-leak"
        return [Sample("gpuwatch.process.gpu.memory.usage", v, gpu, {"pid": "4242", "process": "python3"}, t),
                Sample("hw.gpu.memory.limit", float(141 * 2**30), gpu, {}, t),
                Sample("hw.gpu.memory.usage", v, gpu, {}, t)]


def drive(runner: Runner, clocks: Clocks, seconds: int, step: float = 0.25, on_tick=None) -> None:
    """Advance simulated time in small steps, letting each due collection finish before moving on."""
    for _ in range(int(seconds / step)):
        clocks.advance(step)
        runner.step()
        while any(s.busy_since is not None for s in runner.slots):
            for s in runner.slots:
                if s.busy_since is not None:
                    s.done.wait(5)
            runner.step()
        if on_tick is not None:
            on_tick()


@pytest.mark.parametrize("jump", [3600.0, -3600.0])
def test_13_wall_clock_step_keeps_cadence_history_and_findings(jump):
    clocks = Clocks()
    probe = LeakingProcess(clocks)
    events = []
    runner = Runner([probe], detectors=[LeakDetector()], clock=lambda: clocks.mono,
                    wallclock=lambda: clocks.wall, on_event=events.append)
    open_at: list[bool] = []
    drive(runner, clocks, 200, on_tick=lambda: open_at.append(bool(runner.snapshot.findings)))
    assert any(open_at), "the leak is found before the step"
    assert open_at[-1]
    before = len(probe.collections)
    history_points = sum(len(p) for _, p in runner.history.series("hw.gpu.memory.usage"))

    clocks.wall += jump  # the step
    after_step: list[bool] = []
    drive(runner, clocks, 120, on_tick=lambda: after_step.append(bool(runner.snapshot.findings)))

    # Cadence: one collection a (monotonic) second, no burst after a forward step, no stall after a back one.
    gaps = [b - a for a, b in zip(probe.collections, probe.collections[1:])]
    assert len(probe.collections) - before == pytest.approx(120, abs=2)
    assert max(gaps) <= 1.25 + 1e-9 and min(gaps) >= 1.0 - 1e-9
    # History keeps taking points, in order, without an hour-long gap.
    ((_, points),) = list(runner.history.series("hw.gpu.memory.usage"))
    assert len(points) >= min(runner.history.maxlen, history_points + 115)
    times = [t for t, _ in points]
    assert times == sorted(times) and max(b - a for a, b in zip(times, times[1:])) <= 1.5
    # The leak goes on, and so does its finding: not closed by the step, not reopened.
    assert all(after_step), "the finding closed across the clock step"
    kinds = [e.kind for e in events if e.kind.startswith("finding.")]
    assert kinds.count("finding.opened") == 1 and "finding.closed" not in kinds, kinds
    rate = next(s.value for s in runner.snapshot.samples if s.metric == "gpuwatch.leak.growth.rate")
    assert rate == pytest.approx(500 * 2**20 / 60, rel=0.2)  # bytes a second, as before the step


class SlowOnce(LeakingProcess):
    """Stamps its samples when it starts, then waits for `release` once `armed`: a collection in
    flight while the wall clock steps."""

    def __init__(self, clocks: Clocks) -> None:
        super().__init__(clocks)
        import threading

        self.armed = False
        self.started = threading.Event()
        self.release = threading.Event()

    def collect(self):
        samples = super().collect()
        if self.armed:
            self.armed = False
            self.started.set()
            self.release.wait(5)
        return samples


def test_13_a_collection_in_flight_across_the_step_does_not_disorder_history():
    clocks = Clocks()
    probe = SlowOnce(clocks)
    runner = Runner([probe], clock=lambda: clocks.mono, wallclock=lambda: clocks.wall)
    drive(runner, clocks, 30)
    probe.armed = True
    clocks.advance(1.0)
    runner.step()  # starts the collection, stamped on the old time line
    assert probe.started.wait(5)
    clocks.wall -= 3600
    clocks.advance(0.25)
    runner.step()  # sees the step while the collection is still running
    probe.release.set()
    drive(runner, clocks, 30)
    ((_, points),) = list(runner.history.series("hw.gpu.memory.usage"))
    times = [t for t, _ in points]
    assert times == sorted(times) and max(b - a for a, b in zip(times, times[1:])) <= 5  # one point left out
    assert len(points) >= 55
