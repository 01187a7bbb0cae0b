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
