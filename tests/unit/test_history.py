"""History: bounded series, and reading only a window of them."""
import tracemalloc

from hypothesis import given, strategies as st

from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History, Series


# The counter arithmetic on bare points (moved here from the thermal detector's tests with the code).
def increase(points, since):
    return Series(list(points)).increase(since)


def first_rise(points, since):
    return Series(list(points)).first_rise(since)


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


def test_counter_increase_ignores_resets():
    pts = [(0, 5.0), (1, 7.0), (2, 1.0), (3, 4.0)]  # a restart between 1 and 2
    assert increase(pts, 0) == 2 + 3
    assert increase(pts, 2.5) == 3


def test_increase_starts_from_the_last_value_before_the_window():
    # before since=100: 0 then 20 (the last one counts); inside: 40, 120, 170 -> 20 + 80 + 50
    pts = [(0, 0.0), (50, 20.0), (150, 40.0), (250, 120.0), (400, 170.0)]
    assert increase(pts, 100) == 150
    assert increase(pts, 150) == 150  # a point at `since` is in the window: 20 (before) -> 40 -> 120 -> 170
    assert increase(pts, 0) == 170  # nothing before: from the first point
    assert increase(pts, 401) == 0  # nothing inside: no rise
    assert increase([(0, 3.0), (1, 3.0), (2, 3.0)], 0) == 0  # flat is no rise


def test_first_rise_is_the_first_increase_at_or_after_since():
    pts = [(0, 1.0), (5, 1.0), (10, 2.0), (15, 3.0)]
    assert first_rise(pts, 0) == 10  # 1 -> 1 is no rise
    assert first_rise(pts, 10) == 10  # at since counts
    assert first_rise(pts, 11) == 15
    assert first_rise(pts, 16) is None
    assert first_rise([(0, 5.0), (1, 2.0), (2, 3.0)], 0) == 2  # after a reset, the rise from the lower value
    assert first_rise([(3, 7.0)], 0) is None  # a first point is no rise


# --- storage bounds, and the series API (issue 32: its mutants) -------------------------------------

def power(ts, value=1.0, gpu="GPU-a", **labels):
    return Sample("hw.power", value, gpu, labels, ts)


def test_append_skips_points_not_newer_and_re_emitted_ones_but_keeps_the_rest_of_the_batch():
    assert History().maxlen == 720  # points per series by default
    h = History(maxlen=3)
    h.append([power(10.0), power(11.0, gpu="GPU-b"), power(12.0, gpu="GPU-c")], newer_than=11.0)
    assert [s.gpu for s in h.select("hw.power")] == ["GPU-c"]  # 10 and 11 are not newer; 12 after them is kept
    # the value of the newest point equals the next time: still a new point; a repeated time is not
    h.append([power(12.0, gpu="GPU-c"), power(13.0, 12.0, gpu="GPU-c"), power(13.0, gpu="GPU-c"),
              power(14.0, gpu="GPU-d")])
    assert h.select("hw.power", gpu="GPU-c")[0].points == [(12.0, 1.0), (13.0, 12.0)]
    assert [s.gpu for s in h.select("hw.power")] == ["GPU-c", "GPU-d"]
    h.append([power(t, gpu="GPU-c") for t in (15.0, 16.0, 17.0)])
    assert h.select("hw.power", gpu="GPU-c")[0].points == [(15.0, 1.0), (16.0, 1.0), (17.0, 1.0)]  # maxlen


def test_the_cap_forgets_a_sixteenth_oldest_newest_point_first(caplog):
    h = History(max_series=32)
    # keys sort the other way round from their newest points: the order must come from the points
    h.append([power(1000.0 - i, gpu=f"GPU-{i:02d}") for i in range(32)])
    h.append([power(2000.0, gpu="GPU-new")])
    gone = {f"GPU-{i:02d}" for i in (30, 31)}  # 32 // 16 = 2, the two with the oldest points
    assert {s.gpu for s in h.select("hw.power")} == {f"GPU-{i:02d}" for i in range(32)} - gone | {"GPU-new"}
    assert h.evicted["cap"] == 2
    assert [r.getMessage() for r in caplog.records] == [
        "history holds 32 series, its cap: the oldest are forgotten (counted in "
        "gpuwatch_history_series_evicted_total{reason=\"cap\"}; not logged again)"]
    small = History(max_series=8)  # under 16 series: one at a time
    small.append([power(float(i), gpu=f"GPU-{i}") for i in range(9)])
    assert len(small) == 8 and small.evicted["cap"] == 1


