"""The three-color leak detector on series shaped like what the probes report.

Each test builds the history the agent would hold for one GPU and one process: NVML's
device and per-process memory (black), the in-process agent's allocated/reserved (white/grey) or
eBPF's live driver bytes, one point a second, and asks the detector what it sees.
"""
import random

import pytest

from gpuwatch.agent import metrics
from gpuwatch.agent.api import Finding, Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors.leak import (BLACK, GREY, WHITE, LeakDetector, LeakSettings, Trend, _Process, _r2, _theil_sen,
                                     fmt_duration, gave_back, rise, sawtooth, still_rising, trend)

GIB, MIB = 1 << 30, 1 << 20
GPU = "GPU-c002ef2a-2a3c-e0e9-4d8a-a58bfd6b0084"
LIMIT = 141 * GIB
PROC = {"pid": "4242", "process": "python3"}
T0 = 1_800_000_000.0


def build(seconds: int, white=None, grey=None, black=None, live=None, others: float = 0.0) -> History:
    """A history of `seconds` points; each color is a function of t (seconds since start) or None."""
    h = History(maxlen=720)
    for i in range(seconds):
        t = T0 + i
        samples = []
        vals = {}
        for name, fn, metric, res in ((WHITE, white, "gpuwatch.process.gpu.memory.allocated", GPU),
                                      (GREY, grey, "gpuwatch.process.gpu.memory.reserved", GPU),
                                      (BLACK, black, "gpuwatch.process.gpu.memory.usage", GPU),
                                      ("live", live, "gpuwatch.process.cuda.memory.live", "")):
            if fn is not None:
                vals[name] = fn(i)
                samples.append(Sample(metric, float(vals[name]), res, PROC, t))
        used = others + vals.get(BLACK, 0.0)
        samples += [Sample("hw.gpu.memory.limit", float(LIMIT), GPU, {}, t),
                    Sample("hw.gpu.memory.usage", float(used), GPU, {}, t)]
        h.append(samples)
    return h


def steps(base: float, amplitude: float, period: int = 3):
    """PyTorch's step shape: activations allocated during a step, freed after it."""
    return lambda i: base + (amplitude if i % period else 0.0)


def one(findings):
    (f,) = list(findings)
    for s in LeakDetector.samples([f]):
        metrics.get(s.metric)
    return f


# --- each color ---------------------------------------------------------------------------

def test_tensor_leak_is_white_with_rate_and_time_to_oom():
    rate = GIB / 60  # 1 GiB a minute
    white = lambda i: 20 * GIB + rate * i + (2 * GIB if i % 3 else 0)  # noqa: E731
    grey = lambda i: 24 * GIB + rate * i  # noqa: E731  (the pool follows the tensors)
    black = lambda i: grey(i) + 600 * MIB  # noqa: E731
    h = build(240, white, grey, black, others=100 * GIB)
    f = one(LeakDetector().observe(h))
    assert (f.kind, f.resource, f.attrs["pid"], f.attrs["color"]) == ("memory_leak", GPU, "4242", WHITE)
    assert f.attrs["rate_bytes_per_second"] == pytest.approx(rate, rel=0.05)
    free = LIMIT - (100 * GIB + black(239))
    headroom = free + grey(239) - white(239)  # the GPU's free memory and the pool's unused part
    assert f.attrs["headroom_bytes"] == pytest.approx(headroom)
    assert f.attrs["time_to_oom_seconds"] == pytest.approx(headroom / rate, rel=0.05)
    assert "tensors kept alive" in f.summary and "out of memory in" in f.summary
    assert f.severity == "critical"  # minutes away


def test_allocator_pool_growth_is_grey():
    white = steps(30 * GIB, 3 * GIB)
    grey = lambda i: 36 * GIB + 200 * MIB / 60 * i  # noqa: E731  200 MB a minute
    h = build(400, white, grey, lambda i: grey(i) + 600 * MIB)
    f = one(LeakDetector().observe(h))
    assert f.attrs["color"] == GREY and f.attrs["grey_source"] == "agent"
    assert f.attrs["rate_bytes_per_second"] == pytest.approx(200 * MIB / 60, rel=0.05)
    assert f.severity == "warning"


def test_driver_level_leak_is_black():
    white = steps(10 * GIB, 1 * GIB)
    grey = lambda i: 12 * GIB  # noqa: E731
    black = lambda i: 13 * GIB + 300 * MIB / 60 * i  # noqa: E731  raw cudaMalloc without free
    h = build(400, white, grey, black, others=120 * GIB)
    f = one(LeakDetector().observe(h))
    assert f.attrs["color"] == BLACK and "outside the allocator" in f.summary
    free = LIMIT - 120 * GIB - black(399)
    assert f.attrs["time_to_oom_seconds"] == pytest.approx(free / (300 * MIB / 60), rel=0.05)
    assert f.attrs["colors"] == {WHITE: None, GREY: None, BLACK: pytest.approx(300 * MIB / 60, rel=0.05)}


def test_a_grey_leak_that_ends_in_an_emptied_pool_does_not_become_black():
    # At its OOM the allocator gives its pool back; NVML's charge follows a sample later.
    grey = lambda i: 20 * GIB + i * 2 * GIB / 60 if i < 150 else 2 * GIB  # noqa: E731
    black = lambda i: 20 * GIB + 600 * MIB + min(i, 151) * 2 * GIB / 60  # noqa: E731
    for seconds in (150, 152):
        h = build(seconds, steps(GIB, 100 * MIB), grey, black)
        assert [f.attrs["color"] for f in LeakDetector().observe(h)] == ([GREY] if seconds == 150 else [])


def test_black_with_ebpf_grey_flat_is_driver_level():
    black = lambda i: 8 * GIB + 500 * MIB / 60 * i  # noqa: E731
    h = build(300, black=black, live=lambda i: 4 * GIB)
    f = one(LeakDetector().observe(h))
    assert f.attrs["color"] == BLACK and f.attrs["grey_source"] == "ebpf"
    # eBPF's own allocations do not grow: the growth is outside what it saw (contexts, ...)
    assert f.attrs["allocator"] is None and "the driver's charge grows while the allocator's does not" in f.summary


def test_black_alone_says_the_part_that_grows_is_unknown():
    h = build(300, black=lambda i: 8 * GIB + 500 * MIB / 60 * i)
    f = one(LeakDetector().observe(h))
    assert f.attrs["color"] == BLACK and f.attrs["grey_source"] == "none" and "unknown" in f.summary


def test_fast_leak_is_seen_within_90_seconds_of_its_start():
    start = 200  # a steady job, then it starts leaking 1 GiB a minute
    black = lambda i: 20 * GIB + max(0, i - start) * GIB / 60  # noqa: E731
    for seconds in range(start + 30, start + 121, 10):
        found = list(LeakDetector().observe(build(seconds, black=black)))
        if found:
            break
    assert found and seconds - start <= 90, seconds - start
    assert found[0].attrs["rate_bytes_per_second"] == pytest.approx(GIB / 60, rel=0.1)


