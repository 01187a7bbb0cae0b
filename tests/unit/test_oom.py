"""agent/oom.py: OOM events scored against the leak forecast, field by field (the runner's end-to-
end cases are in test_runner.py)."""
import pytest

from gpuwatch.agent import oom as oom_mod
from gpuwatch.agent.api import Event, Finding, Sample
from gpuwatch.agent.history import History
from gpuwatch.agent.oom import OomRecorder as _OomRecorder

GIB = 2**30
ALLOC = "cuMemAlloc_v2"


def OomRecorder(history: History, started: float | None = None, alive=lambda pid: False) -> _OomRecorder:
    """A recorder whose processes have exited unless said (the driver's refusals are then judged at once)."""
    return _OomRecorder(history, started, alive=alive)


def refused(rec: _OomRecorder, ev: Event, wall: float) -> Event | None:
    """The driver refused `ev`'s process at `wall`: the OOM event due then, if any (held otherwise)."""
    assert rec.driver_oom(ev, wall) is None
    events = rec.due(wall)
    assert len(events) <= 1
    return events[0] if events else None


def cuda_calls(h: History, pid: str, points: list[tuple[float, float, float]], api: str = ALLOC) -> None:
    """The eBPF probe's counters of `api` in `pid`: (time, calls, errors) at each collection."""
    labels = {"pid": pid, "process": "jax", "api": api}
    h.append([s for t, calls, errors in points for s in (Sample("gpuwatch.cuda.calls", calls, "", labels, t),
                                                        Sample("gpuwatch.cuda.errors", errors, "", labels, t))])


def leak(pid="42", tto=120.0, process="trainer", color="black", gpu="GPU-a") -> Finding:
    return Finding("memory_leak", gpu, "warning", "leak", {"pid": pid, "process": process, "color": color,
                                                            "time_to_oom_seconds": tto})


def gpu_memory(h: History, gpu: str, points: list[tuple[float, float]], limit: float = 100 * GIB) -> None:
    h.append([s for t, used in points for s in (Sample("hw.gpu.memory.usage", used, gpu, {}, t),
                                                   Sample("hw.gpu.memory.limit", limit, gpu, {}, t))])


def closed(rec: OomRecorder, f: Finding, exited: bool, wall: float) -> Event | None:
    """The leak closes at `wall`; its OOM event, if any, once the exit's hold is over."""
    assert rec.leak_closed(f, exited=exited, wall=wall) is None
    assert rec.due(wall + oom_mod.EXIT_HOLD_S - 0.001) == []  # held for better evidence
    events = rec.due(wall + oom_mod.EXIT_HOLD_S)
    assert len(events) <= 1 and rec.due(wall + 2 * oom_mod.EXIT_HOLD_S) == []
    return events[0] if events else None


def test_an_exit_with_the_gpu_full_is_scored_against_the_first_forecast():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(tto=120.0), 1000.0)
    rec.leak_seen(leak(tto=5.0), 1100.0)  # later forecasts do not replace the first
    gpu_memory(h, "GPU-a", [(1128.0, 60 * GIB), (1130.0, 97 * GIB)])
    ev = closed(rec, leak(), True, 1132.0)
    assert (ev.kind, ev.resource, ev.ts) == ("finding.oom", "GPU-a", 1132.0)
    assert dict(ev.attrs) == {
        "kind": "oom", "severity": "critical", "pid": "42", "process": "trainer", "cause": "gpu_full_at_exit",
        "leak_found_at": 1000.0, "came_after_seconds": 132.0, "color": "black", "forecast_seconds": 120.0,
        "forecast_error_ratio": 0.1, "evidence": "it exited with its GPU 97% full",
        "score": "forecast 2.0 min when the leak was found, came at 2.2 min (+10%)",
        "summary": "trainer (pid 42) ran out of GPU memory: it exited with its GPU 97% full; forecast 2.0 min when "
                   "the leak was found, came at 2.2 min (+10%)"}
    counted, error = rec.samples(1133.0)
    assert counted == Sample("gpuwatch.oom.events", 1.0, "GPU-a", {"cause": "gpu_full_at_exit"}, 1133.0)
    assert (error.metric, error.resource, error.labels, error.ts) == ("gpuwatch.oom.forecast.error", "GPU-a",
                                                                      {"came": "late"}, 1133.0)
    # 132 / 120 - 1 is 0.1 and a little in floats, counted as the event says it: in le 0.1
    assert error.value == 1.0 and error.histogram.counts == (0, 1, 0, 0, 0, 0, 0)
    assert error.histogram.sum == pytest.approx(0.1) and error.histogram.start == rec.started
    assert closed(rec, leak(), True, 1140.0) is None  # its forecast went with the first


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
    assert closed(rec, leak(), exited, 1132.0) is None, why
    assert rec.samples(1132.0) == []


