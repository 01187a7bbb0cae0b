"""Three-color GPU memory leak detection, with time to out-of-memory.

Per GPU and process, three series (ARCHITECTURE.md, "Three-color memory"):

  white  bytes in live tensors          gpuwatch.process.gpu.memory.allocated (in-process agent, verified)
  grey   bytes the allocator holds      gpuwatch.process.gpu.memory.reserved  (in-process agent, verified),
                                        else gpuwatch.process.cuda.memory.pooled (eBPF: live driver
                                        allocations whose call stack runs through a pool allocator)
  black  bytes the driver charges       gpuwatch.process.gpu.memory.usage     (NVML)

eBPF's live driver allocations are all cuMemAlloc*/cuMemCreate calls, pooled or not: only the pooled
ones are grey; live minus pooled is memory outside any allocator, and when it grows with black the
finding says so (plain cuMemAlloc/cudaMalloc calls), whoever reports grey.

A color *grows* when, over a window, the floor of its series rises steadily: the window is cut
into buckets, each bucket keeps its minimum (the floor: PyTorch's allocations rise and fall with
every step, its floor does not), and the floors must rise from bucket to bucket, fit a line well,
add up to a real amount, and not slow down towards the end (warm-up growth flattens; a leak does
not). A drop — `torch.cuda.empty_cache()`, the end of an epoch — breaks the rise and clears the
window. Several windows are judged (90 s for fast leaks, 5 and 10 min for slow ones).

What grows says what leaks: white → tensors kept alive (an application leak); grey with white
flat → the allocator's pool grows (fragmentation, caching); black with grey flat → memory taken
outside the allocator (raw cudaMalloc without free, library workspaces, contexts). The forecast
divides the headroom (the GPU's free memory as NVML reports it, other processes included, plus for white the
allocator's unused reserve) by the growth rate.

Pure: observe(history) reads series and returns findings; nothing here does I/O.
"""
from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from gpuwatch.agent import own
from gpuwatch.agent.api import Detector, Finding, Sample
from gpuwatch.agent.allocators import OUTSIDE, names
from gpuwatch.agent.history import History
from gpuwatch.agent.metrics import (
    GPU_MEMORY_FREE, GPU_PROCESSES, GPU_UP, HW_GPU_MEMORY_LIMIT, HW_GPU_MEMORY_USAGE, LEAK_GROWTH_RATE, LEAK_SUSPECTED,
    LEAK_TIME_TO_OOM, PROCESS_CUDA_MEMORY_LIVE as LIVE, PROCESS_CUDA_MEMORY_POOLED as POOLED,
    PROCESS_GPU_MEMORY_ALLOCATED, PROCESS_GPU_MEMORY_ALLOCATED_SELF_REPORTED, PROCESS_GPU_MEMORY_RESERVED,
    PROCESS_GPU_MEMORY_RESERVED_SELF_REPORTED, PROCESS_GPU_MEMORY_USAGE,
)
from gpuwatch.agent.registry import DetectorEntry
from gpuwatch.agent.logs import fmt_bytes

WHITE, GREY, BLACK = "white", "grey", "black"
KIND = "memory_leak"
MIB = 1 << 20

# Per-GPU, per-process series of each color (grey's eBPF fallback is handled on its own). White and
# grey only as verified (NVML lists the process on that GPU): what an in-process agent reports for a
# GPU NVML cannot confirm goes to *.self_reported metrics, which nothing here reads.
COLOR_METRICS = {PROCESS_GPU_MEMORY_USAGE: BLACK, PROCESS_GPU_MEMORY_ALLOCATED: WHITE,
                 PROCESS_GPU_MEMORY_RESERVED: GREY}

WHAT_LEAKS = {
    WHITE: "tensors kept alive (white: allocated bytes grow)",
    GREY: "the allocator's pool (grey: reserved bytes grow while allocated bytes do not)",
    BLACK: "memory outside the allocator (black: the driver's charge grows while the allocator's does not)",
}
# What leaks, where eBPF tells who made the growing driver allocations.
POOL_LEAKS = "the allocator's pool (grey: driver allocations made by the {name} grow)"
OUTSIDE_LEAKS = "memory outside any allocator (black: plain cuMemAlloc/cudaMalloc calls outside any allocator grow)"