def test_fast_leak_right_after_a_large_allocation_is_seen_within_a_minute_and_a_bit():
    # A job loads 120 GiB (weights, a ballast), then leaks 2 GiB a minute: the jump must not hide the
    # rise until it leaves the 90 s window; the 60 s window sees the rise alone.
    start = 10
    black = lambda i: (GIB if i < 5 else 121 * GIB) + max(0, i - start) * 2 * GIB / 60  # noqa: E731
    seen = next(s for s in range(start + 20, start + 121, 2) if list(LeakDetector().observe(build(s, black=black))))
    assert seen - start <= 62, seen - start
    f = one(LeakDetector().observe(build(seen, black=black)))
    assert f.attrs["rate_bytes_per_second"] == pytest.approx(2 * GIB / 60, rel=0.05)


def test_time_to_oom_uses_nvmls_free_memory_when_reported():
    # limit - used overstates the free memory by what the driver reserves for itself.
    rate = 500 * MIB / 60
    black = lambda i: 8 * GIB + rate * i  # noqa: E731
    h = build(300, black=black)
    for i in range(300):
        h.append([Sample("gpuwatch.gpu.memory.free", float(LIMIT - black(i) - 645 * MIB), GPU, {}, T0 + i)])
    f = one(LeakDetector().observe(h))
    assert f.attrs["headroom_bytes"] == pytest.approx(LIMIT - black(299) - 645 * MIB)
    assert f.attrs["time_to_oom_seconds"] == pytest.approx(f.attrs["headroom_bytes"] / rate, rel=0.05)


def test_slow_leak_is_seen_within_5_minutes():
    black = lambda i: 20 * GIB + 100 * 1e6 / 60 * i  # noqa: E731  100 MB a minute
    seen = next(s for s in range(60, 601, 15) if list(LeakDetector().observe(build(s, black=black))))
    assert seen <= 300
    # 90 s windows hold 119 MiB of growth (under 128): the 300 s window judges it once it spans 240 s.
    assert seen == 255
    f = one(LeakDetector().observe(build(seen, black=black)))
    assert (f.attrs["color"], f.attrs["window_seconds"], f.severity) == (BLACK, 254.0, "warning")
    # The last half's slope: floors at 127 s and 212 s (85 s of rise) over bucket centres 2 x 254/6 s
    # apart, 255/254 of the true rate.
    assert f.attrs["rate_bytes_per_second"] == pytest.approx(100 * 1e6 / 60 * 255 / 254, rel=1e-8)


# --- what is not a leak -------------------------------------------------------------------

def test_step_shaped_training_is_not_a_leak():
    rnd = random.Random(1)
    white = lambda i: 40 * GIB + (6 * GIB if i % 2 else 0) + rnd.uniform(0, 200 * MIB)  # noqa: E731
    h = build(700, white, lambda i: 50 * GIB, lambda i: 50 * GIB + 600 * MIB)
    assert list(LeakDetector().observe(h)) == []


def test_warm_up_growth_that_plateaus_is_not_a_leak():
    grow = lambda i: 10 * GIB + min(i, 60) * 50 * MIB  # noqa: E731  3 GB over a minute, then flat
    for seconds in (95, 150, 300, 700):
        assert list(LeakDetector().observe(build(seconds, grow, grow, lambda i: grow(i) + 600 * MIB))) == [], seconds


def test_periodic_empty_cache_is_not_a_leak():
    # The pool grows for 2.5 minutes, then empty_cache() gives it back: a sawtooth.
    grey = lambda i: 20 * GIB + (i % 150) * 40 * MIB  # noqa: E731
    h = build(700, steps(18 * GIB, GIB), grey, lambda i: grey(i) + 600 * MIB)
    assert list(LeakDetector().observe(h)) == []


def test_noise_and_short_processes_are_not_leaks():
    rnd = random.Random(2)
    h = build(700, black=lambda i: 20 * GIB + rnd.uniform(-50, 50) * MIB)
    assert list(LeakDetector().observe(h)) == []
    fast_but_short = build(40, black=lambda i: 20 * GIB + i * GIB / 60)
    assert list(LeakDetector().observe(fast_but_short)) == []


def test_a_process_that_exited_has_no_finding():
    h = build(300, black=lambda i: 8 * GIB + 500 * MIB / 60 * i)
    h.append([Sample("gpuwatch.process.gpu.memory.usage", 1.0 * GIB, GPU, {"pid": "7", "process": "other-job"},
                     T0 + 300 + 60)])  # a minute later, only another process is reported
    assert [f.attrs["pid"] for f in LeakDetector().observe(h)] == []


def test_no_memory_series_no_findings_and_folded_processes_are_skipped():
    assert list(LeakDetector().observe(History())) == []
    h = History()
    for i in range(300):
        h.append([Sample("gpuwatch.process.gpu.memory.usage", 8 * GIB + i * 10 * MIB, GPU,
                         {"pid": "other", "process": "other"}, T0 + i)])
    assert list(LeakDetector().observe(h)) == []


def test_trend_needs_a_full_window_and_steady_floors():
    pts = [(T0 + i, 1e9 + i * 1e7) for i in range(100)]
    s = LeakSettings()
    assert trend(pts, 90, T0 + 99, s) is not None
    assert trend(pts[:50], 90, T0 + 49, s) is None  # younger than the window
    dip = [(t, v - (5e8 if 40 <= t - T0 < 45 else 0)) for t, v in pts]
    assert trend(dip, 90, T0 + 99, s) is None  # memory given back in the window


def test_without_nvml_the_in_process_colors_still_judge():
    rate = 400 * MIB / 60
    h = build(300, white=lambda i: 10 * GIB + rate * i, grey=lambda i: 12 * GIB + rate * i)
    f = one(LeakDetector().observe(h))
    assert f.attrs["color"] == WHITE and f.attrs["rate_bytes_per_second"] == pytest.approx(rate, rel=0.05)


# --- every threshold, just below and just above ---------------------------------------------
# The series below are staircases: a floor that steps to floors[k] at the start of each bucket and
# creeps up 64 KiB a second inside it (so the floor still rises over the last 30 s), which makes the
# detector's bucket floors exactly `floors` and its rates exact.

CREEP = 64 * 1024