def test_a_driver_oom_uses_the_forecast_and_names_the_call():
    rec = OomRecorder(History())
    rec.leak_seen(leak(pid="7", tto=600.0, process="jax", gpu="GPU-b"), 50.0)
    ev = refused(rec, Event("cuda.oom", "", {"pid": "7", "process": "", "api": "cuMemAlloc_v2", "errors": 2}, 0), 590.0)
    assert ev.resource == "GPU-b" and ev.attrs["process"] == "jax"  # its own name missing: the leak's
    assert ev.attrs["summary"] == ("jax (pid 7) ran out of GPU memory: the driver returned CUDA_ERROR_OUT_OF_MEMORY "
                                   "to cuMemAlloc_v2 (2 calls); forecast 10.0 min when the leak was found, came at "
                                   "9.0 min (-10%)")
    assert ev.attrs["forecast_error_ratio"] == -0.1 and ev.attrs["cause"] == "driver"
    # the process then exits with a full GPU: the same OOM, not a second
    assert closed(rec, leak(pid="7", gpu="GPU-b"), True, 600.0) is None
    assert rec.events_total == {("GPU-b", "driver"): 1}


def test_the_same_oom_within_a_minute_and_a_new_one_after():
    rec = OomRecorder(History())
    ev = Event("cuda.oom", "", {"pid": "9", "process": "p"}, 0)
    first = refused(rec, ev, 100.0)
    assert first.attrs["summary"] == ("p (pid 9) ran out of GPU memory: the driver returned CUDA_ERROR_OUT_OF_MEMORY "
                                      "to an allocation (1 calls); no leak was forecast for it")
    assert first.resource == "" and "forecast_seconds" not in first.attrs
    assert refused(rec, ev, 100.0 + oom_mod.SAME_OOM_S - 0.001) is None
    assert refused(rec, ev, 100.0 + oom_mod.SAME_OOM_S) is not None
    assert refused(rec, Event("cuda.oom", "", {"process": "p"}, 0), 500.0) is None  # no pid: nothing to score
    assert rec.samples(501.0) == [Sample("gpuwatch.oom.events", 2.0, "", {"cause": "driver"}, 501.0)]


def test_a_leak_without_a_forecast_says_when_it_was_found():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(tto=None, process=""), 0.0)
    gpu_memory(h, "GPU-a", [(179.0, 100 * GIB)])
    ev = closed(rec, leak(process=""), True, 180.0)
    assert ev.attrs["summary"] == ("process (pid 42) ran out of GPU memory: it exited with its GPU 100% full; the "
                                   "leak was found 3.0 min before, with no time to OOM forecast")
    assert "forecast_error_ratio" not in ev.attrs and rec.errors == {}


def test_forecasts_and_recent_ooms_are_bounded(monkeypatch):
    monkeypatch.setattr(oom_mod, "MAX_TRACKED", 3)
    rec = OomRecorder(History())
    for pid in range(5):
        rec.leak_seen(leak(pid=str(pid)), float(pid))
    assert list(rec._forecasts) == [("2", "GPU-a"), ("3", "GPU-a"), ("4", "GPU-a")]  # the oldest went
    for pid in range(5):
        refused(rec, Event("cuda.oom", "", {"pid": str(100 + pid)}, 0), 10.0)
    assert list(rec._last_oom) == ["102", "103", "104"]


def test_the_edges_full_at_exactly_95_percent_and_a_leak_never_seen():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(), 0.0)
    gpu_memory(h, "GPU-a", [(10.0, 95 * GIB)])
    assert closed(rec, leak(), True, 11.0) is not None  # 95 % is full
    assert closed(rec, leak(pid="99"), True, 12.0) is None  # no forecast kept for it


def framework(pid="42", framework="torch", how="allocator", gpu="", **attrs) -> Event:
    return Event("framework.oom", gpu, {"pid": pid, "process": "trainer", "framework": framework, "how": how,
                                        "device": None, "requested_bytes": None, **attrs}, 0.0)


def test_a_framework_oom_is_scored_against_the_forecast_in_our_words():
    rec = OomRecorder(History(), started=10.0)
    rec.leak_seen(leak(tto=300.0, gpu="GPU-a"), 1000.0)
    # NVML does not list the process on the device's GPU, so the daemon named none: the process's only forecast
    ev = rec.framework_oom(framework(device=1, requested_bytes=3 * GIB, gpu=""), 1285.0)
    assert (ev.kind, ev.resource) == ("finding.oom", "GPU-a")  # the leak's GPU: its forecast is scored
    assert dict(ev.attrs) == {
        "kind": "oom", "severity": "critical", "pid": "42", "process": "trainer", "cause": "out_of_memory_error",
        "framework": "torch", "how": "allocator", "device": 1, "requested_bytes": 3 * GIB,
        "leak_found_at": 1000.0, "came_after_seconds": 285.0, "color": "black", "forecast_seconds": 300.0,
        "forecast_error_ratio": -0.05,
        "evidence": "PyTorch's allocator raised torch.OutOfMemoryError allocating 3.00 GiB on CUDA device 1",
        "score": "forecast 5.0 min when the leak was found, came at 4.8 min (-5%)",
        "summary": "trainer (pid 42) ran out of GPU memory: PyTorch's allocator raised torch.OutOfMemoryError "
                   "allocating 3.00 GiB on CUDA device 1; forecast 5.0 min when the leak was found, came at 4.8 "
                   "min (-5%)"}
    counted, error = rec.samples(1300.0)
    assert counted == Sample("gpuwatch.oom.events", 1.0, "GPU-a", {"cause": "out_of_memory_error"}, 1300.0)
    assert error.labels == {"came": "early"} and error.histogram.counts == (1, 0, 0, 0, 0, 0, 0)
    assert error.histogram.start == 10.0
    # the driver's word for the same OOM a moment later is not a second one
    assert refused(rec, Event("cuda.oom", "", {"pid": "42"}, 0), 1290.0) is None