@dataclass(frozen=True)
class Trend:
    """A steady rise of a series' floor over a window."""

    rate: float          # bytes per second (Theil-Sen slope of the bucket floors)
    growth: float        # bytes the floor rose over the window
    window: float        # seconds the points span
    r2: float            # how well a line fits the floors (0..1)
    rising: float        # fraction of bucket-to-bucket steps that rose
    latest: float        # the newest value
    slack: float = 0.0   # a pool that grows in steps: what of it the process is not using yet


@dataclass
class LeakSettings:
    windows: Sequence[float] = (60.0, 90.0, 300.0, 600.0)
    buckets: int = 6
    min_points: int = 12
    min_growth: float = 128 * MIB   # less than this over a window is noise, whatever the rate
    min_rate: float = 256 * 1024    # bytes/s (15 MiB a minute)
    min_r2: float = 0.8
    min_rising: float = 0.75        # of the bucket-to-bucket steps
    min_late_ratio: float = 0.5     # the second half's slope over the first half's: warm-up flattens
    min_steps: int = 4              # a pool that grows in steps: its rises seen before a line is fitted
    step_epsilon: float = 1 * MIB   # a floor must rise by more than this to count as rising
    critical_seconds: float = 900.0 # time to OOM under this is critical
    lookback: float = 600.0         # a drop this recent, as large as half the rise, means a sawtooth
    stale: float = 15.0             # a process not reported for this long has gone: no finding
    recent: float = 30.0            # seconds: the floor must still be rising over the last of these
    # A leak found stays open through passes that miss it, this long after it was last judged, while
    # its process runs and its memory has not fallen: XLA's pool, between two of its steps, missed
    # one pass on the H200 (the finding closed and opened 10 s later: an alert's `for` starts over).
    hold: float = 30.0


def _theil_sen(xs: Sequence[float], ys: Sequence[float]) -> float:
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    return statistics.median(slopes) if slopes else 0.0