def stairs(floors, width: int):
    last = len(floors) - 1
    return lambda i: floors[min(i // width, last)] + (i - width * min(i // width, last)) * CREEP


def cum(base: float, *steps: float) -> list:
    out = [base]
    for d in steps:
        out.append(out[-1] + d)
    return out


def findings(h: History) -> list:
    fs = list(LeakDetector().observe(h))
    for s in LeakDetector.samples(fs):
        metrics.get(s.metric)
    return fs


def summary(color_text: str, rate: str, tail: str = "") -> str:
    return f"process 4242 (python3) on GPU {GPU} is leaking {rate}/min: {color_text}{tail}"


def test_fmt_duration_switches_units_at_90_seconds_and_90_minutes():
    assert [fmt_duration(s) for s in (0, 89.4, 89.5, 90, 151, 5399, 5400, 5580, 36000)] == [
        "0 s", "89 s", "90 s", "2 min", "3 min", "90 min", "1.5 h", "1.6 h", "10.0 h"]


def test_growth_just_under_128_mib_is_not_a_leak_and_128_mib_is():
    # 90 s of white in 15 s buckets: four steps of 24 MiB and a last one; growth = their sum.
    for last, found in ((32 * MIB - 1, False), (32 * MIB, True)):
        white = stairs(cum(20 * GIB, 24 * MIB, 24 * MIB, 24 * MIB, 24 * MIB, last), 15)
        h = build(91, white, lambda i: white(i) + 2 * GIB, lambda i: white(i) + 2 * GIB + 600 * MIB)
        fs = findings(h)
        if not found:
            assert fs == []
            continue
        (f,) = fs
        assert f.attrs["color"] == WHITE and f.attrs["growth_bytes"] == 128 * MIB
        # The median slope is the 24 MiB step's; the last half's (24 + 32 MiB over 30 s) is steeper.
        assert f.attrs["rate_bytes_per_second"] == pytest.approx(56 * MIB / 30, rel=1e-12)
        assert f.attrs["window_seconds"] == 90.0
        assert f.attrs["confidence"] == 0.55  # r2 1, rising 1, (90 s / 300 s) ** 0.5 = 0.548


def test_a_rate_just_under_256_kib_a_second_is_not_a_leak_and_256_kib_is():
    # 10 minutes of grey in 100 s buckets: four steps of 25 MiB (256 KiB/s, the median slope) and a
    # steeper last one so that the growth (132 MiB) passes; only the rate decides.
    for step, found in ((25 * MIB - 100, False), (25 * MIB, True)):
        grey = stairs(cum(30 * GIB, step, step, step, step, 32 * MIB), 100)
        h = build(601, steps(20 * GIB, 2 * GIB), grey, lambda i: grey(i) + 600 * MIB)
        fs = findings(h)
        if not found:
            assert fs == []
            continue
        (f,) = fs
        assert (f.attrs["color"], f.attrs["grey_source"], f.severity) == (GREY, "agent", "warning")
        assert f.attrs["growth_bytes"] == 132 * MIB and f.attrs["window_seconds"] == 600.0
        assert f.attrs["rate_bytes_per_second"] == pytest.approx(57 * MIB / 200, rel=1e-12)  # the last half's
        assert f.attrs["confidence"] == 1.0


def test_a_fit_just_under_r2_0_8_is_not_a_leak_and_just_over_is():
    # Black in 15 s buckets: four steps of 16 MiB, then a jump. In units of 2 MiB the floors are
    # 0 8 16 24 32 82: r2 = 245^2 / (17.5 * 4270) = 49/61 = 0.803; a jump of 102 MiB gives 0.799.
    for jump, found in ((102 * MIB, False), (100 * MIB, True)):
        black = stairs(cum(8 * GIB, 16 * MIB, 16 * MIB, 16 * MIB, 16 * MIB, jump), 15)
        fs = findings(build(91, black=black))
        pts = [(T0 + i, black(i)) for i in range(91)]
        if not found:
            assert fs == []
            assert trend(pts, 90, T0 + 90, LeakSettings(min_r2=0.79))
            continue
        (f,) = fs
        assert f.attrs["color"] == BLACK and f.attrs["grey_source"] == "none"
        assert f.attrs["rate_bytes_per_second"] == pytest.approx(116 * MIB / 30, rel=1e-12)  # the last half's
        assert f.attrs["colors"] == {BLACK: 4054493.9}  # 116 MiB / 30 s, to 0.1 byte
        assert f.attrs["growth_bytes"] == 164 * MIB
        assert f.attrs["confidence"] == round(49 / 61 * (90 / 300) ** 0.5, 2) == 0.44
        assert trend(pts, 90, T0 + 90).r2 == pytest.approx(49 / 61, rel=1e-12)
    # Exactly 0.8 is enough: in units of 8 MiB the floors 0 9 9 10 11 21 give 56^2 / (17.5 * 224).
    (f,) = findings(build(91, black=stairs(cum(8 * GIB, 72 * MIB, 0, 8 * MIB, 8 * MIB, 80 * MIB), 15)))
    assert f.attrs["color"] == BLACK and f.attrs["growth_bytes"] == 168 * MIB
    assert f.attrs["rate_bytes_per_second"] == pytest.approx(44 * MIB / 15, rel=1e-12)  # the last half's


def test_a_floor_that_rises_in_four_of_five_steps_is_a_leak_and_three_of_five_is_not():
    # A step counts as rising when it is more than 1 MiB; 3 of 5 is under the 0.75 needed.
    x, eps = 48 * MIB, 1 * MIB
    for steps_, rising in (((x, eps, eps, x, x), None), ((x, eps, x, x, x), 0.8),
                           ((x, eps + 1, eps + 1, x, x), 1.0)):
        black = stairs(cum(8 * GIB, *steps_), 15)
        fs = findings(build(91, black=black))
        pts = [(T0 + i, black(i)) for i in range(91)]
        if rising is None:
            assert fs == []
            assert trend(pts, 90, T0 + 90, LeakSettings(min_rising=0.6)).rising == 0.6
            continue
        (f,) = fs
        assert f.attrs["color"] == BLACK and f.attrs["growth_bytes"] == sum(steps_)
        assert trend(pts, 90, T0 + 90).rising == rising
        # r2 (0.963, then 0.877) x rising x (90 / 300) ** 0.5
        assert f.attrs["confidence"] == {0.8: 0.42, 1.0: 0.48}[rising]


def test_the_last_half_rising_at_half_the_first_halfs_slope_is_a_leak_and_slower_is_not():
    # Floors 0 X 2X 3X, then two steps of Y: the first half's slope is X / 15 s, the last half's Y / 15 s.
    x = 40 * MIB
    for y, found in ((x / 2 - 1, False), (x / 2, True)):
        black = stairs(cum(8 * GIB, x, x, x, y, y), 15)
        fs = findings(build(91, black=black))
        if not found:
            assert fs == []
            assert trend([(T0 + i, black(i)) for i in range(91)], 90, T0 + 90, LeakSettings(min_late_ratio=0.49))
            continue
        (f,) = fs
        # The floors are X * (0 1 2 3 3.5 4); the median of the 15 slopes is floor 1 to floor 4's:
        # 2.5 X over 45 s (the last half's, X / 30 s, is the slower).
        assert f.attrs["rate_bytes_per_second"] == pytest.approx(2.5 * x / 45, rel=1e-12)
        assert f.attrs["growth_bytes"] == 4 * x


def test_a_floor_given_back_by_1_mib_is_tolerated_and_by_more_is_not():
    x, eps = 40 * MIB, 1 * MIB
    for back, found in ((eps + 1, False), (eps, True)):
        black = stairs(cum(8 * GIB, x, x, -back, x, x), 15)
        fs = findings(build(91, black=black))
        assert [(f.attrs["color"], f.attrs["growth_bytes"]) for f in fs] == ([(BLACK, 4 * x - eps)] if found else [])


def test_a_fast_first_step_does_not_set_the_early_slope():
    # The first half's slope is the median of its floors' slopes (4/3 X per bucket here), not the first
    # step's 3 X: a steady X per bucket after it is a leak.
    x = 30 * MIB
    black = stairs(cum(8 * GIB, 3 * x, x, x, x, x), 15)
    (f,) = findings(build(91, black=black))
    assert f.attrs["color"] == BLACK and f.attrs["growth_bytes"] == 7 * x


def test_half_the_rise_given_back_within_10_minutes_is_a_sawtooth_and_less_is_a_leak():
    # The pool grows 2 MiB/s, gives some back at 94 s, then grows on: the 90 s window after the fall
    # rises by 150 MiB. The 15 s floors before and after the fall differ by the fall less 30 MiB.
    for fall, found in ((105 * MIB, False), (105 * MIB - 1, True)):
        grey = lambda i, fall=fall: 20 * GIB + i * 2 * MIB - (fall if i >= 94 else 0)  # noqa: E731
        h = build(200, steps(10 * GIB, GIB), grey, lambda i: grey(i) + 600 * MIB)
        fs = findings(h)
        assert [(f.attrs["color"], f.attrs["rate_bytes_per_second"], f.attrs["growth_bytes"]) for f in fs] == (
            [(GREY, 2 * MIB, 150 * MIB)] if found else [])


def test_a_fall_more_than_10_minutes_ago_is_not_a_sawtooth():
    # The pool fell by 1 GiB, then grew 2 MiB/s: the 600 s window after the fall rises 1000 MiB.
    for fall_at, found in ((50, True), (150, False)):
        grey = lambda i, f=fall_at: 20 * GIB + i * 2 * MIB - (GIB if i >= f else 0)  # noqa: E731
        fs = findings(build(702, steps(10 * GIB, GIB), grey, lambda i: grey(i) + 600 * MIB))
        assert [(f.attrs["color"], f.attrs["window_seconds"], f.attrs["growth_bytes"]) for f in fs] == (
            [(GREY, 600.0, 1000 * MIB)] if found else []), fall_at


def add(h: History, seconds: int, metric: str, fn, labels=None, resource: str = GPU) -> History:
    for i in range(seconds):
        h.append([Sample(metric, float(fn(i)), resource, PROC if labels is None else labels, T0 + i)])
    return h


OTHER = {"pid": "4343", "process": "trainer"}
USAGE = "gpuwatch.process.gpu.memory.usage"


def test_a_process_last_seen_15_s_ago_is_judged_and_16_s_ago_is_not():
    for gap, pids in ((15, ["4242", "4343"]), (16, ["4343"])):
        h = build(300, black=lambda i: 8 * GIB + 2 * MIB * i)
        add(h, 300 + gap, USAGE, lambda i: 30 * GIB + 3 * MIB * i, OTHER)  # another leak goes on
        assert [f.attrs["pid"] for f in findings(h)] == pids, gap


def test_an_emptied_pool_in_one_process_does_not_hide_anothers_leak():
    grey = lambda i: 20 * GIB + i * 2 * GIB / 60 if i < 150 else 2 * GIB  # noqa: E731
    black = lambda i: 20 * GIB + 600 * MIB + min(i, 151) * 2 * GIB / 60  # noqa: E731
    h = add(build(152, steps(GIB, 100 * MIB), grey, black), 152, USAGE, lambda i: 30 * GIB + 3 * MIB * i, OTHER)
    assert [(f.attrs["pid"], f.attrs["color"]) for f in findings(h)] == [("4343", BLACK)]


def test_time_to_oom_of_exactly_15_minutes_is_a_warning_and_less_is_critical():
    # 2 MiB/s (120 MiB a minute) against 1800 MiB of NVML's free memory: 900 s.
    for free, severity, left in ((1800 * MIB, "warning", "15 min"), (1800 * MIB - 1, "critical", "15 min")):
        h = build(91, black=lambda i: 8 * GIB + 2 * MIB * i)
        add(h, 91, "gpuwatch.gpu.memory.free", lambda i, free=free: free, {})
        (f,) = findings(h)
        assert f.severity == severity and f.attrs["time_to_oom_seconds"] == free / (2 * MIB)
        assert f.attrs["headroom_bytes"] == free and f.attrs["rate_bytes_per_second"] == 2 * MIB
        assert f.summary == summary(
            "memory outside the allocator (black: the driver's charge grows while the allocator's does not)",
            "120.0 MiB", f"; out of memory in {left} at this rate (1.8 GiB left) (no in-process agent or eBPF: "
                         "which part of the process grows is unknown)")
        labels = {"pid": "4242", "process": "python3", "color": BLACK}
        assert LeakDetector.samples([f]) == [
            Sample("gpuwatch.leak.suspected", 1.0, GPU, labels, T0 + 90),
            Sample("gpuwatch.leak.growth.rate", 2 * MIB, GPU, labels, T0 + 90),
            Sample("gpuwatch.leak.time_to_oom", free / (2 * MIB), GPU, labels, T0 + 90)]


def test_a_full_gpu_is_out_of_memory_now():
    # NVML's used equals the limit: no headroom, whatever the rate.
    black = lambda i: 8 * GIB + 2 * MIB * i  # noqa: E731
    (f,) = findings(build(91, black=black, others=LIMIT - black(90)))
    assert (f.severity, f.attrs["headroom_bytes"], f.attrs["time_to_oom_seconds"]) == ("critical", 0.0, 0.0)
    assert f.summary.endswith("; out of memory in 0 s at this rate (0 B left) (no in-process agent or eBPF: "
                              "which part of the process grows is unknown)")


def test_white_without_gpu_totals_has_no_forecast():
    # Only the in-process agent: no NVML, so no free memory and no time to OOM.
    h = History()
    add(h, 91, "gpuwatch.process.gpu.memory.allocated", lambda i: 10 * GIB + 2 * MIB * i)
    add(h, 91, "gpuwatch.process.gpu.memory.reserved", lambda i: 10 * GIB + 2 * MIB * i)
    (f,) = findings(h)
    assert (f.severity, f.attrs["headroom_bytes"], f.attrs["time_to_oom_seconds"]) == ("warning", None, None)
    assert f.summary == summary("tensors kept alive (white: allocated bytes grow)", "120.0 MiB")
    assert f.attrs["colors"] == {WHITE: 2 * MIB, GREY: 2 * MIB}
    labels = {"pid": "4242", "process": "python3", "color": WHITE}
    assert LeakDetector.samples([Finding("gpu_throttle", GPU, "warning", "hot", {}, T0), f]) == [
        Sample("gpuwatch.leak.suspected", 1.0, GPU, labels, T0 + 90),
        Sample("gpuwatch.leak.growth.rate", 2 * MIB, GPU, labels, T0 + 90)]


def test_white_headroom_is_the_free_memory_when_the_pool_has_no_unused_part():
    white = lambda i: 10 * GIB + 2 * MIB * i  # noqa: E731
    h = build(91, white, white, lambda i: white(i) + 600 * MIB, others=100 * GIB)
    (f,) = findings(h)
    free = LIMIT - 100 * GIB - (white(90) + 600 * MIB)
    assert f.attrs["headroom_bytes"] == free and f.attrs["time_to_oom_seconds"] == free / (2 * MIB)
    assert f.summary == summary("tensors kept alive (white: allocated bytes grow)", "120.0 MiB",
                                "; out of memory in 4.3 h at this rate (30.2 GiB left)")  # 30.2 GiB / 2 MiB/s


def test_the_longest_window_that_rises_is_the_one_reported():
    # A linear rise judged at 200 s, 400 s and 700 s: the 90 s, 300 s and 600 s windows.
    for seconds, window, confidence in ((200, 90.0, 0.55), (400, 300.0, 1.0), (700, 600.0, 1.0)):
        (f,) = findings(build(seconds, black=lambda i: 8 * GIB + 2 * MIB * i))
        assert (f.attrs["window_seconds"], f.attrs["confidence"]) == (window, confidence), seconds
        assert f.attrs["growth_bytes"] == 2 * MIB * window * 5 / 6  # first to last bucket's floor
    # A big allocation 50 s in: the 90 s window holds the jump and flattens, the 60 s one sees the rise.
    black = lambda i: (GIB if i < 50 else 21 * GIB) + 3 * MIB * i  # noqa: E731
    (f,) = findings(build(120, black=black))
    assert (f.attrs["window_seconds"], f.attrs["growth_bytes"]) == (60.0, 150 * MIB)


def test_a_younger_series_is_judged_with_less_confidence():
    # 86 s of points fill the 90 s window enough (0.8 of it): confidence (86 / 300) ** 0.5 = 0.535.
    (f,) = findings(build(87, black=lambda i: 8 * GIB + 2 * MIB * i))
    assert (f.attrs["window_seconds"], f.attrs["confidence"]) == (86.0, 0.54)


# --- where grey comes from ------------------------------------------------------------------

LIVE = "gpuwatch.process.cuda.memory.live"
GPU2 = "GPU-5b1e0f3c-7d2a-4c1b-9e8f-0a1b2c3d4e5f"


POOLED = "gpuwatch.process.cuda.memory.pooled"


def pooled(h: History, seconds: int, allocator: str, fn) -> History:
    """eBPF's pooled bytes of PROC by `allocator`, beside its live bytes (same timestamps)."""
    return add(h, seconds, POOLED, fn, dict(PROC, allocator=allocator), "")


def test_ebpf_pooled_bytes_that_grow_are_a_grey_leak_that_names_the_allocator():
    live = lambda i: 4 * GIB + 2 * MIB * i  # noqa: E731
    h = build(91, black=lambda i: live(i) + 600 * MIB, live=live)
    pooled(h, 91, "pytorch", lambda i: live(i) - 100 * MIB)  # all but a workspace is PyTorch's pool
    add(h, 91, LIVE, lambda i: 0.0, {"pid": "77", "process": "gone"}, "")  # a process on no GPU: ignored
    (f,) = findings(h)
    assert (f.attrs["color"], f.attrs["grey_source"], f.attrs["rate_bytes_per_second"]) == (GREY, "ebpf", 2 * MIB)
    assert f.attrs["allocator"] == "pytorch"
    assert f.summary == summary(
        "the allocator's pool (grey: driver allocations made by the PyTorch caching allocator (libc10_cuda) grow)",
        "120.0 MiB", "; out of memory in 19.4 h at this rate (136.2 GiB left)")  # 141 GiB less 4.8 GiB, at 2 MiB/s


def test_ebpf_live_bytes_outside_any_allocator_that_grow_are_black_not_grey():
    # What an H200 showed: a process leaking plain cudaMalloc memory, no in-process agent. eBPF's live
    # bytes grow, but none of them are pooled: black, said to be plain calls outside any allocator.
    live = lambda i: 4 * GIB + 2 * MIB * i  # noqa: E731
    h = build(91, black=lambda i: live(i) + 600 * MIB, live=live)
    (f,) = findings(h)
    assert (f.attrs["color"], f.attrs["grey_source"], f.attrs["allocator"]) == (BLACK, "ebpf", "none")
    assert f.attrs["colors"] == {GREY: None, BLACK: 2 * MIB}  # grey (pooled) is known, and flat at 0
    assert f.summary == summary(
        "memory outside any allocator (black: plain cuMemAlloc/cudaMalloc calls outside any allocator grow)",
        "120.0 MiB", "; out of memory in 19.4 h at this rate (136.2 GiB left)")
    # The same beside a pool that holds steady: its bytes are grey, the growth is still outside.
    h = build(91, black=lambda i: live(i) + 600 * MIB, live=lambda i: live(i) + 3 * GIB)
    pooled(h, 91, "cupy", lambda i: 3 * GIB)
    (f,) = findings(h)
    assert (f.attrs["color"], f.attrs["allocator"]) == (BLACK, "none")


def test_black_growing_with_a_pool_too_young_to_judge_waits_for_grey():
    # NVML charges the process from its start; eBPF's pool series begins 20 s later. When black's
    # minute is full, grey's is not: black is what lies beyond grey, so nothing yet, then grey.
    black = lambda i: 2 * GIB + 4 * MIB * i  # noqa: E731
    pool = lambda i: max(0, i - 20) * 4 * MIB  # noqa: E731

    def judged(seconds: int, pool_rate: float = 1.0) -> list:
        h = build(seconds, black=black)
        add(h, seconds, LIVE, lambda i: pool_rate * pool(i) + 100 * MIB)
        pooled(h, seconds, "pytorch", lambda i: pool_rate * pool(i))
        return [(f.attrs["color"], f.attrs["allocator"]) for f in findings(h)]

    assert judged(61) == []  # black's 60 s window holds 60 s of rise, grey's 40 s
    assert judged(91) == [(GREY, "pytorch")]
    # A pool rising far slower than black does not hold black back.
    assert judged(61, pool_rate=0.1) == [(BLACK, None)]


def test_plain_calls_are_named_once_they_make_most_of_blacks_growth():
    # eBPF's outside bytes rise for only the last 45 s of black's minute (its process allocated late,
    # or the probe attached late): most of the growth all the same.
    black = lambda i: 2 * GIB + 4 * MIB * i  # noqa: E731
    for start, allocator in ((15, "none"), (40, None)):
        h = build(61, black=black, live=lambda i, start=start: 100 * MIB + max(0, i - start) * 4 * MIB)
        (f,) = findings(h)
        assert (f.attrs["color"], f.attrs["allocator"]) == (BLACK, allocator), start
        assert ("plain cuMemAlloc/cudaMalloc calls" in f.summary) == (allocator == "none")


def test_the_pool_that_grows_is_named_among_several_and_configured_names_are_used():
    h = build(91, black=lambda i: 20 * GIB + 2 * MIB * i, live=lambda i: 10 * GIB + 2 * MIB * i)
    pooled(h, 91, "pytorch", lambda i: 8 * GIB)  # steady
    pooled(h, 91, "fakepool", lambda i: GIB + 2 * MIB * i)  # grows
    fs = list(LeakDetector(allocators={"fakepool": "fakepool (libfakepool.so*)"}).observe(h))
    assert [(f.attrs["color"], f.attrs["allocator"]) for f in fs] == [(GREY, "fakepool")]
    assert fs[0].summary.startswith(
        f"process 4242 (python3) on GPU {GPU} is leaking 120.0 MiB/min: the allocator's pool (grey: driver "
        "allocations made by the fakepool (libfakepool.so*) grow)")
    # An allocator with no name for people is named by its label.
    (f,) = LeakDetector(allocators={}).observe(h)
    assert "driver allocations made by the fakepool grow" in f.summary


def test_a_frameworks_preallocation_is_a_plateau_never_a_leak():
    # JAX takes 75 % of the GPU at its start (XLA's BFC allocator, one driver allocation), then its
    # tensors come and go inside it: a one-time step, not a leak, judged every 10 s for 11 minutes.
    pre = 0.75 * LIMIT
    black = lambda i: 600 * MIB + (pre if i >= 30 else 0.0)  # noqa: E731
    live = lambda i: pre if i >= 30 else 0.0  # noqa: E731
    for seconds in range(40, 701, 10):
        h = build(seconds, black=black, live=live)
        pooled(h, seconds, "xla", live)
        assert list(LeakDetector().observe(h)) == [], seconds
    # A preallocation taken over a few seconds, in chunks, is a plateau too.
    ramp = lambda i: min(max(i - 30, 0), 5) * pre / 5  # noqa: E731
    for seconds in range(40, 701, 10):
        h = build(seconds, black=lambda i: 600 * MIB + ramp(i), live=ramp)
        pooled(h, seconds, "xla", ramp)
        assert list(LeakDetector().observe(h)) == [], seconds


def test_ebpf_live_bytes_of_a_process_on_two_gpus_are_not_its_grey():
    # eBPF counts a process's allocations on all its GPUs together: they are no one GPU's grey.
    live = lambda i: 4 * GIB + 2 * MIB * i  # noqa: E731
    h = build(91, black=lambda i: live(i) + 600 * MIB, live=live)
    add(h, 91, USAGE, lambda i: 2 * GIB, resource=GPU2)
    (f,) = findings(h)
    assert (f.resource, f.attrs["color"], f.attrs["grey_source"]) == (GPU, BLACK, "none")
    assert f.summary.endswith(" (no in-process agent or eBPF: which part of the process grows is unknown)")


def test_the_in_process_agents_grey_wins_over_ebpf():
    # The agent's reserved bytes are flat while eBPF's live bytes grow: the agent's are grey, so the
    # growth is black (outside the allocator), and the message does not call the source unknown.
    grow = lambda i: 8 * GIB + 2 * MIB * i  # noqa: E731
    h = build(91, steps(GIB, 100 * MIB), lambda i: 2 * GIB, grow, live=grow)
    (f,) = findings(h)
    assert (f.attrs["color"], f.attrs["grey_source"], f.attrs["allocator"]) == (BLACK, "agent", "none")
    # eBPF still tells what the growth is: none of its growing bytes were made by a pool
    assert f.summary == summary(
        "memory outside any allocator (black: plain cuMemAlloc/cudaMalloc calls outside any allocator grow)",
        "120.0 MiB", "; out of memory in 18.9 h at this rate (132.8 GiB left)")  # 141 GiB less 8.2 GiB, at 2 MiB/s
    # Without eBPF's view the growth is only known to be outside the allocator.
    (f,) = findings(build(91, steps(GIB, 100 * MIB), lambda i: 2 * GIB, grow))
    assert (f.attrs["color"], f.attrs["allocator"]) == (BLACK, None)
    assert f.summary == summary(
        "memory outside the allocator (black: the driver's charge grows while the allocator's does not)",
        "120.0 MiB", "; out of memory in 18.9 h at this rate (132.8 GiB left)")


def test_series_without_a_gpu_or_a_pid_and_folded_others_are_not_processes():
    grow = lambda i: 8 * GIB + 2 * MIB * i  # noqa: E731
    h = History()
    add(h, 91, USAGE, grow, {"pid": "other", "process": "other"})  # listed first: the rest still counts
    add(h, 91, USAGE, grow, {"process": "no-pid"})
    add(h, 91, USAGE, grow, resource="")
    assert findings(h) == []
    add(h, 91, USAGE, grow, {"pid": "4242"})  # no process name: judged, named ""
    (f,) = findings(h)
    assert (f.attrs["pid"], f.attrs["process"]) == ("4242", "")
    assert f.summary.startswith(f"process 4242 () on GPU {GPU} is leaking 120.0 MiB/min: ")


# --- the rules one by one -------------------------------------------------------------------

def test_trend_needs_12_points_spanning_0_8_of_the_window():
    line = lambda t: 1e9 + t * 3 * MIB  # noqa: E731
    sparse = [(T0 + t, line(t)) for t in range(0, 89, 8)]  # 12 points over 88 s
    assert trend(sparse, 90, T0 + 88) is not None
    assert trend(sparse[1:], 90, T0 + 88) is None  # 11
    pts = [(T0 + t, line(t)) for t in range(73)]  # 72 s: 0.8 of 90 s
    tr = trend(pts, 90, T0 + 72)
    assert (tr.window, tr.growth, tr.rising, tr.latest) == (72.0, 180 * MIB, 1.0, line(72))  # 5 x 12 s x 3 MiB/s
    assert tr.rate == pytest.approx(3 * MIB, rel=1e-12) and tr.r2 == pytest.approx(1.0, rel=1e-12)
    assert trend(pts[1:], 90, T0 + 72) is None  # 71 s
    assert trend(pts + [(T0 + 80, 0.0)], 90, T0 + 72).latest == line(72)  # points after `now` are not read
    flat = [(T0 + t, 5e9) for t in range(91)]
    assert trend(flat, 90, T0 + 90) is None


def test_trend_allows_one_empty_bucket_not_two():
    # 90 s in 15 s buckets, 3 MiB/s; without bucket 2 the 4 steps rise in 3 of 4 (0.75: enough).
    line = lambda t: 1e9 + t * 3 * MIB  # noqa: E731
    one_gap = [(T0 + t, line(t)) for t in range(91) if not 30 <= t < 45]
    tr = trend(one_gap, 90, T0 + 90)
    assert tr.rising == 1.0 and tr.growth == 225 * MIB
    two_gaps = [(t, v) for t, v in one_gap if not 60 <= t - T0 < 75]
    assert trend(two_gaps, 90, T0 + 90) is None
    # 3 of 4 steps rising with a bucket missing: exactly the 0.75 needed.
    stair = stairs(cum(1e9, 60 * MIB, 60 * MIB, 60 * MIB, 0, 60 * MIB), 15)
    pts = [(T0 + t, stair(t)) for t in range(91) if not 15 <= t < 30]
    tr = trend(pts, 90, T0 + 90)
    assert (tr.rising, tr.growth) == (0.75, 240 * MIB)


def test_still_rising_compares_the_floors_of_the_last_two_30_s():
    s = LeakSettings()
    assert still_rising([], s) is False
    t1 = T0 + 100
    base = [(t1 - 60, 0.0), (t1 - 59, 10 * MIB), (t1 - 31, 12 * MIB), (t1 - 30, 10 * MIB)]
    # last 30 s: (t1-30, t1]; before: (t1-60, t1-30]. Floors 10 MiB and 10 MiB + 1 MiB (+1 byte).
    assert still_rising(base + [(t1 - 29, 12 * MIB), (t1, 11 * MIB)], s) is False
    assert still_rising(base + [(t1 - 29, 12 * MIB), (t1, 11 * MIB + 1)], s) is True
    assert still_rising(base + [(t1 - 29, 11 * MIB + 1), (t1, 12 * MIB)], s) is True
    assert still_rising([(t1 - 61, 0.0)] + base[1:] + [(t1, 12 * MIB)], s) is True
    assert still_rising([(t1 - 30, 10 * MIB), (t1, 12 * MIB)], s) is True
    assert still_rising([(t1 - 29, 10 * MIB), (t1, 12 * MIB)], s) is False  # nothing before
    assert still_rising([(t1 - 45, 5 * MIB), (t1 - 31, 10 * MIB), (t1, 12 * MIB)], s) is True
    # Floors, not the first or last value of each half.
    assert still_rising([(t1 - 59, 12 * MIB), (t1 - 40, 10 * MIB), (t1, 11 * MIB + 1)], s) is True


def test_sawtooth_is_a_15_s_floor_falling_by_half_the_rise_within_10_minutes():
    s, now = LeakSettings(), T0 + 1000
    # Floors of the 15 s buckets from now - 600 s: 200, then 50 (150: half of a 300 rise), then 80.
    pts = [(now - 600, 200.0), (now - 590, 220.0), (now - 585, 50.0), (now - 570, 80.0)]
    assert sawtooth(pts, now, 300.0, s) is True
    assert sawtooth(pts, now, 301.0, s) is False
    # A point before the lookback does not count: the floors are 220, 50, 80 (170: half of 340).
    assert sawtooth([(now - 601, 200.0)] + pts[1:], now, 340.0, s) is True
    assert sawtooth([(now - 601, 200.0)] + pts[1:], now, 341.0, s) is False
    assert sawtooth([(now - 601, 1000.0)] + pts[1:], now, 400.0, s) is False  # 1000 -> 220 is too old
    # A fall inside a bucket is a training step, not a tooth; the newest point counts.
    assert sawtooth([(now - 20, 0.0), (now - 16, 100.0), (now - 15, 50.0)], now, 100.0, s) is False
    assert sawtooth([(now - 15, 100.0), (now, 50.0)], now, 100.0, s) is True
    assert sawtooth([(now - 15, 100.0), (now + 1, 0.0)], now, 100.0, s) is False


def test_gave_back_is_a_fall_of_half_the_amount_within_the_last_60_s():
    s, t1 = LeakSettings(), T0 + 100
    assert gave_back([], 1.0, s) is False
    # The peak of (t1 - 60 s, t1] is 150, the latest 50: 100 given back, half of 200.
    pts = [(t1 - 60, 1000.0), (t1 - 59, 150.0), (t1 - 1, 100.0), (t1, 50.0)]
    assert gave_back(pts, 200.0, s) is True
    assert gave_back(pts, 201.0, s) is False
    assert gave_back(pts[1:], 201.0, s) is False


def test_the_rate_is_the_median_slope_of_the_floors():
    # Floors 0 10 30 90 110 130 MiB: the median of the 15 slopes is floor 0 to floor 4's, 110 MiB over
    # 60 s (the last half's, 20 MiB / 15 s, is the slower).
    black = stairs(cum(8 * GIB, 10 * MIB, 20 * MIB, 60 * MIB, 20 * MIB, 20 * MIB), 15)
    (f,) = findings(build(91, black=black))
    assert f.attrs["rate_bytes_per_second"] == pytest.approx(110 * MIB / 60, rel=1e-12)


def test_the_first_half_need_only_rise_at_all():
    # Bucket 3 has no points; the first three floors rise by 1 MiB + 1 byte and give 1 MiB back: their
    # median slope is 1 byte over 30 s, which is a rise. Then 100 MiB a bucket: the last half's
    # 200 MiB over 45 s is the rate.
    stair = stairs(cum(8 * GIB, MIB + 1, -MIB, 0, 100 * MIB, 100 * MIB), 15)
    tr = trend([(T0 + t, stair(t)) for t in range(91) if not 45 <= t < 60], 90, T0 + 90)
    assert (tr.rising, tr.growth) == (0.75, 200 * MIB + 1)
    assert tr.rate == pytest.approx(200 * MIB / 45, rel=1e-12)


# --- the pieces on their own: exact values at their edges (found by scripts/mutate) -------------

def test_r2_of_known_fits():
    assert _r2([0.0, 1.0], [0.0, 1.0]) == 0.0  # two points: no fit to judge
    assert _r2([0.0, 1.0, 2.0], [0.0, 1.0, 2.0]) == 1.0  # three on a line
    assert _r2([0.0, 1.0, 2.0], [5.0, 5.0, 5.0]) == 0.0  # flat: no rise to fit
    # sxx 1, syy 5, sxy 2: 4 / 5
    assert _r2([-0.5, -0.5, 0.5, 0.5], [0.0, 1.0, 2.0, 3.0]) == pytest.approx(0.8, rel=1e-12)


def test_theil_sen_of_points_at_one_time_is_no_slope():
    assert _theil_sen([3.0, 3.0], [0.0, 5.0]) == 0.0
    assert _theil_sen([0.0, 1.0, 2.0, 4.0], [0.0, 1.0, 4.0, 4.0]) == 1.0  # slopes 0 1 1 1 2 3


def test_rise_is_the_last_buckets_floor_less_the_firsts_bounds_included():
    s, now = LeakSettings(), T0 + 60
    tr = Trend(rate=1.0, growth=1.0, window=60.0, r2=1.0, rising=1.0, latest=300.0)  # buckets of 10 s
    pts = [(T0, 100.0), (T0 + 10, 90.0), (T0 + 18, 80.0), (T0 + 45, 120.0), (T0 + 50, 250.0), (T0 + 60, 300.0)]
    assert rise(pts, tr, now, s) == 250.0 - 90.0  # floors of [T0, T0 + 10] and [T0 + 50, T0 + 60]
    assert rise(pts[1:], tr, now, s) == 250.0 - 80.0  # a younger series: from its own start
    assert rise([(T0 - 1, 5.0)], tr, now, s) == 0.0  # nothing inside the window


def series(fn, seconds: int = 21) -> list:
    return [(float(t), float(fn(t))) for t in range(seconds)]


@pytest.mark.parametrize("pooled, named", [
    ({"empty": [], "b": series(lambda t: 0.5 * t)}, "b"),
    # a's jump came at the window's start exactly (20 - 10): not in it; b rose 5 in it
    ({"a": series(lambda t: 100.0 if t >= 10 else 0.0), "b": series(lambda t: 0.5 * t)}, "b"),
    # a's came just after it: 100 in it
    ({"a": series(lambda t: 100.0 if t > 10 else 0.0), "b": series(lambda t: 0.5 * t)}, "a"),
    ({"a": series(lambda t: 100 + 0.5 * t), "b": series(lambda t: 100 + 0.5 * t)}, "a"),  # a tie: the first
    ({"a": series(lambda t: 100 + 0.5 * t), "b": series(lambda t: 100 + t)}, "b"),
    ({"a": series(lambda t: 10.0 if t == 20 else 0.0), "b": series(lambda t: 0.6 * t)}, "a"),  # a's last point
    ({"a": series(lambda t: 50.0)}, None),  # none rose
])
def test_the_growing_allocator_is_the_one_whose_pool_rose_most_over_the_window(pooled, named):
    p = _Process(GPU, "4242", "python3", pooled=pooled)
    tr = Trend(rate=1.0, growth=1.0, window=10.0, r2=1.0, rising=1.0, latest=0.0)
    assert LeakDetector._growing_allocator(p, tr) == named


def test_ebpf_grey_is_the_sum_of_the_pools_and_outside_the_rest_of_the_live_bytes():
    h = History()
    add(h, 3, LIVE, lambda i: 0.0, {"pid": "77", "process": "gone"}, "")  # on no GPU: skipped, not the end
    add(h, 3, USAGE, lambda i: GIB)
    add(h, 3, LIVE, lambda i: 10.0 * (i + 1), resource="")
    pooled(h, 2, "pytorch", lambda i: 1.0 + i)  # no pooled point at the third collection
    pooled(h, 2, "cupy", lambda i: 3.0 + i)
    (p,) = LeakDetector()._processes(h, T0 + 2)
    assert p.grey_from_ebpf and list(p.pooled) == ["pytorch", "cupy"]
    assert p.colors[GREY] == [(T0, 4.0), (T0 + 1, 6.0), (T0 + 2, 0.0)]
    assert p.outside == [(T0, 6.0), (T0 + 1, 14.0), (T0 + 2, 30.0)]


SELF_REPORTED = "gpuwatch.process.gpu.memory.allocated.self_reported"


@pytest.mark.parametrize("gpu, age, pinned", [
    (GPU2, 16, True),  # the agent's word on another GPU went stale: the process is on GPU only
    (GPU2, 15, False),  # still current: it may hold memory on GPU2 too
    (GPU, 0, True),  # on the same GPU: no other
])
def test_an_in_process_agents_word_for_another_gpu_keeps_ebpf_off_while_current(gpu, age, pinned):
    h = History()
    add(h, 31, USAGE, lambda i: GIB)
    add(h, 31, LIVE, lambda i: 2.0 * GIB, resource="")
    add(h, 31 - age, SELF_REPORTED, lambda i: GIB, resource=gpu)
    (p,) = LeakDetector()._processes(h, T0 + 30)
    assert p.grey_from_ebpf is pinned and (p.outside != []) is pinned


def test_gpus_where_nvml_may_not_list_every_process():
    now, h = T0 + 30, History()
    gpus = [f"GPU-{n}" for n in range(7)]
    h.append([Sample("hw.gpu.memory.limit", float(LIMIT), g, {}, now) for g in gpus])

    def count(g, n, age=0):
        h.append([Sample("gpuwatch.gpu.processes", float(n), g, {"type": "compute"}, now - age)])

    def listed(g, pid, age=0):
        h.append([Sample(USAGE, float(GIB), g, {"pid": pid, "process": "p"}, now - age)])

    for g, n, pids in ((0, 2, ["1", "2"]),  # all listed
                       (1, 1, ["3", "other"]),  # some folded into "other"
                       (2, 1, []),  # one counted, none charged
                       (5, 1, [])):
        count(gpus[g], n)
        for pid in pids:
            listed(gpus[g], pid)
    count(gpus[3], 0, age=16)  # its count went stale: none known
    count(gpus[4], 0, age=15)  # still current
    listed(gpus[5], "5", age=16)  # its one listing went stale
    count(gpus[6], 1)
    listed(gpus[6], "6", age=15)
    assert LeakDetector()._unsure_gpus(h, now) == {gpus[1], gpus[2], gpus[3], gpus[5]}


def test_the_agents_own_process_and_a_black_leak_waiting_for_grey_do_not_stop_the_others_judgement():
    black = lambda i: 2 * GIB + 4 * MIB * i  # noqa: E731
    pool = lambda i: max(0, i - 20) * 4 * MIB  # noqa: E731
    h = History()
    add(h, 61, "gpuwatch.agent.gpu_process", lambda i: 1.0, {"pid": "11", "role": "cupti_sampler"}, "")
    add(h, 61, USAGE, black, {"pid": "11", "process": "gpuwatch"})  # ours: listed first
    add(h, 61, USAGE, black)  # 4242: black grows with a pool too young to judge
    add(h, 61, LIVE, lambda i: pool(i) + 100 * MIB, resource="")
    pooled(h, 61, "pytorch", pool)
    add(h, 61, USAGE, lambda i: 30 * GIB + 3 * MIB * i, OTHER)  # listed last, leaking
    assert [(f.attrs["pid"], f.attrs["color"]) for f in findings(h)] == [("4343", BLACK)]