@pytest.mark.parametrize("fw, how, words", [
    ("cupy", "uncaught", "it died of an uncaught cupy.cuda.memory.OutOfMemoryError"),
    ("jax", "uncaught", "it died of an uncaught JAX's RESOURCE_EXHAUSTED error"),
    ("torch", "uncaught", "it died of an uncaught torch.OutOfMemoryError"),
])
def test_a_framework_oom_without_a_leak_names_the_gpu_the_daemon_verified(fw, how, words):
    rec = OomRecorder(History())
    ev = rec.framework_oom(framework(framework=fw, how=how, gpu="GPU-v"), 50.0)
    assert ev.resource == "GPU-v" and ev.attrs["evidence"] == words
    assert ev.attrs["summary"] == f"trainer (pid 42) ran out of GPU memory: {words}; no leak was forecast for it"
    assert "device" not in ev.attrs and "requested_bytes" not in ev.attrs
    assert rec.samples(51.0) == [Sample("gpuwatch.oom.events", 1.0, "GPU-v", {"cause": "out_of_memory_error"}, 51.0)]


@pytest.mark.parametrize("attrs", [{"pid": ""}, {"pid": "x7"}, {"framework": "tensorflow"}, {"how": "caught"},
                                   {"framework": None}])
def test_a_framework_oom_event_outside_the_choices_is_none(attrs):
    assert OomRecorder(History()).framework_oom(framework(**attrs), 1.0) is None


def test_evidence_just_after_the_leak_closed_still_scores_its_forecast():
    """A program that dies of its OOM: the runner may see it gone before its report's OOM arrives."""
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(pid="5", tto=100.0), 1000.0)
    assert rec.leak_closed(leak(pid="5"), exited=True, wall=1090.0) is None  # the GPU was not full
    ev = rec.framework_oom(framework(pid="5"), 1090.0 + oom_mod.LATE_S)
    assert ev.attrs["forecast_seconds"] == 100.0 and ev.attrs["came_after_seconds"] == 100.0
    rec.leak_seen(leak(pid="6", tto=100.0), 1000.0)
    rec.leak_closed(leak(pid="6"), exited=False, wall=1090.0)
    late = refused(rec, Event("cuda.oom", "", {"pid": "6"}, 0), 1090.0 + oom_mod.LATE_S + 0.1)
    assert late.attrs["summary"].endswith("no leak was forecast for it")


def test_an_exit_with_the_gpu_full_gives_way_to_the_programs_own_word_that_comes_after():
    """JAX on the H200: the runner saw the process gone (its GPU full) before the report that says
    it died of RESOURCE_EXHAUSTED; the OOM is the framework's, scored once, and the exit makes none."""
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(pid="8", tto=100.0), 1000.0)
    gpu_memory(h, "GPU-a", [(1099.0, 99 * GIB)])
    assert rec.leak_closed(leak(pid="8"), exited=True, wall=1100.0) is None
    assert rec.due(1102.0) == []
    ev = rec.framework_oom(framework(pid="8", framework="jax", how="uncaught"), 1103.0)
    assert ev.attrs["cause"] == "out_of_memory_error" and ev.attrs["came_after_seconds"] == 103.0
    assert rec.due(1100.0 + oom_mod.EXIT_HOLD_S) == [] and rec.due(2000.0) == []
    assert rec.events_total == {("GPU-a", "out_of_memory_error"): 1}


# --- a process on two GPUs: a forecast per GPU ---------------------------------------------------

def test_a_process_leaking_on_two_gpus_keeps_a_forecast_for_each():
    rec = OomRecorder(History())
    rec.leak_seen(leak(tto=600.0, gpu="GPU-0"), 1000.0)
    rec.leak_seen(leak(tto=100.0, gpu="GPU-1"), 1050.0)  # found later, on the other GPU: kept too
    ev = rec.framework_oom(framework(gpu="GPU-1", device=1), 1160.0)
    assert ev.resource == "GPU-1"
    assert (ev.attrs["forecast_seconds"], ev.attrs["came_after_seconds"]) == (100.0, 110.0)