def _halves(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """The slopes of the first and the second half (sharing the middle point): warm-up flattens."""
    half = len(xs) // 2
    return _theil_sen(xs[:half + 1], ys[:half + 1]), _theil_sen(xs[half:], ys[half:])


def _r2(xs: Sequence[float], ys: Sequence[float]) -> float:
    if len(xs) < 3:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return 0.0
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return sxy * sxy / (sxx * syy)


def still_rising(points: Sequence[tuple[float, float]], s: LeakSettings) -> bool:
    """Is the floor of the last `recent` seconds above that of the `recent` seconds before? Bucket
    floors lag by a bucket (100 s in a 10-minute window): this closes a finding soon after the growth
    stops, and, checked first on the newest points only, turns most series away cheaply."""
    if not points:
        return False
    t1 = points[-1][0]
    last = before = None
    for t, v in reversed(points):
        if t > t1 - s.recent:
            last = v if last is None else min(last, v)
        elif t > t1 - 2 * s.recent:
            before = v if before is None else min(before, v)
        else:
            break
    return last is not None and before is not None and last - before > s.step_epsilon


def trend(points: Sequence[tuple[float, float]], window: float, now: float,
          s: LeakSettings = LeakSettings(), times: Sequence[float] | None = None) -> Trend | None:
    """The rise of the series' floor over [now - window, now], or None when it does not rise steadily."""
    times = times if times is not None else [t for t, _ in points]
    pts = points[bisect.bisect_left(times, now - window):bisect.bisect_right(times, now)]
    if len(pts) < s.min_points:
        return None
    t0, t1 = pts[0][0], pts[-1][0]
    span = t1 - t0
    if span < 0.8 * window:  # the series is younger than the window: a shorter window judges it
        return None
    width = span / s.buckets
    lows: dict[int, float] = {}
    for t, v in pts:
        b = min(s.buckets - 1, int((t - t0) / width))
        if b not in lows or v < lows[b]:
            lows[b] = v
    if len(lows) < s.buckets - 1:
        return None
    xs = [t0 + (b + 0.5) * width for b in sorted(lows)]
    ys = [lows[b] for b in sorted(lows)]
    steps = [b - a for a, b in zip(ys, ys[1:])]
    rising = sum(1 for d in steps if d > s.step_epsilon) / len(steps)
    if any(d < -s.step_epsilon for d in steps):
        return None  # memory was given back in the window: not a leak (empty_cache, a phase ending)
    rate = _theil_sen(xs, ys)
    growth = ys[-1] - ys[0]
    early, late = _halves(xs, ys)
    r2 = _r2(xs, ys)
    if (rate < s.min_rate or growth < s.min_growth or rising < s.min_rising or r2 < s.min_r2
            or early <= 0 or late < s.min_late_ratio * early or not still_rising(pts, s)):
        return None
    # The recent slope when it is the steeper: a leak that began inside the window grows at that rate now.
    return Trend(rate=max(rate, late), growth=growth, window=span, r2=r2, rising=rising, latest=pts[-1][1])


SAW_BUCKET = 15.0  # seconds: longer than a training step, so a step's own rise and fall is inside one


def sawtooth(points: Sequence[tuple[float, float]], now: float, rise: float, s: LeakSettings) -> bool:
    """Did the series' floor give back at least half of `rise` within the lookback? Then its rise is
    one tooth of a saw (a cache emptied now and then, epochs), not a leak. Floors of 15 s buckets,
    so the fall at the end of every training step does not count."""
    floors: dict[int, float] = {}
    for t, v in points:
        if now - s.lookback <= t <= now:
            b = int((t - now + s.lookback) // SAW_BUCKET)
            floors[b] = min(v, floors.get(b, v))
    seq = [floors[b] for b in sorted(floors)]
    return any(a - b >= 0.5 * rise for a, b in zip(seq, seq[1:]))


def gave_back(points: Sequence[tuple[float, float]], amount: float, s: LeakSettings) -> bool:
    """Did the series fall by at least half of `amount` within its last 2 x `recent` seconds?"""
    if not points:
        return False
    t1, latest = points[-1]
    peak = latest
    for t, v in reversed(points):
        if t <= t1 - 2 * s.recent:
            break
        peak = max(peak, v)
    return peak - latest >= 0.5 * amount


def rise(points: Sequence[tuple[float, float]], tr: Trend, now: float, s: LeakSettings) -> float:
    """How much the series' floor rose over the trend's window, as the trend measures its growth: the
    last bucket's floor less the first's (a series younger than the window: from its start)."""
    pts = points[bisect.bisect_left([t for t, _ in points], now - tr.window):]
    if not pts:
        return 0.0
    width = tr.window / s.buckets
    t0, t1 = pts[0][0], pts[-1][0]
    return min(v for t, v in pts if t >= t1 - width) - min(v for t, v in pts if t <= t0 + width)


def staircase(points: Sequence[tuple[float, float]], now: float, s: LeakSettings,
              times: Sequence[float] | None = None) -> Trend | None:
    """The rise of a pool that grows in steps (XLA's BFC allocator doubles its region when it is full),
    or None. Between steps the series is flat, so bucket floors do not rise steadily and `trend` sees
    nothing. But just before each step the pool was full: those corners (the step's time, the level
    before it) trace what the process uses. They must rise on a line, over 0.4 of the shortest window;
    and the pool must still have room for that line now, else the growth has stopped (a warm-up's
    steps come fast, then none)."""
    times = times if times is not None else [t for t, _ in points]
    pts = points[bisect.bisect_left(times, now - max(s.windows)):]
    corners = []
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if v1 < v0 - s.step_epsilon:
            return None  # memory was given back: not a leak
        if v1 - v0 > s.step_epsilon:
            corners.append((t1, v0))
    # Steps, not a slope: most samples flat (a series rising at every sample is `trend`'s to judge).
    if (len(corners) < s.min_steps or 4 * len(corners) > len(pts)
            or corners[-1][0] - corners[0][0] < 0.4 * min(s.windows)):
        return None
    xs, ys = [t for t, _ in corners], [v for _, v in corners]
    rate, growth, r2 = _theil_sen(xs, ys), ys[-1] - ys[0], _r2(xs, ys)
    early, late = _halves(xs, ys)
    # Corners rise by construction, so both halves' slopes are above 0.
    if rate < s.min_rate or growth < s.min_growth or r2 < s.min_r2 or late < s.min_late_ratio * early:
        return None
    using = ys[-1] + rate * (now - xs[-1])  # what the process uses now, were it still growing so
    latest = pts[-1][1]
    if using > latest + s.step_epsilon:
        return None  # the pool would have stepped again by now: the growth stopped
    return Trend(rate=rate, growth=growth, window=xs[-1] - xs[0], r2=r2, rising=1.0, latest=latest,
                 slack=latest - using)


def best_trend(points: Sequence[tuple[float, float]], now: float, s: LeakSettings) -> Trend | None:
    """The longest window that shows a steady rise (longer windows estimate the rate better),
    unless the series is a sawtooth; else a pool's steady rise in steps."""
    times = [t for t, _ in points]
    if still_rising(points, s):
        for w in sorted(s.windows, reverse=True):
            tr = trend(points, w, now, s, times)
            if tr is not None:
                return None if sawtooth(points, now, tr.growth, s) else tr
    return staircase(points, now, s, times)


@dataclass
class _Process:
    gpu: str
    pid: str
    process: str
    colors: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    grey_from_ebpf: bool = False
    pooled: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # eBPF, by allocator
    outside: list[tuple[float, float]] = field(default_factory=list)  # eBPF: live minus pooled


def fmt_duration(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 90:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


class LeakDetector(Detector):
    """Three-color leak findings per GPU and process (see the module docstring)."""

    name = "leak"
    kinds = (KIND,)
    needs = ("nvml",)
    interval = 10.0  # seconds between judgements: trends over minutes need no faster look

    def __init__(self, settings: LeakSettings | None = None, allocators: Mapping[str, str] | None = None) -> None:
        """allocators: the pool allocators' names for people by label (config.pool_table, with
        ebpf.pool_libraries); by default the known ones."""
        self.settings = settings or LeakSettings()
        self._held: dict[tuple[str, str], tuple[Finding, float]] = {}  # (gpu, pid) -> its last finding, level
        self.allocators = dict(names() if allocators is None else allocators)

    def _unsure_gpus(self, history: History, now: float) -> set[str]:
        """GPUs where NVML may not list every process (as reports.nvml_view judges it): it gives no
        process count, folds some into "other", or counts more than it charges (a process listed
        with no memory figure). A process seen on one GPU may be on one of these too."""
        s = self.settings
        gpus = {ser.gpu for metric in (HW_GPU_MEMORY_LIMIT, GPU_UP)
                for ser in history.select(metric, since=now - s.stale) if ser.gpu}
        counted: dict[str, float] = {}
        for ser in history.select(GPU_PROCESSES, since=now - s.stale):
            if ser and now - ser.latest_ts <= s.stale:
                counted[ser.gpu] = counted.get(ser.gpu, 0.0) + ser.latest
        listed: dict[str, int] = {}
        folded: set[str] = set()
        for ser in history.select(PROCESS_GPU_MEMORY_USAGE, since=now - s.stale):
            if ser and now - ser.latest_ts <= s.stale:
                if ser.labels.get("pid", "").isdigit():
                    listed[ser.gpu] = listed.get(ser.gpu, 0) + 1
                else:
                    folded.add(ser.gpu)
        return {g for g in gpus if g not in counted or g in folded or listed.get(g, 0) < counted[g]}

    def _processes(self, history: History, now: float) -> list[_Process]:
        procs: dict[tuple[str, str], _Process] = {}
        for metric, color in COLOR_METRICS.items():
            for ser in history.select(metric):
                gpu, pid = ser.gpu, ser.labels.get("pid", "")
                if not gpu or not pid or pid == "other":
                    continue
                p = procs.setdefault((gpu, pid), _Process(gpu, pid, ser.labels.get("process", "")))
                p.colors[color] = ser.points
        # eBPF: grey from its pooled driver allocations when no in-process agent reports it, and what
        # lies outside any allocator. eBPF counts a process on all its GPUs together, so only for a
        # process known to be on one GPU: none of its bytes may be another GPU's. Pooled points come
        # with the live point of their collection (same ts).
        gpus_of: dict[str, list[_Process]] = {}
        for p in procs.values():
            gpus_of.setdefault(p.pid, []).append(p)
        unsure = self._unsure_gpus(history, now)
        # An in-process agent's word NVML cannot vouch for still says the process is on that GPU.
        claimed: dict[str, set[str]] = {}
        for metric in (PROCESS_GPU_MEMORY_ALLOCATED_SELF_REPORTED, PROCESS_GPU_MEMORY_RESERVED_SELF_REPORTED):
            for ser in history.select(metric, since=now - self.settings.stale):
                if ser and now - ser.latest_ts <= self.settings.stale:
                    claimed.setdefault(ser.labels.get("pid", ""), set()).add(ser.gpu)
        pooled_of: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for ser in history.select(POOLED):
            pooled_of.setdefault(ser.labels.get("pid", ""), {})[ser.labels.get("allocator", "")] = ser.points
        for ser in history.select(LIVE):
            pid, points = ser.labels.get("pid", ""), ser.points
            on = gpus_of.get(pid, [])
            if len(on) != 1 or (unsure - {on[0].gpu}) or (claimed.get(pid, set()) - {on[0].gpu}):
                continue
            p = on[0]
            p.pooled = pooled_of.get(pid, {})
            at: dict[float, float] = {}
            for pts in p.pooled.values():
                for t, v in pts:
                    at[t] = at.get(t, 0.0) + v
            p.outside = [(t, v - at.get(t, 0.0)) for t, v in points]
            if GREY not in p.colors:
                p.colors[GREY] = [(t, at.get(t, 0.0)) for t, _ in points]
                p.grey_from_ebpf = True
        return list(procs.values())

    @staticmethod
    def _growing_allocator(p: _Process, tr: Trend) -> str | None:
        """The allocator whose pooled bytes rose the most over the trend's window."""
        best, rise = None, 0.0
        for name, pts in p.pooled.items():
            if not pts:
                continue
            since = pts[-1][0] - tr.window
            first = next((v for t, v in pts if t >= since), pts[-1][1])
            if pts[-1][1] - first > rise:
                best, rise = name, pts[-1][1] - first
        return best

    def observe(self, history: History) -> Iterable[Finding]:
        s = self.settings
        now = history.newest(*COLOR_METRICS)
        if now is None:
            return []
        limits = {ser.gpu: ser.latest for ser in history.select(HW_GPU_MEMORY_LIMIT)}
        used = {ser.gpu: ser.latest for ser in history.select(HW_GPU_MEMORY_USAGE)}
        # NVML's free memory when reported: limit - used overstates it by what the driver reserves
        # for itself (645 MB on the H200), an error that grows as the OOM comes closer.
        frees = {ser.gpu: ser.latest for ser in history.select(GPU_MEMORY_FREE)}
        findings = []
        # The agent's own processes (its CUPTI sampler: a context and nothing else) are nobody's leak.
        ours = own.pids_in(history, now, s.stale)
        running: dict[tuple[str, str], _Process] = {}
        for p in self._processes(history, now):
            if p.pid in ours:
                continue
            newest = max((pts[-1][0] for pts in p.colors.values() if pts), default=0.0)
            if now - newest > s.stale:
                continue  # the process exited (or its GPU went away): its last trend is history
            running[(p.gpu, p.pid)] = p
            trends = {c: best_trend(p.colors[c], now, s) for c in (WHITE, GREY, BLACK) if c in p.colors}
            color = next((c for c in (WHITE, GREY, BLACK) if trends.get(c) is not None), None)
            if color is None:
                continue
            tr = trends[color]
            if color == BLACK and GREY in p.colors and gave_back(p.colors[GREY], tr.growth, s):
                # The allocator just emptied its pool (out of memory, empty_cache): the driver's charge
                # lags behind by a sample, and a grey leak must not end as a black one.
                continue
            if (color == BLACK and GREY in p.colors and still_rising(p.colors[GREY], s)
                    and rise(p.colors[GREY], tr, now, s) >= 0.5 * tr.growth):
                # Black is what lies beyond grey: a pool growing as fast, too young for a trend of its
                # own, is judged once its window fills, as grey.
                continue
            free = frees.get(p.gpu)
            if free is None and limits.get(p.gpu) is not None and used.get(p.gpu) is not None:
                free = max(0.0, limits[p.gpu] - used[p.gpu])
            headroom = free if free is None else free + tr.slack  # a pool's unused step is room too
            if color == WHITE and free is not None and GREY in p.colors and p.colors[GREY]:
                headroom = free + max(0.0, p.colors[GREY][-1][1] - tr.latest)  # the pool's unused part first
            tto = headroom / tr.rate if headroom is not None else None
            confidence = round(min(1.0, tr.r2) * tr.rising * min(1.0, tr.window / 300.0) ** 0.5, 2)
            grey_source = "ebpf" if p.grey_from_ebpf else ("agent" if GREY in p.colors else "none")
            severity = "critical" if tto is not None and tto < s.critical_seconds else "warning"
            what, allocator = WHAT_LEAKS[color], None
            if color == GREY and p.grey_from_ebpf:
                allocator = self._growing_allocator(p, tr)
                what = POOL_LEAKS.format(name=self.allocators.get(allocator or "", allocator or "a pool allocator"))
            elif color == BLACK and p.outside and rise(p.outside, tr, now, s) >= 0.5 * tr.growth:
                what, allocator = OUTSIDE_LEAKS, OUTSIDE  # eBPF saw most of the growth outside any pool
            summary = (f"process {p.pid} ({p.process}) on GPU {p.gpu} is leaking "
                       f"{fmt_bytes(tr.rate * 60)}/min: {what}")
            if tto is not None:
                summary += f"; out of memory in {fmt_duration(tto)} at this rate ({fmt_bytes(headroom)} left)"
            if color == BLACK and GREY not in p.colors:
                summary += " (no in-process agent or eBPF: which part of the process grows is unknown)"
            findings.append(Finding(KIND, p.gpu, severity, summary, {
                "pid": p.pid, "process": p.process, "color": color, "rate_bytes_per_second": tr.rate,
                "growth_bytes": tr.growth, "window_seconds": tr.window, "time_to_oom_seconds": tto,
                "headroom_bytes": headroom, "confidence": confidence, "grey_source": grey_source,
                "allocator": allocator,
                "colors": {c: (None if t is None else round(t.rate, 1)) for c, t in trends.items()},
            }, ts=now))
            self._held[(p.gpu, p.pid)] = (findings[-1], tr.latest)
        return findings + self._still_held(findings, running, now)

    def _still_held(self, found: list[Finding], running: dict[tuple[str, str], _Process],
                    now: float) -> list[Finding]:
        """The leaks found before and missed at this pass that stay open (see LeakSettings.hold), as
        last judged; the others are let go."""
        out = []
        for key in list(self._held):
            f, level = self._held[key]
            if f in found:
                continue
            pts = running[key].colors.get(f.attrs["color"]) if key in running else None
            if pts and now - f.ts <= self.settings.hold and pts[-1][1] >= level:
                out.append(f)
            else:
                del self._held[key]
        return out

    @staticmethod
    def samples(findings: Sequence[Finding]) -> list[Sample]:
        """The findings as metrics, for alert rules."""
        out = []
        for f in findings:
            if f.kind != KIND:
                continue
            labels = {"pid": f.attrs["pid"], "process": f.attrs["process"], "color": f.attrs["color"]}
            out.append(Sample(LEAK_SUSPECTED, 1.0, f.resource, labels, f.ts))
            out.append(Sample(LEAK_GROWTH_RATE, f.attrs["rate_bytes_per_second"], f.resource, labels, f.ts))
            if f.attrs["time_to_oom_seconds"] is not None:
                out.append(Sample(LEAK_TIME_TO_OOM, f.attrs["time_to_oom_seconds"], f.resource, labels, f.ts))
        return out


DETECTOR = DetectorEntry(LeakDetector.name, "", LeakDetector.kinds, 10,
                         lambda ctx: LeakDetector(allocators=ctx.allocators))
