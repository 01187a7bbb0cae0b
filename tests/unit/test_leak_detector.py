"""The three-color leak detector on series shaped like what the probes report.

Each test builds the history the agent would hold for one GPU and one process: NVML's
device and per-process memory (black), the in-process agent's allocated/reserved (white/grey) or
eBPF's live driver bytes, one point a second, and asks the detector what it sees.
"""
import random

import pytest

from gpuwatch.agent import metrics
from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors.leak import BLACK, GREY, WHITE, LeakDetector, LeakSettings, trend

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