def test_closing_one_gpus_leak_keeps_the_other_gpus_forecast():
    rec = OomRecorder(History())
    rec.leak_seen(leak(tto=600.0, gpu="GPU-0"), 1000.0)
    rec.leak_seen(leak(tto=100.0, gpu="GPU-1"), 1000.0)
    rec.leak_closed(leak(gpu="GPU-0"), exited=False, wall=1050.0)  # GPU 0's growth stopped
    ev = rec.framework_oom(framework(gpu="GPU-1"), 1100.0)
    assert (ev.resource, ev.attrs["forecast_seconds"]) == ("GPU-1", 100.0)


def test_an_oom_on_a_gpu_without_a_forecast_is_not_scored_against_another_gpus():
    rec = OomRecorder(History())
    rec.leak_seen(leak(tto=100.0, gpu="GPU-1"), 1000.0)
    ev = rec.framework_oom(framework(gpu="GPU-0"), 1100.0)
    assert ev.resource == "GPU-0" and ev.attrs["summary"].endswith("no leak was forecast for it")
    assert rec.errors == {}


def test_a_driver_oom_naming_no_gpu_takes_the_fullest_gpu_with_a_forecast():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(tto=100.0, gpu="GPU-0"), 1000.0)
    rec.leak_seen(leak(tto=300.0, gpu="GPU-1"), 1010.0)
    gpu_memory(h, "GPU-0", [(1098.0, 60 * GIB)])
    gpu_memory(h, "GPU-1", [(1098.0, 99 * GIB)])
    ev = refused(rec, Event("cuda.oom", "", {"pid": "42"}, 0), 1100.0)
    assert (ev.resource, ev.attrs["forecast_seconds"]) == ("GPU-1", 300.0)


def test_a_two_gpu_process_exiting_holds_one_exit_the_fuller_gpus():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(tto=100.0, gpu="GPU-0"), 1000.0)
    rec.leak_seen(leak(tto=200.0, gpu="GPU-1"), 1000.0)
    gpu_memory(h, "GPU-0", [(1099.0, 96 * GIB)])
    gpu_memory(h, "GPU-1", [(1099.0, 99 * GIB)])
    rec.leak_closed(leak(gpu="GPU-0"), exited=True, wall=1100.0)
    rec.leak_closed(leak(gpu="GPU-1"), exited=True, wall=1100.0)
    (ev,) = rec.due(1100.0 + oom_mod.EXIT_HOLD_S)
    assert (ev.resource, ev.attrs["forecast_seconds"], ev.attrs["evidence"]) == (
        "GPU-1", 200.0, "it exited with its GPU 99% full")


def test_a_short_lived_process_is_named_as_the_probes_named_it_while_it_ran():
    """Issue 35 item 8: the driver's OOM of a process gone before its name could be read said "unknown"."""
    history = History()
    history.append([Sample("gpuwatch.cuda.calls", 10.0, "", {"pid": "77", "process": "trainer", "api": "cuMemAlloc_v2"},
                           ts=100.0)])
    rec = OomRecorder(history)
    ev = refused(rec, Event("cuda.oom", "", {"pid": 77, "process": "unknown", "api": "cuMemAlloc_v2"}), 101.0)
    assert ev.attrs["process"] == "trainer" and ev.attrs["summary"].startswith("trainer (pid 77) ran out")
    ev = refused(rec, Event("cuda.oom", "", {"pid": 78, "process": ""}), 101.0)  # never named: as before
    assert ev.attrs["process"] == "" and ev.attrs["summary"].startswith("process (pid 78)")


def test_a_refusal_the_allocator_backs_off_from_is_no_oom():
    """XLA asks for a doubled region, is refused, and takes a smaller one in the same second: the
    process goes on, so no OOM, then or after the hold."""
    h = History()
    rec = OomRecorder(h, alive=lambda pid: True)
    rec.leak_seen(leak(pid="5", tto=60.0), 100.0)
    cuda_calls(h, "5", [(110.0, 4, 0), (120.0, 6, 1)])  # 2 calls at the refusal's collection, 1 refused
    assert refused(rec, Event("cuda.oom", "", {"pid": "5", "api": ALLOC, "errors": 1}), 120.5) is None
    assert rec.due(120.5 + oom_mod.DRIVER_HOLD_S) == [] and rec._refusals == {}


def test_a_refusal_the_process_never_gets_over_is_its_oom_dated_when_it_came():
    h = History()
    rec = OomRecorder(h, alive=lambda pid: True)
    rec.leak_seen(leak(pid="5", tto=60.0), 100.0)
    cuda_calls(h, "5", [(110.0, 4, 0), (120.0, 6, 2), (130.0, 9, 5)])  # every call since was refused
    cuda_calls(h, "5", [(110.0, 50, 0), (130.0, 80, 0)], api="cuLaunchKernel")  # other APIs do not count
    assert refused(rec, Event("cuda.oom", "", {"pid": "5", "api": ALLOC, "errors": 2}), 120.0) is None
    assert rec.due(120.0 + oom_mod.DRIVER_HOLD_S - 0.001) == []
    (ev,) = rec.due(120.0 + oom_mod.DRIVER_HOLD_S)
    assert (ev.ts, ev.attrs["came_after_seconds"], ev.attrs["forecast_seconds"]) == (120.0, 20.0, 60.0)
    assert ev.attrs["evidence"] == f"the driver returned CUDA_ERROR_OUT_OF_MEMORY to {ALLOC} (2 calls)"


