"""A pool that grows in steps (issue 33): XLA's BFC allocator, with preallocation off, doubles its
region each time it is full, so a process that keeps arrays alive shows NVML (and eBPF) a staircase
whose floor is flat most of the time. The daemon alone must still see the leak, grey with eBPF's
allocator or black without it, and forecast the OOM; a warm-up's fast steps that stop are no leak.

The recorded case: tests/fixtures/jax-bfc-h200-series.json, a JAX program's pool on the H200 as
tests/gpu/pools_unwind_check.py ran it (the daemon missed it there before `staircase`)."""
import bisect
import json
import os

import pytest

from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors.leak import BLACK, GREY, LeakDetector, LeakSettings, Trend, _r2, staircase

GIB, MIB = 1 << 30, 1 << 20
GPU = "GPU-9e0e504d-8ecf-de8d-4c95-f9b6e215a268"
PROC = {"pid": "1143", "process": "python3"}
T0 = 1_800_000_000.0
CONTEXT = 512 * MIB  # what the driver charges the process beyond its pool
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "jax-bfc-h200-series.json")


@pytest.fixture(scope="module")
def recorded():
    with open(FIXTURE) as f:
        return json.load(f)


def judge(pool, seconds: int, free_at_start: float, ebpf: bool, before: int = 10, settings=None):
    """Each second what the daemon samples (NVML's charge and free memory; with `ebpf`, live driver
    bytes, all of them XLA's pool), judged every 10 s as the daemon does: [(t since start, findings)]."""
    h, detector, out = History(maxlen=720), LeakDetector(settings), []
    for i in range(-before, seconds):
        t = T0 + i
        p = pool(max(i, 0))
        samples = [Sample("gpuwatch.process.gpu.memory.usage", p + CONTEXT, GPU, PROC, t),
                   Sample("hw.gpu.memory.limit", 143.8 * GIB, GPU, {}, t),
                   Sample("gpuwatch.gpu.memory.free", max(0.0, free_at_start - (p - pool(0))), GPU, {}, t),
                   Sample("gpuwatch.gpu.processes", 1.0, GPU, {}, t)]
        if ebpf:
            samples += [Sample("gpuwatch.process.cuda.memory.live", p, "", PROC, t),
                        Sample("gpuwatch.process.cuda.memory.pooled", p, "", dict(PROC, allocator="xla"), t)]
        h.append(samples)
        if i >= 0 and i % 10 == 0:
            out.append((i, list(detector.observe(h))))
    return out


def recorded_pool(rec):
    times = [t for t, _ in rec["pool"]]
    return lambda s: rec["pool"][max(0, bisect.bisect_right(times, s) - 1)][1]


@pytest.mark.parametrize("ebpf, color, allocator", [(True, GREY, "xla"), (False, BLACK, None)])
def test_the_recorded_jax_pool_is_a_leak_before_90_s_with_a_forecast_within_20_percent(recorded, ebpf, color,
                                                                                      allocator):
    oom = recorded["oom_after_s"]
    seen = [(t, f) for t, fs in judge(recorded_pool(recorded), int(oom), recorded["free_at_start_bytes"], ebpf)
            for f in fs]
    assert seen, "the staircase was not seen"
    t, f = seen[0]
    assert t <= 90 and (f.attrs["color"], f.attrs["allocator"]) == (color, allocator), (t, f.summary)
    assert f.attrs["time_to_oom_seconds"] == pytest.approx(oom - t, rel=0.2), (t, f.summary)
    assert all(f.attrs["pid"] == "1143" for _, f in seen)


def doubling(first: float, rate: float, stop: float = float("inf")):
    """A pool that doubles whenever the bytes in use (`rate` a second, up to `stop` bytes) fill it."""
    def pool(s: float) -> float:
        used, size = first + rate * s, first
        used = min(used, stop)
        while size < used:
            size *= 2
        return size
    return pool


