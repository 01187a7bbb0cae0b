"""agent/oom.py: OOM events scored against the leak forecast, field by field (the runner's end-to-
end cases are in test_runner.py)."""
import pytest

from gpuwatch.agent import oom as oom_mod
from gpuwatch.agent.api import Event, Finding, Sample
from gpuwatch.agent.history import History
from gpuwatch.agent.oom import OomRecorder

GIB = 2**30


def leak(pid="42", tto=120.0, process="trainer", color="black", gpu="GPU-a") -> Finding:
    return Finding("memory_leak", gpu, "warning", "leak", {"pid": pid, "process": process, "color": color,
                                                            "time_to_oom_seconds": tto})


def gpu_memory(h: History, gpu: str, points: list[tuple[float, float]], limit: float = 100 * GIB) -> None:
    h.append([s for t, used in points for s in (Sample("hw.gpu.memory.usage", used, gpu, {}, t),
                                                   Sample("hw.gpu.memory.limit", limit, gpu, {}, t))])


def test_an_exit_with_the_gpu_full_is_scored_against_the_first_forecast():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(tto=120.0), 1000.0)
    rec.leak_seen(leak(tto=5.0), 1100.0)  # later forecasts do not replace the first
    gpu_memory(h, "GPU-a", [(1128.0, 60 * GIB), (1130.0, 97 * GIB)])
    ev = rec.leak_closed(leak(), exited=True, wall=1132.0)
    assert (ev.kind, ev.resource, ev.ts) == ("finding.oom", "GPU-a", 1132.0)
    assert dict(ev.attrs) == {
        "kind": "oom", "severity": "critical", "pid": "42", "process": "trainer", "cause": "gpu_full_at_exit",
        "leak_found_at": 1000.0, "came_after_seconds": 132.0, "color": "black", "forecast_seconds": 120.0,
        "forecast_error_ratio": 0.1,
        "summary": "trainer (pid 42) ran out of GPU memory: it exited with its GPU 97% full; forecast 2.0 min when "
                   "the leak was found, came at 2.2 min (+10%)"}
    counted, error = rec.samples(1133.0)
    assert counted == Sample("gpuwatch.oom.events", 1.0, "GPU-a", {"cause": "gpu_full_at_exit"}, 1133.0)
    assert (error.metric, error.resource, error.labels, error.ts) == ("gpuwatch.oom.forecast.error", "GPU-a",
                                                                      {"came": "late"}, 1133.0)
    # 132 / 120 - 1 is 0.1 and a little in floats, counted as the event says it: in le 0.1
    assert error.value == 1.0 and error.histogram.counts == (0, 1, 0, 0, 0, 0, 0)
    assert error.histogram.sum == pytest.approx(0.1) and error.histogram.start == rec.started
    assert rec.leak_closed(leak(), exited=True, wall=1140.0) is None  # its forecast went with the first


@pytest.mark.parametrize("exited,points,why", [
    (False, [(1130.0, 99 * GIB)], "the growth stopped: no exit"),
    (True, [(1130.0, 94 * GIB)], "under 95 % full"),
    (True, [(1120.0, 99 * GIB), (1131.0, 50 * GIB)], "full only before the last 5 s"),
    (True, [], "no memory series for the GPU"),
])
def test_a_leak_that_ends_otherwise_is_no_oom(exited, points, why):
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(), 1000.0)
    gpu_memory(h, "GPU-a", points)
    gpu_memory(h, "GPU-other", [(1131.0, 99 * GIB)])  # another GPU's fullness is not this one's
    assert rec.leak_closed(leak(), exited=exited, wall=1132.0) is None, why
    assert rec.samples(1132.0) == []


def test_a_driver_oom_uses_the_forecast_and_names_the_call():
    rec = OomRecorder(History())
    rec.leak_seen(leak(pid="7", tto=600.0, process="jax", gpu="GPU-b"), 50.0)
    ev = rec.driver_oom(Event("cuda.oom", "", {"pid": "7", "process": "", "api": "cuMemAlloc_v2", "errors": 2}, 0), 590.0)
    assert ev.resource == "GPU-b" and ev.attrs["process"] == "jax"  # its own name missing: the leak's
    assert ev.attrs["summary"] == ("jax (pid 7) ran out of GPU memory: the driver returned CUDA_ERROR_OUT_OF_MEMORY "
                                   "to cuMemAlloc_v2 (2 calls); forecast 10.0 min when the leak was found, came at "
                                   "9.0 min (-10%)")
    assert ev.attrs["forecast_error_ratio"] == -0.1 and ev.attrs["cause"] == "driver"
    # the process then exits with a full GPU: the same OOM, not a second
    assert rec.leak_closed(leak(pid="7", gpu="GPU-b"), exited=True, wall=600.0) is None
    assert rec.events_total == {("GPU-b", "driver"): 1}


def test_the_same_oom_within_a_minute_and_a_new_one_after():
    rec = OomRecorder(History())
    ev = Event("cuda.oom", "", {"pid": "9", "process": "p"}, 0)
    first = rec.driver_oom(ev, 100.0)
    assert first.attrs["summary"] == ("p (pid 9) ran out of GPU memory: the driver returned CUDA_ERROR_OUT_OF_MEMORY "
                                      "to an allocation (1 calls); no leak was forecast for it")
    assert first.resource == "" and "forecast_seconds" not in first.attrs
    assert rec.driver_oom(ev, 100.0 + oom_mod.SAME_OOM_S - 0.001) is None
    assert rec.driver_oom(ev, 100.0 + oom_mod.SAME_OOM_S) is not None
    assert rec.driver_oom(Event("cuda.oom", "", {"process": "p"}, 0), 500.0) is None  # no pid: nothing to score
    assert rec.samples(501.0) == [Sample("gpuwatch.oom.events", 2.0, "", {"cause": "driver"}, 501.0)]


def test_a_leak_without_a_forecast_says_when_it_was_found():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(tto=None, process=""), 0.0)
    gpu_memory(h, "GPU-a", [(179.0, 100 * GIB)])
    ev = rec.leak_closed(leak(process=""), exited=True, wall=180.0)
    assert ev.attrs["summary"] == ("process (pid 42) ran out of GPU memory: it exited with its GPU 100% full; the "
                                   "leak was found 3.0 min before, with no time to OOM forecast")
    assert "forecast_error_ratio" not in ev.attrs and rec.errors == {}


def test_forecasts_and_recent_ooms_are_bounded(monkeypatch):
    monkeypatch.setattr(oom_mod, "MAX_TRACKED", 3)
    rec = OomRecorder(History())
    for pid in range(5):
        rec.leak_seen(leak(pid=str(pid)), float(pid))
    assert list(rec._forecasts) == ["2", "3", "4"]  # the oldest went
    for pid in range(5):
        rec.driver_oom(Event("cuda.oom", "", {"pid": str(100 + pid)}, 0), 10.0)
    assert list(rec._last_oom) == ["102", "103", "104"]


def test_the_edges_full_at_exactly_95_percent_and_a_leak_never_seen():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(), 0.0)
    gpu_memory(h, "GPU-a", [(10.0, 95 * GIB)])
    assert rec.leak_closed(leak(), exited=True, wall=11.0) is not None  # 95 % is full
    assert rec.leak_closed(leak(pid="99"), exited=True, wall=12.0) is None  # no forecast kept for it