@pytest.mark.parametrize("points, oom", [
    ([(110.0, 4, 0), (120.0, 9, 1)], True),  # calls that worked came before it, in its second: its OOM
    ([(110.0, 4, 0), (120.0, 5, 1), (125.0, 8, 1)], False),  # it went on after: this is not what ended it
])
def test_a_refusal_whose_process_exits_is_judged_at_once_by_the_calls_after_it(points, oom):
    h = History()
    running = {"5"}
    rec = OomRecorder(h, alive=lambda pid: pid in running)
    cuda_calls(h, "5", points)
    assert refused(rec, Event("cuda.oom", "", {"pid": "5", "api": ALLOC}), 120.0) is None
    running.clear()
    events = rec.due(126.0)
    assert [e.ts for e in events] == ([120.0] if oom else []) and rec._refusals == {}


def test_the_oom_after_a_refusal_it_got_over_is_dated_at_the_second_refusal():
    """JAX on the H100: a refusal XLA backed off from, then 12 s later the one it died of."""
    h = History()
    running = {"5"}
    rec = OomRecorder(h, alive=lambda pid: pid in running)
    rec.leak_seen(leak(pid="5", tto=30.0), 100.0)
    cuda_calls(h, "5", [(110.0, 4, 0), (120.0, 6, 1)])
    assert refused(rec, Event("cuda.oom", "", {"pid": "5", "api": ALLOC, "errors": 1}), 120.0) is None
    cuda_calls(h, "5", [(132.0, 8, 3)])
    assert refused(rec, Event("cuda.oom", "", {"pid": "5", "api": ALLOC, "errors": 2}), 132.0) is None
    running.clear()
    (ev,) = rec.due(133.0)
    assert (ev.ts, ev.attrs["came_after_seconds"], ev.attrs["forecast_error_ratio"]) == (132.0, 32.0, 0.0667)
    assert "(2 calls)" in ev.attrs["evidence"]


def test_refusals_held_add_up_and_the_programs_own_word_replaces_them():
    h = History()
    rec = OomRecorder(h, alive=lambda pid: True)
    rec.leak_seen(leak(pid="42", tto=300.0), 1000.0)
    cuda_calls(h, "42", [(1100.0, 4, 0), (1200.0, 6, 2), (1201.0, 7, 3)], api="")
    for wall in (1200.0, 1201.0):  # no api named: every call of the process counts
        assert refused(rec, Event("cuda.oom", "", {"pid": "42", "errors": 2}), wall) is None
    assert rec._refusals["42"][0].attrs["errors"] == 4 and rec._refusals["42"][1] == 1200.0
    ev = rec.framework_oom(framework(), 1202.0)
    assert ev.attrs["cause"] == "out_of_memory_error" and rec._refusals == {}
    assert rec.due(1202.0 + oom_mod.DRIVER_HOLD_S) == []


def test_refusals_held_are_bounded(monkeypatch):
    monkeypatch.setattr(oom_mod, "MAX_TRACKED", 2)
    rec = OomRecorder(History(), alive=lambda pid: True)
    for pid in ("1", "2", "3"):
        rec.driver_oom(Event("cuda.oom", "", {"pid": pid}), 10.0)
    rec.driver_oom(Event("cuda.oom", "", {"pid": "2", "errors": 4}), 11.0)  # a held one still adds
    assert {p: (ev.attrs.get("errors", 1), at) for p, (ev, at) in rec._refusals.items()} == {"1": (1, 10.0),
                                                                                           "2": (5, 10.0)}
    assert [e.attrs["pid"] for e in rec.due(10.0 + oom_mod.DRIVER_HOLD_S)] == ["1", "2"]


# --- edges that the cases above do not reach (each found by scripts/mutate) --------------------

def test_the_histograms_start_is_the_wall_time_the_recorder_was_made():
    import time
    before = time.time()
    rec = _OomRecorder(History())
    assert before <= rec.started <= time.time()