def test_a_warm_up_that_doubles_its_pool_fast_and_stops_is_not_a_leak():
    # 256 MiB to 4 GiB in 16 s (four doublings), then the working set is reached.
    fs = judge(doubling(256 * MIB, 240 * MIB, stop=3.9 * GIB), 700, 100 * GIB, ebpf=True)
    assert [(t, f.summary) for t, found in fs for f in found] == []


def test_a_slow_doubling_leak_is_seen_and_closes_once_the_growth_stops():
    # 64 MiB a second from 128 MiB: doublings at 2, 6, 14, 30, 62 s; the leak stops at 100 s (6.4 GiB in use,
    # 8 GiB pool): with 1.6 GiB of room at 64 MiB/s, it would have stepped by 126 s, so by 130 s it is over;
    # the finding judged at 120 s is held for LeakSettings.hold (30 s) and closes at 160 s.
    pool = doubling(128 * MIB, 64 * MIB, stop=128 * MIB + 64 * MIB * 100)
    fs = dict(judge(pool, 200, 100 * GIB, ebpf=True))
    assert [f.attrs["color"] for f in fs[70]] == [GREY]
    assert fs[70][0].attrs["rate_bytes_per_second"] == pytest.approx(64 * MIB, rel=0.05)
    assert [f.ts - T0 for t in range(130, 160, 10) for f in fs[t]] == [120.0] * 3  # as last judged
    assert all(fs[t] == [] for t in range(160, 200, 10)), {t: len(f) for t, f in fs.items()}


def marks(judged) -> str:
    """A pass's finding: x judged then, h held from before, . none."""
    return "".join(("h" if f[0].ts - T0 != t else "x") if f else "." for t, f in judged)


def test_a_leak_that_pauses_for_30_s_stays_one_finding():
    # 32 MiB a second from 1 GiB, flat from 100 s to 130 s, then on. Without the hold the finding closes
    # for three passes and opens again (an alert's `for` starts over: XLA's pool between two steps, on
    # the H200); held, it stays open throughout.
    def pool(t):
        return GIB + 32 * MIB * (t if t < 100 else 100 if t < 130 else t - 30)

    assert marks(judge(pool, 220, 100 * GIB, True, settings=LeakSettings(hold=0.0))) == "....xxxxxxxxxx...xxxxx"
    assert marks(judge(pool, 220, 100 * GIB, True)) == "....xxxxxxxxxxhhhxxxxx"


def test_a_held_leak_is_let_go_at_once_when_its_memory_falls():
    def stopped(t):
        return GIB + 32 * MIB * min(t, 100)

    assert marks(judge(stopped, 200, 100 * GIB, True)) == "....xxxxxxxxxxhhh..."  # judged to 130 s, held 30 s
    # the same, giving 256 MiB back at 145 s: held at 140 s, let go at 150 s
    assert marks(judge(lambda t: stopped(t) - (256 * MIB if t >= 145 else 0), 200, 100 * GIB, True)) == \
        "....xxxxxxxxxxh....."


def test_a_staircase_needs_four_steps_over_0_4_of_the_shortest_window_and_no_fall():
    s = LeakSettings()

    def steps_of(seconds: int) -> list:  # 1 to 5 GiB, a GiB every `seconds`, the last for 5 s
        return [(T0 + t, float(v)) for t, v in enumerate([k * GIB for k in range(1, 5) for _ in range(seconds)]
                                                         + [5 * GIB] * 5)]
    stairs = steps_of(10)
    now = stairs[-1][0]
    tr = staircase(stairs, now, s)
    assert tr is not None and tr.rate == pytest.approx(GIB / 10) and tr.growth == 3 * GIB
    assert tr.slack == pytest.approx(5 * GIB - (4 * GIB + GIB / 10 * 4))  # now is 4 s past the last step
    assert staircase(stairs[:-6], stairs[-7][0], s) is None  # three steps
    assert staircase(steps_of(7), T0 + 31, s) is None  # four steps over 21 s: under 24 s (0.4 of 60 s)
    assert staircase(steps_of(8), T0 + 35, s) is not None  # over 24 s
    fell = stairs[:15] + [(T0 + 15, 1.5 * GIB)] + stairs[16:]
    assert staircase(fell, now, s) is None
    assert staircase([(T0 + t, GIB + t * 64 * MIB) for t in range(60)], T0 + 59, s) is None  # a slope, not steps