def test_expiry_at_its_limit_and_by_the_pid_label_only():
    h = History(expire_after=100.0, process_expire_after=10.0)
    h.append([power(0.0, gpu="GPU-a", sensor="x"), power(0.0, gpu="GPU-b", pid="7"), power(50.0, gpu="GPU-c")])
    assert h.expire(10.0) == 0  # exactly its limit: kept
    assert h.expire(10.5) == 1 and {s.gpu for s in h.select("hw.power")} == {"GPU-a", "GPU-c"}
    assert h.expire(100.0) == 0 and h.expire(100.5) == 1 and [s.gpu for s in h.select("hw.power")] == ["GPU-c"]


def test_shift_moves_every_point_and_keeps_the_bound():
    h = History(maxlen=2)
    h.append([power(10.0), power(11.0)])
    h.shift(-5.0)
    h.append([power(7.0)])
    assert h.select("hw.power")[0].points == [(6.0, 1.0), (7.0, 1.0)]


def test_select_newest_and_windows_keep_what_the_series_is():
    h = History()
    h.append([Sample("hw.energy", 1.0, "GPU-a", {}, 500.0), power(10.0, sensor="x"), power(20.0, gpu="GPU-b")])
    assert h.newest("hw.power") == 20.0 and h.newest("hw.energy", "hw.power") == 500.0 and h.newest("nothing") is None
    (s,) = h.select("hw.power", sensor="x")
    assert (s.metric, s.gpu, s.labels, s.latest, s.latest_ts, len(s)) == ("hw.power", "GPU-a", {"sensor": "x"}, 1.0,
                                                                          10.0, 1)
    w = s.window(10.0)
    assert (w.metric, w.gpu, w.labels, w.points) == ("hw.power", "GPU-a", {"sensor": "x"}, [(10.0, 1.0)])
    assert s.window(10.5).points == [] and s.window(10.5).latest is None and s.window(10.5).span == 0.0


def test_select_of_one_gpu_with_a_window():
    h = History()
    h.append([power(10.0, gpu="GPU-a"), power(10.0, gpu="GPU-b"), power(10.0, gpu="")])
    h.append([power(20.0, 2.0, gpu="GPU-a"), power(20.0, 2.0, gpu="GPU-b"), power(20.0, 2.0, gpu="")])
    assert [(s.gpu, s.points) for s in h.select("hw.power", gpu="GPU-b", since=20.0)] == [
        ("GPU-b", [(10.0, 1.0), (20.0, 2.0)])]
    assert [s.gpu for s in h.select("hw.power", gpu="", since=15.0)] == [""]


@given(st.integers(1, 9), st.lists(st.tuples(st.integers(0, 60), st.floats(-1e6, 1e6)), max_size=60),
       st.integers(-5, 70))
def test_a_series_is_the_newest_maxlen_points_in_time_order(maxlen, points, since):
    """The packed ring against the plain model: keep a point only when it is newer than the newest;
    hold the last maxlen; a window is its points from `since` on and the one before."""
    h = History(maxlen=maxlen)
    model: list[tuple[float, float]] = []
    for t, v in points:
        h.append([Sample("hw.power", v, "GPU-a", {}, float(t))])
        if not model or t > model[-1][0]:
            model = (model + [(float(t), v)])[-maxlen:]
    got = h.select("hw.power")
    assert (got[0].points if got else []) == model
    before = [i for i, (t, _) in enumerate(model) if t < since]
    window = model[before[-1]:] if before else model
    assert (h.select("hw.power", since=float(since))[0].points if got else []) == window


def test_a_point_takes_sixteen_bytes():
    """What 720 points of a series hold (the default; 126 series on one GPU of the replay). The
    ring's two arrays of doubles, 16 bytes a point: a deque of tuples took 90."""
    h = History()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(720):
            h.append([Sample(f"m{j}", float(i + j), "GPU-a", {}, 1e9 + i) for j in range(50)])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 16 <= held / (50 * 720) < 20