def test_came_after_is_rounded_to_tenths_and_an_oom_on_time_counts_as_late():
    rec = OomRecorder(History())
    rec.leak_seen(leak(pid="1", tto=100.0), 1000.0)
    rec.leak_seen(leak(pid="2", tto=100.0), 1000.0)
    first = rec.framework_oom(framework(pid="1"), 1100.37)
    assert (first.attrs["came_after_seconds"], first.attrs["forecast_error_ratio"]) == (100.4, 0.004)
    on_time = rec.framework_oom(framework(pid="2"), 1100.0)
    assert on_time.attrs["forecast_error_ratio"] == 0.0 and on_time.attrs["score"].endswith("(+0%)")
    # both in the one histogram of late OOMs on that GPU
    (error,) = [s for s in rec.samples(1200.0) if s.metric == "gpuwatch.oom.forecast.error"]
    assert error.labels == {"came": "late"} and error.value == 2.0
    assert error.histogram.counts == (2, 0, 0, 0, 0, 0, 0) and error.histogram.sum == pytest.approx(0.004)


def test_a_leak_without_a_forecast_says_when_it_was_found_in_minutes_of_60_seconds():
    rec = OomRecorder(History())
    rec.leak_seen(leak(tto=None), 0.0)
    ev = rec.framework_oom(framework(), 600.0)
    assert ev.attrs["score"] == "the leak was found 10.0 min before, with no time to OOM forecast"


def test_evidence_in_the_same_second_as_the_leaks_close_still_scores_its_forecast():
    rec = OomRecorder(History())
    for pid in ("1", "2"):
        rec.leak_seen(leak(pid=pid, tto=100.0), 1000.0)
        rec.leak_closed(leak(pid=pid), exited=False, wall=1090.0)
    assert rec.framework_oom(framework(pid="1"), 1090.0).attrs["forecast_seconds"] == 100.0  # at the close
    assert rec.framework_oom(framework(pid="2"), 1090.5).attrs["forecast_seconds"] == 100.0
    # before the close (the runner's clock stepped back): not this leak's
    rec.leak_seen(leak(pid="3", tto=100.0), 1000.0)
    rec.leak_closed(leak(pid="3"), exited=False, wall=1090.0)
    assert "forecast_seconds" not in rec.framework_oom(framework(pid="3"), 1089.9).attrs


def test_a_driver_oom_naming_no_gpu_takes_a_gpu_with_memory_figures_over_one_without():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(tto=100.0, gpu="GPU-0"), 1000.0)  # no memory series: fullness unknown, taken as 0
    rec.leak_seen(leak(tto=300.0, gpu="GPU-1"), 1010.0)
    gpu_memory(h, "GPU-1", [(1098.0, 60 * GIB)])
    ev = refused(rec, Event("cuda.oom", "", {"pid": "42"}, 0), 1100.0)
    assert (ev.resource, ev.attrs["forecast_seconds"]) == ("GPU-1", 300.0)


def test_a_driver_oom_naming_no_gpu_between_gpus_as_full_takes_the_leak_found_first():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(tto=300.0, gpu="GPU-1"), 1010.0)
    rec.leak_seen(leak(tto=100.0, gpu="GPU-0"), 1000.0)
    for gpu in ("GPU-0", "GPU-1"):
        gpu_memory(h, gpu, [(1098.0, 90 * GIB)])
    ev = refused(rec, Event("cuda.oom", "", {"pid": "42"}, 0), 1100.0)
    assert (ev.resource, ev.attrs["forecast_seconds"]) == ("GPU-0", 100.0)


def test_full_exactly_5_s_before_the_exit_counts_and_a_gpu_without_a_limit_is_never_full():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(gpu="GPU-a"), 1000.0)
    rec.leak_seen(leak(pid="43", gpu="GPU-z"), 1000.0)
    gpu_memory(h, "GPU-a", [(1127.0, 99 * GIB), (1128.0, 10 * GIB)])  # the first at exactly 1132 - RECENT_S
    gpu_memory(h, "GPU-z", [(1131.0, 99 * GIB)], limit=0.0)  # a limit of 0: no fullness to judge
    assert closed(rec, leak(gpu="GPU-a"), True, 1132.0).attrs["evidence"] == "it exited with its GPU 99% full"
    assert closed(rec, leak(pid="43", gpu="GPU-z"), True, 1132.0) is None


def test_an_exit_is_held_at_its_own_second_too():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(), 1000.0)
    gpu_memory(h, "GPU-a", [(1099.0, 99 * GIB)])
    rec.leak_closed(leak(), exited=True, wall=1100.0)
    assert rec.due(1100.0) == []
    assert len(rec.due(1100.0 + oom_mod.EXIT_HOLD_S)) == 1


