"""History: bounded series, and reading only a window of them."""
from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History


def test_series_since_gives_the_window_and_the_point_before_it():
    h = History(maxlen=100)
    for i in range(10):
        h.append([Sample("hw.power", float(i), "GPU-a", {}, 100.0 + i)])
    ((_, pts),) = h.series("hw.power", since=105.0)
    assert pts == [(104.0, 4.0), (105.0, 5.0), (106.0, 6.0), (107.0, 7.0), (108.0, 8.0), (109.0, 9.0)]
    ((_, newest),) = h.series("hw.power", since=float("inf"))
    assert newest == [(109.0, 9.0)]
    ((_, everything),) = h.series("hw.power", since=0.0)
    assert everything == list(h.series("hw.power"))[0][1] and len(everything) == 10


def test_at_most_max_series_are_held_and_the_oldest_go_first(caplog):
    h = History(maxlen=10, max_series=64)
    h.append([Sample("hw.power", 1.0, "GPU-real", {}, 10_000.0)])  # a real GPU, newest
    for i in range(1000):  # a flood of processes, each a series with one point
        h.append([Sample("gpuwatch.cupti.records", 1.0, "", {"pid": str(i), "process": "x"}, 100.0 + i)])
    assert len(h) <= 64 and h.evicted["cap"] >= 1000 - 64
    assert list(h.series("hw.power"))  # the newest survive
    assert len([r for r in caplog.records if "cap" in r.getMessage()]) == 1  # logged once


def test_a_process_series_expires_after_ten_minutes_other_series_after_an_hour():
    h = History()
    h.append([Sample("gpuwatch.process.gpu.memory.usage", 1.0, "GPU-a", {"pid": "7", "process": "x"}, 0.0),
              Sample("hw.power", 1.0, "GPU-a", {}, 0.0)])
    assert h.expire(599.0) == 0 and len(h) == 2
    assert h.expire(601.0) == 1 and [k[0] for k, _ in h.series("hw.power")] == ["hw.power"]
    assert h.expire(3601.0) == 1 and len(h) == 0 and h.evicted["expired"] == 2