def flights(*flights: tuple[int, int], start: float = GIB, step: float = 4 * MIB) -> list:
    """Points a second apart: (levels, seconds each) per flight, each level `step` above the one before."""
    out, v, t = [], start, T0
    for levels, seconds in flights:
        for _ in range(levels):
            out += [(t + i, v) for i in range(seconds)]
            t, v = t + seconds, v + step
    return out


def test_a_staircase_trend_whole_at_each_limit():
    # Eight levels of 4 s, 4 MiB apart, then the ninth for 6 s: corners at 4, 8 ... 32 s, 1 MiB/s.
    pts = flights((8, 4), (1, 6))
    s = LeakSettings(min_rate=MIB, min_growth=28 * MIB, min_steps=8)
    now = pts[-1][0]  # 5 s past the last step: in use 1 GiB + 28 MiB + 5 MiB, the pool 1 GiB + 32 MiB
    assert staircase(pts, now, s) == Trend(rate=MIB, growth=28 * MIB, window=28.0, r2=_r2(*zip(*CORNERS)),
                                           rising=1.0, latest=GIB + 32 * MIB, slack=-MIB)
    for tighter in (dict(min_rate=MIB + 1), dict(min_growth=28 * MIB + 1), dict(min_steps=9),
                    dict(min_r2=_r2(*zip(*CORNERS)) + 1e-9)):
        assert staircase(pts, now, LeakSettings(**{**s.__dict__, **tighter})) is None, tighter
    assert staircase(pts, now, LeakSettings(**{**s.__dict__, "min_r2": _r2(*zip(*CORNERS))})) is not None
    assert staircase(pts + [(now + 1, pts[-1][1])], now + 1, s) is None  # in use 1 MiB above the pool: stopped


CORNERS = [(T0 + 4 * i, GIB + 4 * MIB * (i - 1)) for i in range(1, 9)]


def test_a_staircase_needs_a_quarter_of_its_points_flat_and_steps_over_1_mib():
    s = LeakSettings(min_rate=MIB, min_growth=28 * MIB, min_steps=8)
    quarter = flights((1, 3), (7, 4), (1, 1))  # 32 points, 8 corners: a step every fourth point
    assert staircase(quarter, quarter[-1][0], s).latest == quarter[-1][1]  # the level just stepped to
    assert staircase(quarter[1:], quarter[-1][0], s) is None  # 31 points: more than a quarter are steps
    pts = flights((8, 4), (1, 6))
    nudged = [(t, v + (MIB if t >= T0 + 2 else 0.0)) for t, v in pts]  # a rise of 1 MiB exactly: no step
    assert staircase(nudged, pts[-1][0], s) == staircase([(t, v + MIB) for t, v in pts], pts[-1][0], s)
    dipped = [(t, v - (MIB if t == T0 + 10 else 0.0)) for t, v in pts]  # a fall of 1 MiB exactly: kept
    assert staircase(dipped, pts[-1][0], s) is not None


def test_a_staircase_whose_steps_come_slower_by_half_is_a_leak_and_slower_is_not():
    pts = flights((5, 4), (4, 8), (1, 1))  # corners 4 s apart, then 8 s apart: the late slope is half
    s = LeakSettings(min_rate=0.5 * MIB, min_growth=28 * MIB, min_steps=8)
    assert staircase(pts, pts[-1][0], s) is not None
    assert staircase(pts, pts[-1][0], LeakSettings(**{**s.__dict__, "min_late_ratio": 0.51})) is None