def test_a_two_gpu_process_exiting_keeps_the_fuller_gpus_exit_closed_first_and_the_first_of_equals():
    h = History()
    rec = OomRecorder(h)
    for pid in ("1", "2"):
        rec.leak_seen(leak(pid=pid, tto=100.0, gpu="GPU-0"), 1000.0)
        rec.leak_seen(leak(pid=pid, tto=200.0, gpu="GPU-1"), 1000.0)
    gpu_memory(h, "GPU-0", [(1099.0, 99 * GIB)])
    gpu_memory(h, "GPU-1", [(1099.0, 96 * GIB)])
    for gpu in ("GPU-0", "GPU-1"):  # the fuller GPU's leak closes first: the less full one does not replace it
        rec.leak_closed(leak(pid="1", gpu=gpu), exited=True, wall=1100.0)
    gpu_memory(h, "GPU-1", [(1100.0, 99 * GIB)])  # as full as GPU-0 now: the first held stays
    for gpu in ("GPU-0", "GPU-1"):
        rec.leak_closed(leak(pid="2", gpu=gpu), exited=True, wall=1100.0)
    got = {e.attrs["pid"]: (e.resource, e.attrs["evidence"]) for e in rec.due(1100.0 + oom_mod.EXIT_HOLD_S)}
    assert got == {"1": ("GPU-0", "it exited with its GPU 99% full"),
                   "2": ("GPU-0", "it exited with its GPU 99% full")}


def test_held_exits_are_bounded_but_a_held_ones_fuller_gpu_still_replaces_it(monkeypatch):
    monkeypatch.setattr(oom_mod, "MAX_TRACKED", 1)
    h = History()
    rec = OomRecorder(h)
    gpu_memory(h, "GPU-0", [(1099.0, 96 * GIB)])
    gpu_memory(h, "GPU-1", [(1099.0, 99 * GIB)])
    rec.leak_seen(leak(pid="1", gpu="GPU-0"), 1000.0)
    rec.leak_closed(leak(pid="1", gpu="GPU-0"), exited=True, wall=1100.0)
    rec.leak_seen(leak(pid="1", gpu="GPU-1"), 1000.0)  # (one forecast kept at a time under this bound)
    rec.leak_closed(leak(pid="1", gpu="GPU-1"), exited=True, wall=1100.0)
    rec.leak_seen(leak(pid="2", gpu="GPU-1"), 1000.0)
    rec.leak_closed(leak(pid="2", gpu="GPU-1"), exited=True, wall=1100.0)  # a second process: over the bound
    assert [(e.attrs["pid"], e.resource) for e in rec.due(1100.0 + oom_mod.EXIT_HOLD_S)] == [("1", "GPU-1")]


def test_closed_leaks_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(oom_mod, "MAX_TRACKED", 3)
    rec = OomRecorder(History())
    for pid in range(5):
        rec.leak_seen(leak(pid=str(pid)), 1000.0)
        rec.leak_closed(leak(pid=str(pid)), exited=False, wall=1000.0)
    assert list(rec._closed) == [("2", "GPU-a"), ("3", "GPU-a"), ("4", "GPU-a")]
    assert "forecast_seconds" in rec.framework_oom(framework(pid="2"), 1001.0).attrs
    assert "forecast_seconds" not in rec.framework_oom(framework(pid="1"), 1001.0).attrs


def test_a_process_whose_oom_was_made_then_exiting_full_makes_no_second():
    h = History()
    rec = OomRecorder(h)
    rec.leak_seen(leak(), 1000.0)
    gpu_memory(h, "GPU-a", [(1099.0, 99 * GIB)])
    assert rec.framework_oom(framework(), 1099.0) is not None
    assert closed(rec, leak(), True, 1100.0) is None
    assert rec.framework_oom(framework(), 1101.0) is None  # nor a second word of the framework's
    assert rec.events_total == {("GPU-a", "out_of_memory_error"): 1}


def test_names_and_colours_left_out_of_a_finding_or_event_stay_empty():
    rec = OomRecorder(History())
    f = Finding("memory_leak", "GPU-a", "warning", "leak", {"pid": "42", "time_to_oom_seconds": 60.0})
    rec.leak_seen(f, 1000.0)
    rec.leak_seen(Finding("memory_leak", "GPU-a", "warning", "leak", {"process": "p"}), 1000.0)  # no pid: not kept
    assert list(rec._forecasts) == [("42", "GPU-a")]
    ev = refused(rec, Event("cuda.oom", "", {"pid": "42"}, 0), 1050.0)
    assert (ev.attrs["process"], ev.attrs["color"]) == ("", "")
    assert ev.attrs["summary"].startswith("process (pid 42) ran out of GPU memory")
    fw = rec.framework_oom(framework(pid="43", process=""), 1050.0)  # no leak, no name
    assert fw.attrs["process"] == "" and fw.attrs["summary"].startswith("process (pid 43)")


def test_an_event_without_a_name_takes_the_leaks():
    rec = OomRecorder(History())
    for pid in ("1", "2"):
        rec.leak_seen(leak(pid=pid, process="trainer"), 1000.0)
    bare = Event("cuda.oom", "", {"pid": "1"}, 0)  # no "process" at all
    assert refused(rec, bare, 1050.0).attrs["process"] == "trainer"
    ev = framework(pid="2")
    del ev.attrs["process"]
    assert rec.framework_oom(ev, 1050.0).attrs["process"] == "trainer"


def test_an_unknown_name_is_replaced_by_the_leaks_or_else_by_what_the_probes_named_it():
    h = History()
    h.append([Sample("gpuwatch.process.gpu.memory.usage", 1.0, "GPU-a", {"pid": "3", "process": ""}, 100.0),
              Sample("gpuwatch.process.gpu.memory.usage", 1.0, "GPU-b", {"pid": "3", "process": "unknown"}, 100.0),
              Sample("gpuwatch.cuda.calls", 10.0, "", {"pid": "3", "process": "trainer", "api": ALLOC}, 100.0)])
    rec = OomRecorder(h)
    rec.leak_seen(leak(pid="2", process="jax"), 90.0)
    assert refused(rec, Event("cuda.oom", "", {"pid": "2", "process": "unknown"}), 101.0).attrs["process"] == "jax"
    rec.leak_seen(leak(pid="3", process="unknown"), 90.0)  # the leak's name no better
    assert refused(rec, Event("cuda.oom", "", {"pid": "3", "process": "unknown"}), 101.0).attrs["process"] == "trainer"
    # no name at all and no leak: the probes' name too
    h.append([Sample("gpuwatch.cuda.calls", 10.0, "", {"pid": "4", "process": "trainer", "api": ALLOC}, 100.0)])
    assert refused(rec, Event("cuda.oom", "", {"pid": "4", "process": ""}), 101.0).attrs["process"] == "trainer"


def test_only_the_processs_own_calls_show_it_got_over_a_refusal():
    h = History()
    rec = OomRecorder(h, alive=lambda pid: True)
    cuda_calls(h, "5", [(110.0, 4, 0), (120.0, 5, 1)])  # its one call then was refused
    cuda_calls(h, "6", [(110.0, 4, 0), (120.0, 9, 0)])  # another process's worked
    assert refused(rec, Event("cuda.oom", "", {"pid": "5", "api": ALLOC}), 120.0) is None
    assert [e.attrs["pid"] for e in rec.due(120.0 + oom_mod.DRIVER_HOLD_S)] == ["5"]


def test_a_refusal_naming_no_api_is_got_over_by_a_call_of_any_api():
    h = History()
    rec = OomRecorder(h, alive=lambda pid: True)
    cuda_calls(h, "5", [(110.0, 4, 0), (120.0, 7, 1)])  # cuMemAlloc_v2 labelled: two worked in its second
    assert refused(rec, Event("cuda.oom", "", {"pid": "5"}), 120.0) is None
    assert rec.due(120.0 + oom_mod.DRIVER_HOLD_S) == []


def test_a_refusal_before_the_first_collection_of_its_calls_is_judged_by_all_of_them():
    h = History()
    rec = OomRecorder(h, alive=lambda pid: True)
    cuda_calls(h, "5", [(121.0, 4, 1), (125.0, 9, 1)])  # first collected after the refusal was seen
    assert refused(rec, Event("cuda.oom", "", {"pid": "5", "api": ALLOC}), 120.0) is None
    assert rec.due(120.0 + oom_mod.DRIVER_HOLD_S) == []  # calls worked after it


def test_a_refusal_whose_process_exits_counts_calls_from_the_next_collection_a_second_later():
    h = History()
    running = {"5"}
    rec = OomRecorder(h, alive=lambda pid: pid in running)
    cuda_calls(h, "5", [(119.0, 2, 0), (120.0, 5, 1), (121.0, 8, 1)])
    assert refused(rec, Event("cuda.oom", "", {"pid": "5", "api": ALLOC}), 120.0) is None
    running.clear()
    assert rec.due(122.0) == []  # 3 calls worked in the collection a second after: not what ended it


def test_a_second_refusal_adds_up_unless_the_held_ones_own_api_was_got_over():
    h = History()
    rec = OomRecorder(h, alive=lambda pid: True)
    cuda_calls(h, "5", [(110.0, 4, 0), (120.0, 5, 1), (121.0, 6, 2)])  # every cuMemAlloc since refused
    cuda_calls(h, "5", [(110.0, 50, 0), (121.0, 80, 0)], api="cuLaunchKernel")  # kernels ran: not the held API
    assert refused(rec, Event("cuda.oom", "", {"pid": "5", "api": ALLOC, "errors": 2}), 120.0) is None
    rec.driver_oom(Event("cuda.oom", "", {"pid": "5", "api": ALLOC}), 121.0)  # no count: one
    assert (rec._refusals["5"][0].attrs["errors"], rec._refusals["5"][1]) == (3, 120.0)
    # no API named: any call that worked is getting over it, and the next refusal is held afresh
    cuda_calls(h, "6", [(110.0, 4, 0), (120.0, 6, 1), (121.0, 7, 2)], api="cuMemAllocAsync")
    assert refused(rec, Event("cuda.oom", "", {"pid": "6", "errors": 1}), 120.0) is None
    rec.driver_oom(Event("cuda.oom", "", {"pid": "6", "errors": 1}), 121.0)
    assert (rec._refusals["6"][0].attrs["errors"], rec._refusals["6"][1]) == (1, 121.0)
