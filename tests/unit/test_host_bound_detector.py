"""The host_bound detector on series shaped like what the NVML, eBPF and host probes report: one
point every 10 s for 6 minutes, the last minute judged against the five before it. The cause
starts at AT (300 s) in each; a healthy job, a job whose files are evicted while its GPU stays
busy and a process with no host series have no finding."""
import pytest

from gpuwatch.agent import metrics
from gpuwatch.agent.history import History, Series
from gpuwatch.agent.api import Sample
from gpuwatch.detectors.host_bound import MIB, HostBoundDetector, _count

GIB = 1 << 30
GPU = "GPU-c002ef2a-2a3c-e0e9-4d8a-a58bfd6b0084"
PID, NAME = "4242", "python3"
PROC = {"pid": PID, "process": NAME}
T0 = 1_800_000_000.0
AT = 300  # seconds: when the cause begins
MODEL = "/models/x.safetensors"


def after(before, then):
    return lambda t: then if t >= AT else before


def build(util=None, calls=None, resident=None, major=None, readers=None, thread=None, throttled=None,
          periods=None, swap=None, stall=None, reads=None, seconds=360, start=0, step=10, memory=True,
          proc=PROC, file_size=6.0 * GIB) -> History:
    """Each argument a function of t (seconds since start); counters are given as their running value."""
    PROC = proc  # noqa: N806
    h = History()
    for t in range(start, seconds + 1, step):
        ts = T0 + t
        s = [Sample("gpuwatch.process.gpu.memory.usage", 20.0 * GIB, GPU, PROC, ts)] if memory else []
        if util:
            s.append(Sample("gpuwatch.process.gpu.utilization", util(t), GPU, PROC, ts))
        if calls:
            for api, share in (("cuLaunchKernel", 0.9), ("cuMemcpyAsync", 0.1)):
                s.append(Sample("gpuwatch.cuda.calls", calls(t) * share, "", dict(PROC, api=api), ts))
        if resident:
            f = dict(PROC, file=MODEL)
            s += [Sample("gpuwatch.process.file.size", file_size, "", f, ts),
                  Sample("gpuwatch.process.file.cache.resident", resident(t) * file_size, "", f, ts)]
        if major:
            s += [Sample("gpuwatch.process.paging.faults", major(t), "", dict(PROC, type="major"), ts),
                  Sample("gpuwatch.process.paging.faults", 1e6 + t * 1000, "", dict(PROC, type="minor"), ts)]
        if reads:
            s.append(Sample("gpuwatch.process.disk.io", reads(t), "", dict(PROC, direction="read"), ts))
        if readers:
            for pid, name, fn in readers:
                s.append(Sample("gpuwatch.node.process.disk.read.rate", fn(t), "", {"pid": pid, "process": name}, ts))
        if thread:
            s.append(Sample("gpuwatch.process.thread.cpu.utilization", thread(t), "",
                            dict(PROC, tid="4250", thread="pt_main_thread"), ts))
            s.append(Sample("gpuwatch.process.thread.cpu.utilization", 0.1, "", dict(PROC, tid="4251", thread="pin"),
                            ts))
        for metric, fn, labels in (("gpuwatch.process.cgroup.cpu.throttled.time", throttled, {}),
                                   ("gpuwatch.process.cgroup.cpu.throttled.periods", periods, {}),
                                   ("gpuwatch.process.memory.swap", swap, {})):
            if fn:
                s.append(Sample(metric, fn(t), "", dict(PROC, **labels), ts))
        if stall:
            for res, fn in stall.items():
                s.append(Sample("gpuwatch.process.cgroup.pressure.stall.time", fn(t), "",
                                dict(PROC, resource=res, scope="some"), ts))
        h.append(s)
    return h


def add(h, metric, fn, labels, times=range(0, 361, 10), resource=""):
    """Another series: fn(t) at each of `times`."""
    for t in times:
        h.append([Sample(metric, fn(t), resource, labels, T0 + t)])
    return h


def ramp(rate_before, rate_after, start=0.0):
    """A counter rising at rate_before per second, then rate_after from AT on."""
    return lambda t: start + rate_before * min(t, AT) + rate_after * max(0, t - AT)


def one(history):
    findings = list(HostBoundDetector().observe(history))
    assert len(findings) == 1, [f.summary for f in findings]
    f = findings[0]
    (s,) = HostBoundDetector.samples([f])
    newest = max(pts[-1][0] for m in ("gpuwatch.process.gpu.utilization", "gpuwatch.cuda.calls")
                 for _, pts in history.series(m))
    assert s.ts == f.ts == newest and f.attrs["id"] == f.attrs["cause"]
    assert (f.attrs["window_seconds"], f.attrs["baseline_seconds"]) == (30.0, 300.0)
    assert metrics.get(s.metric).labels == ("gpu", "pid", "process", "cause")
    assert (s.value, s.resource, dict(s.labels)) == (1.0, GPU, {"pid": PID, "process": NAME, "cause": f.attrs["cause"]})
    assert (f.kind, f.resource, f.severity, f.attrs["pid"], f.attrs["process"]) == ("host_bound", GPU, "warning", PID,
                                                                                   NAME)
    return f


def none(history):
    assert [f.summary for f in HostBoundDetector().observe(history)] == []


BUSY = lambda t: 0.95 if t % 20 else 0.9  # noqa: E731
EVICTED = dict(resident=after(1.0, 0.04), major=ramp(2.0, 9000.0),
               readers=[("812", "logrotate", after(20e6, 100e6)), (PID, NAME, after(0.0, 400e6))])


# --- each cause ------------------------------------------------------------------------------

def test_page_cache_eviction_names_the_file_the_faults_and_the_evictor():
    f = one(build(util=after(0.92, 0.31), **EVICTED))
    assert f.attrs["cause"] == "page_cache_eviction"
    n = f.attrs["numbers"]
    assert (n["file"], n["resident_before"], n["resident_now"]) == (MODEL, 1.0, pytest.approx(0.04))
    assert n["major_faults_per_second"] == pytest.approx(9000.0)
    # logrotate read 100 MB/s for the 3 points of the last 30 s; the process's own reads are not the evictor's
    assert n["evictor"] == {"pid": "812", "process": "logrotate", "read_bytes": 3e9}
    assert (n["file_bytes"], n["lost_bytes"]) == (6.0 * GIB, pytest.approx(0.96 * 6 * GIB))
    assert (n["gpu_work_before"], n["gpu_work_now"]) == (0.92, 0.31)
    assert f.summary == (
        f"page cache eviction of {MODEL}: 100 % -> 4 % resident, 9.0k major faults/s; logrotate (pid 812) read "
        f"2.8 GiB in the last 30 s; GPU utilisation of python3 (pid 4242) fell 92 % -> 31 % on GPU {GPU}: put the "
        "models on their own disk or in tmpfs, or lock them in memory (vmtouch -l, mlock)")
    assert f.attrs["advice"].startswith("put the models on their own disk")


def test_a_sequential_reader_of_an_mmapped_file_is_named_by_its_disk_reads():
    """The H200 serving loop: readahead brings most pages in, so 2 major faults/s, but it reads
    ~700 MB/s from disk again; its residency, sampled between the evictor's drops and its own
    refills, was 100 % before and dipped to 12 % once in the window."""
    dips = lambda t: 1.0 if t < AT else (0.12 if t == AT + 40 else 0.7)  # noqa: E731
    f = one(build(util=after(0.55, 0.11), resident=dips, major=ramp(0.0, 2.0), reads=ramp(0.0, 700e6),
                  readers=EVICTED["readers"]))
    n = f.attrs["numbers"]
    assert f.attrs["cause"] == "page_cache_eviction" and n["resident_now"] == pytest.approx(0.12)
    assert n["disk_read_bytes_per_second"] == pytest.approx(700e6)
    assert "resident, reading 667.6 MiB/s from storage, 2 major faults/s; logrotate (pid 812)" in f.summary
    # the same dip with no reads and no faults: its data is not read again, no eviction to name
    none(build(util=after(0.55, 0.11), resident=dips, major=ramp(0.0, 2.0), reads=ramp(1e6, 1e6)))


def test_an_eviction_is_named_20_s_in_though_the_baseline_holds_the_servers_warm_up_read():
    """The H200 run: the agent started 70 s before the evictor, the server had read its 8 GiB of
    weights in at its start, inside the baseline; the eviction read 600 MiB/s from storage again.
    Judged 20 s in, when two of the three utilisation points have fallen."""
    warm = lambda t: 8 * GIB * min(max(t - 230, 0), 10) / 10 + 600 * 2**20 * max(0, t - AT)  # noqa: E731
    f = one(build(util=after(0.6, 0.12), resident=after(1.0, 0.03), major=ramp(0.0, 0.0), reads=warm,
                  readers=EVICTED["readers"], start=220, seconds=AT + 20))
    assert f.attrs["cause"] == "page_cache_eviction"
    assert f.attrs["numbers"]["disk_read_bytes_per_second"] == pytest.approx(400 * 2**20)  # 0, 600, 600 MiB/s
    # A process that always reads this much is not read back by an eviction: no finding.
    steady = lambda t: 600 * 2**20 * t  # noqa: E731
    none(build(util=after(0.6, 0.12), resident=after(1.0, 0.03), major=ramp(0.0, 0.0), reads=steady,
               readers=EVICTED["readers"], start=220, seconds=AT + 20))


def test_eviction_needs_the_major_faults_to_rise_too():
    none(build(util=after(0.92, 0.31), resident=after(1.0, 0.04), major=ramp(9000.0, 9000.0)))
    none(build(util=after(0.92, 0.31), resident=after(1.0, 0.04)))  # no fault counter: no finding


def test_a_saturated_thread_after_a_fall_is_input_thread():
    f = one(build(util=after(0.9, 0.4), thread=after(0.5, 0.99)))
    assert f.attrs["cause"] == "input_thread"
    assert f.attrs["numbers"]["tid"] == "4250" and f.attrs["numbers"]["thread_cpu"] == pytest.approx(0.99)
    assert "thread pt_main_thread (tid 4250) keeps 99 % of a core busy" in f.summary
    assert "more data-loader workers, pinned memory and prefetching" in f.summary


def test_an_input_bound_loop_is_found_without_a_fall_and_a_busy_gpu_with_a_busy_thread_is_healthy():
    # The H200 input-bound loop: GPU at 8 %, its loader thread at 98 %.
    f = one(build(util=lambda t: 0.08 + (0.04 if t % 20 else 0.0), thread=lambda t: 0.98))
    assert f.attrs["cause"] == "input_thread" and "GPU utilisation of python3 (pid 4242) stays at 8 %" in f.summary  # the median of 8, 12 and 8 %
    none(build(util=BUSY, thread=lambda t: 1.0))  # the healthy job: its main thread is busy feeding a busy GPU
    # The H200 serving loop copying pageable weights beside a training job: 35-40 %, its one thread at
    # 100 % (the CUDA driver's copies and synchronisations spin): the GPU does not idle, no finding.
    none(build(util=lambda t: 0.35 + (0.05 if t % 20 else 0.0), thread=lambda t: 1.0))
    none(build(util=lambda t: 0.0, thread=lambda t: 1.0))  # no kernels at all: nothing it waits for on the GPU
    none(build(util=lambda t: 0.35, thread=lambda t: 0.5))  # low, but no thread saturated: not this cause


def test_cpu_quota_throttling_by_time_or_by_periods():
    f = one(build(util=after(0.9, 0.3), throttled=ramp(0.0, 0.4, start=12.0)))
    assert f.attrs["cause"] == "cpu_throttled"
    assert f.attrs["numbers"]["throttled_seconds_per_second"] == pytest.approx(0.4)
    assert "0.40 s/s throttled" in f.summary and "raise the cgroup's CPU limit" in f.summary
    f = one(build(util=after(0.9, 0.3), periods=ramp(0.1, 8.0)))
    assert f.attrs["cause"] == "cpu_throttled" and "8 throttled periods/s" in f.summary
    none(build(util=after(0.9, 0.3), throttled=ramp(0.01, 0.01), periods=ramp(0.1, 0.1)))


def test_swapping_and_pressure_stalls():
    f = one(build(util=after(0.9, 0.2), swap=lambda t: 1.0 * GIB + max(0, t - AT) * 50e6, major=ramp(0.0, 800.0)))
    assert f.attrs["cause"] == "swapping" and f.attrs["numbers"]["swap_growth_bytes"] == pytest.approx(1.5e9)
    f = one(build(util=after(0.9, 0.2), stall={"memory": ramp(0.0, 0.3), "io": ramp(0.0, 0.02)}))
    assert f.attrs["cause"] == "memory_pressure" and "memory pressure: its cgroup stalls 0.30 s/s" in f.summary
    f = one(build(util=after(0.9, 0.2), stall={"io": ramp(0.0, 0.5)}))
    assert f.attrs["cause"] == "io_pressure" and set(f.attrs["causes"]) == {"io_pressure"}


def test_an_eviction_with_io_pressure_is_named_as_the_eviction_and_lists_the_other():
    f = one(build(util=after(0.92, 0.31), stall={"io": ramp(0.0, 0.6)}, **EVICTED))
    assert f.attrs["cause"] == "page_cache_eviction" and list(f.attrs["causes"]) == ["page_cache_eviction",
                                                                                      "io_pressure"]
    assert "(also io_pressure)" in f.summary


def test_the_cuda_call_rate_stands_in_for_utilisation():
    f = one(build(calls=ramp(12000.0, 3000.0), **EVICTED))
    assert f.attrs["numbers"]["gpu_work_signal"] == "cuda_calls"
    assert "CUDA calls of python3 (pid 4242) fell 11k/s -> 3.0k/s" in f.summary  # the baseline ends 30 s after the fall began
    none(build(calls=ramp(12000.0, 12000.0), **EVICTED))


# --- no finding ---------------------------------------------------------------------------------

def test_a_healthy_job_has_no_finding():
    none(build(util=BUSY, thread=lambda t: 0.97, resident=lambda t: 1.0, major=ramp(1.0, 1.0),
               throttled=ramp(0.0, 0.0), periods=ramp(0.0, 0.0), stall={"io": ramp(0.0, 0.0)},
               readers=[("812", "logrotate", lambda t: 1e6)]))


def test_files_evicted_while_the_gpu_stays_busy_is_no_finding():
    none(build(util=BUSY, thread=lambda t: 1.0, **EVICTED))
    # ... nor while it fell only a little (0.92 -> 0.85: not under 0.6 x its baseline)
    none(build(util=after(0.92, 0.85), **EVICTED))


def test_a_fall_with_no_host_series_is_no_finding_and_a_young_series_is_not_judged():
    none(build(util=after(0.92, 0.1)))
    none(build(util=lambda t: 0.2, thread=lambda t: 1.0, seconds=50))  # under a minute of baseline


def test_a_process_that_stopped_reporting_has_no_finding():
    h = build(util=after(0.92, 0.31), **EVICTED)
    h.append([Sample("gpuwatch.process.gpu.utilization", 0.9, "GPU-other", {"pid": "7", "process": "x"}, T0 + 400)])
    assert [f.attrs["pid"] for f in HostBoundDetector().observe(h)] == []


# --- counters -------------------------------------------------------------------------------------

def counter_rate(points, t0, t1):  # the rates live on History's series (agent/history.py)
    return Series(list(points)).rate(t0, t1)


def typical_rate(points, t0, t1):
    return Series(list(points)).typical_rate(t0, t1)


def test_counter_rate_skips_a_reset_and_its_interval():
    pts = [(0.0, 100.0), (10.0, 200.0), (20.0, 5.0), (30.0, 105.0), (40.0, 205.0)]
    assert counter_rate(pts, -1.0, 40.0) == pytest.approx(10.0)  # 300 over the 30 s of rising intervals
    assert counter_rate(pts, 15.0, 20.0) is None
    # a restarted process's throttled time (the counter begins again at 0) is no burst of throttling
    thr = lambda t: (0.01 * t) if t < 330 else 0.01 * (t - 330)  # noqa: E731
    none(build(util=after(0.9, 0.3), throttled=thr))
    f = one(build(util=after(0.9, 0.3), throttled=lambda t: ramp(0.0, 0.5)(t) if t < 330 else 0.5 * (t - 330)))
    assert f.attrs["numbers"]["throttled_seconds_per_second"] == pytest.approx(0.5)


def test_count_and_the_rates_at_their_boundaries():
    assert [_count(x) for x in (999, 1000, 1951, 9_999, 10_000, 19_510)] == ["999", "1.0k", "2.0k", "10.0k", "10k",
                                                                             "20k"]
    assert counter_rate([(0.0, 0.0), (0.5, 5.0)], -1.0, 1.0) == 10.0  # an interval under a second still counts
    same = [(0.0, 0.0), (10.0, 100.0), (10.0, 150.0), (20.0, 250.0)]  # a repeated time is no interval
    assert counter_rate(same, -1.0, 20.0) == 10.0 and typical_rate(same, -1.0, 20.0) == 10.0
    # the usual rate: the median of the intervals ending in (t0, t1], per interval, a reset skipped
    pts = [(0.0, 0.0), (10.0, 100.0), (20.0, 300.0), (30.0, 600.0), (40.0, 5.0), (50.0, 305.0)]
    assert typical_rate(pts, 10.0, 30.0) == 25.0
    assert typical_rate(pts, 0.0, 50.0) == 25.0  # of 10, 20, 30 and 30: not the reset
    bursts = [(0.0, 0.0), (10.0, 0.0), (20.0, 300.0), (30.0, 300.0), (40.0, 300.0), (50.0, 600.0)]
    assert typical_rate(bursts, -1.0, 50.0) == 0.0  # a reader of a chunk now and then: its usual rate is none
    assert typical_rate([(0.0, 0.0)], -1.0, 10.0) is None


def test_the_baseline_is_all_300_s_before_the_window():
    """A job that halved its pace midway through the baseline: judged against the median of all of it."""
    slowed = lambda t: 0.9 if t <= 180 else 0.2 if t <= 330 else 0.1  # noqa: E731
    assert one(build(util=slowed, thread=lambda t: 1.0)).attrs["numbers"]["gpu_work_before"] == pytest.approx(0.55)
    # its reads: 100 MiB/s then none, a usual 50 MiB/s; 150 MiB/s now is under 4x that
    reads = lambda t: 100 * MIB * min(t, 180) + 150 * MIB * max(0, t - 330)  # noqa: E731
    none(build(util=after(0.92, 0.31), resident=after(1.0, 0.04), reads=reads))


# --- each threshold at its boundary -----------------------------------------------------------------

def at330(before, then):
    """A counter rising at `before` per second, `then` from 330 s on: the baseline all `before`."""
    return lambda t: before * min(t, 330) + then * max(0, t - 330)


def tenths(t):
    """A counter at 0.1/s from AT on, exactly (0.1 * t is not)."""
    return max(0, t - AT) / 10


def test_the_gpu_work_thresholds_at_their_boundaries():
    busy = lambda t: 1.0  # noqa: E731
    assert one(build(util=after(0.3, 0.1), thread=busy)).attrs["cause"] == "input_thread"  # a baseline of 30 % falls
    none(build(util=after(0.5, 0.3), thread=busy))  # 0.6 x its baseline: not a fall
    none(build(util=lambda t: 0.25, thread=busy))  # low_util: 25 % is not under it
    assert "stays at 5 %" in one(build(util=lambda t: 0.05, thread=busy)).summary  # alive_util: still running kernels
    one(build(util=lambda t: 0.9 if t <= 330 else 0.3, thread=busy, start=280))  # 6 points of baseline are enough
    none(build(util=lambda t: 0.9 if t <= 330 else 0.3, thread=busy, start=290))  # 5 are not
    one(build(util=after(0.9, 0.3), thread=busy, step=15))  # so are 2 recent points (15 s apart)
    f = one(build(calls=at330(10.0, 2.0), thread=busy))  # min_call_rate: 10 calls/s
    assert "CUDA calls of python3 (pid 4242) fell 10/s -> 2/s" in f.summary
    none(build(calls=at330(10000.0, 6000.0), thread=busy))  # 0.6 x: not a fall
    none(build(calls=ramp(1000.0, 1000.0), thread=busy))  # calls that hold: no finding, whatever the thread
    one(build(calls=ramp(12000.0, 3000.0), start=280, thread=busy))
    one(build(calls=ramp(12000.0, 3000.0), step=15, thread=busy))
    none(build(calls=ramp(12000.0, 3000.0), start=290, thread=busy))  # 5 points of baseline: too young


def test_the_eviction_thresholds_at_their_boundaries():
    fell, evicted = after(0.92, 0.31), after(1.0, 0.04)
    one(build(util=fell, resident=evicted, major=ramp(0.0, 50.0)))  # min_major_faults
    none(build(util=fell, resident=evicted, major=ramp(0.0, 49.0)))
    one(build(util=fell, resident=evicted, major=ramp(100.0, 200.0)))  # twice the usual rate
    none(build(util=fell, resident=evicted, major=ramp(100.0, 199.0)))
    one(build(util=fell, resident=evicted, reads=ramp(0.0, 16 * MIB)))  # min_reread_rate
    none(build(util=fell, resident=evicted, reads=ramp(0.0, 15 * MIB)))
    one(build(util=fell, resident=evicted, reads=ramp(100 * MIB, 400 * MIB)))  # four times the usual rate
    none(build(util=fell, resident=evicted, reads=ramp(100 * MIB, 399 * MIB)))
    f = one(build(util=fell, resident=after(0.8, 0.5), major=ramp(2.0, 9000.0), file_size=4.0 * GIB))
    assert (f.attrs["numbers"]["resident_before"], f.attrs["numbers"]["resident_now"]) == (0.8, 0.5)
    none(build(util=fell, resident=after(0.79, 0.5), major=ramp(2.0, 9000.0), file_size=4.0 * GIB))
    none(build(util=fell, resident=after(0.8, 0.51), major=ramp(2.0, 9000.0), file_size=4.0 * GIB))
    # resident in the baseline: its most, over all 300 s (evicted in two steps, the first 4 minutes before)
    steps = lambda t: 1.0 if t <= 70 else 0.6 if t < AT else 0.04  # noqa: E731
    assert one(build(util=fell, resident=steps, major=ramp(2.0, 9000.0))).attrs["numbers"]["resident_before"] == 1.0
    # ...and the writes of its checkpoints are no reads
    h = build(util=fell, resident=evicted, reads=ramp(0.0, 0.0))
    none(add(h, "gpuwatch.process.disk.io", ramp(0.0, 700e6), dict(PROC, direction="write")))


def test_the_cause_thresholds_at_their_boundaries():
    fell = after(0.9, 0.3)
    assert one(build(util=fell, throttled=tenths)).attrs["cause"] == "cpu_throttled"  # 0.1 s/s
    assert one(build(util=fell, periods=ramp(0.0, 5.0))).attrs["cause"] == "cpu_throttled"  # 5 periods/s
    none(build(util=fell, periods=ramp(0.0, 4.9)))
    assert one(build(util=fell, stall={"memory": tenths})).attrs["cause"] == "memory_pressure"  # 0.1 s/s
    # swapping: 64 MiB more in the window, and 50 major faults/s
    swap = lambda t: GIB + (64 * MIB if t > 330 else 0)  # noqa: E731
    assert one(build(util=fell, swap=swap, major=ramp(0.0, 50.0))).attrs["cause"] == "swapping"
    none(build(util=fell, swap=swap, major=ramp(0.0, 49.0)))
    none(build(util=fell, swap=lambda t: GIB + (64 * MIB - 1 if t > 330 else 0), major=ramp(0.0, 50.0)))
    none(build(util=fell, swap=swap))  # no fault counter: no swapping named
    # thread_busy: 90 % of a core
    assert one(build(util=fell, thread=after(0.5, 0.9))).attrs["numbers"]["thread_cpu"] == 0.9
    none(build(util=fell, thread=after(0.5, 0.89)))


# --- what a finding says ------------------------------------------------------------------------------

def test_the_largest_loss_among_the_evicted_files_is_named():
    """The process has several files open: the one that lost the most bytes of its page cache is
    named, not the most evicted in share nor one that was never all resident."""
    h = build(util=after(0.92, 0.31), resident=after(1.0, 0.5), major=ramp(2.0, 9000.0))  # 6 GiB: 3 GiB lost

    def file(name, size, resident, times=range(0, 361, 10)):
        lab = dict(PROC, file=name)
        if size is not None:
            add(h, "gpuwatch.process.file.size", size, lab, times)
        add(h, "gpuwatch.process.file.cache.resident", lambda t: resident(t) * size(t) if size else GIB, lab, times)

    file("/data/no-size", None, None)
    # written out to 4 GiB, then all resident (whole pages: a little over its size) until evicted: 4 GiB lost
    file("/models/b.bin", lambda t: 2.0 * GIB if t < 100 else 4.0 * GIB, after(1.0005, 0.0))
    file("/models/c.bin", lambda t: 1.0 * GIB, after(1.0, 0.0))  # all of it lost, but 1 GiB
    file("/data/d.bin", lambda t: 8.0 * GIB, after(0.6, 0.0))  # never all resident: read in part
    file("/data/opened", lambda t: 6.0 * GIB, after(1.0, 0.0), range(340, 361, 10))
    file("/data/closed", lambda t: 6.0 * GIB, after(1.0, 0.0), range(0, 301, 10))
    n = one(h).attrs["numbers"]
    assert (n["file"], n["file_bytes"], n["lost_bytes"], n["resident_before"], n["resident_now"]) == (
        "/models/b.bin", 4.0 * GIB, 4.0 * GIB, 1.0, 0.0)


def test_the_evictor_is_the_top_reader_over_the_window_and_none_without_one():
    h = build(util=after(0.92, 0.31), resident=after(1.0, 0.04), major=ramp(2.0, 9000.0),
              readers=[(PID, NAME, after(0.0, 400e6))])
    # a reader with no process name, first seen 20 s ago and read every 5 s since: 10 s at its first point
    add(h, "gpuwatch.node.process.disk.read.rate", lambda t: 100e6, {"pid": "812"}, range(340, 361, 5))
    f = one(h)
    assert f.attrs["numbers"]["evictor"] == {"pid": "812", "process": "", "read_bytes": 3e9}
    assert "9.0k major faults/s; a process (pid 812) read 2.8 GiB in the last 30 s; GPU utilisation" in f.summary
    # one that read only before the window is not it: no evictor named
    f = one(build(util=after(0.92, 0.31), resident=after(1.0, 0.04), major=ramp(2.0, 9000.0),
                  readers=[("812", "logrotate", lambda t: 100e6 if t < AT else 0.0)]))
    assert "evictor" not in f.attrs["numbers"] and "9.0k major faults/s; GPU utilisation" in f.summary


def test_an_eviction_read_back_with_no_fault_counter_says_0_faults():
    f = one(build(util=after(0.55, 0.11), resident=after(1.0, 0.1), reads=ramp(0.0, 700e6)))
    assert f.attrs["numbers"]["major_faults_per_second"] == 0.0
    assert "reading 667.6 MiB/s from storage, 0 major faults/s; GPU utilisation" in f.summary


def test_the_swapping_and_throttling_summaries():
    f = one(build(util=after(0.9, 0.2), swap=lambda t: 1.0 * GIB + max(0, t - AT) * 50e6, major=ramp(0.0, 800.0)))
    assert f.attrs["numbers"] == {"swap_growth_bytes": 1.5e9, "swap_bytes": GIB + 3e9, "major_faults_per_second": 800.0,
                                  "gpu_work_signal": "utilization", "gpu_work_before": 0.9, "gpu_work_now": 0.2}
    assert f.summary == (
        "swapping: 1.4 GiB more swapped out in the last 30 s (3.8 GiB in all), 800 major faults/s; GPU utilisation "
        f"of python3 (pid 4242) fell 90 % -> 20 % on GPU {GPU}: give the job more host memory, or lower its host "
        "memory use (smaller prefetch, fewer workers)")
    # a swap series that begins in the window (the probe reports it once there is swap): grown since its first point
    h = build(util=after(0.9, 0.2), major=ramp(0.0, 800.0))
    add(h, "gpuwatch.process.memory.swap", lambda t: GIB + (t - 340) * 6.4 * MIB, PROC, range(340, 361, 10))
    assert one(h).attrs["numbers"]["swap_growth_bytes"] == pytest.approx(128 * MIB)
    # ...and so does its fault counter: its recent rate is enough
    h = build(util=after(0.9, 0.2))
    add(h, "gpuwatch.process.paging.faults", lambda t: 800.0 * t, dict(PROC, type="major"), range(340, 361, 10))
    add(h, "gpuwatch.process.memory.swap", lambda t: GIB + max(0, t - AT) * 50e6, PROC)
    assert one(h).attrs["cause"] == "swapping"
    throttled = ramp(0.0, 0.4, start=12.0)
    assert one(build(util=after(0.9, 0.3), throttled=throttled)).summary.startswith(
        "CPU quota throttling: 0.40 s/s throttled; GPU utilisation")
    assert one(build(util=after(0.9, 0.3), periods=ramp(0.1, 8.0))).summary.startswith(
        "CPU quota throttling: 8 throttled periods/s; GPU utilisation")
    assert one(build(util=after(0.9, 0.3), throttled=throttled, periods=ramp(0.1, 8.0))).summary.startswith(
        "CPU quota throttling: 0.40 s/s throttled, 8 throttled periods/s; GPU utilisation")
    f = one(build(util=after(0.92, 0.31), stall={"io": ramp(0.0, 0.6)}, swap=lambda t: GIB + max(0, t - AT) * 50e6,
                  **EVICTED))
    assert f.attrs["cause"] == "page_cache_eviction" and "(also swapping, io_pressure): put the models" in f.summary


def test_the_busiest_saturated_thread_is_named_and_a_young_one_is_not_judged():
    fell = after(0.9, 0.4)
    none(build(util=fell, thread=after(0.5, 0.6)))  # no thread saturated
    h = build(util=fell, thread=lambda t: 0.95)
    add(h, "gpuwatch.process.thread.cpu.utilization", lambda t: 0.99, dict(PROC, tid="4260", thread="dataloader"))
    assert one(h).attrs["numbers"] == dict(tid="4260", thread="dataloader", thread_cpu=0.99, gpu_work_signal="utilization",
                                           gpu_work_before=0.9, gpu_work_now=0.4)
    # a thread with no name: "?"
    h = add(build(util=fell), "gpuwatch.process.thread.cpu.utilization", lambda t: 1.0, dict(PROC, tid="4260"))
    f = one(h)
    assert f.attrs["numbers"]["thread"] == "" and "thread ? (tid 4260) keeps 100 % of a core busy" in f.summary
    # a thread 2 points old is judged; 1 point is not enough
    thread = "gpuwatch.process.thread.cpu.utilization"
    one(add(build(util=fell), thread, lambda t: 1.0, dict(PROC, tid="4260", thread="t"), range(350, 361, 10)))
    none(add(build(util=fell), thread, lambda t: 1.0, dict(PROC, tid="4260", thread="t"), [360]))


def test_a_process_with_no_name_and_no_gpu_work_to_read():
    assert list(HostBoundDetector().observe(History())) == []
    only_host = build(thread=lambda t: 1.0)
    assert list(HostBoundDetector().observe(only_host)) == []
    for work in ({"util": after(0.9, 0.3)}, {"calls": ramp(12000.0, 3000.0)}):
        (f,) = HostBoundDetector().observe(build(thread=lambda t: 1.0, proc={"pid": PID}, **work))
        assert f.attrs["process"] == "" and " of process (pid 4242) fell " in f.summary
        assert dict(HostBoundDetector.samples([f])[0].labels) == {"pid": PID, "process": "", "cause": "input_thread"}


def test_cuda_calls_are_judged_on_the_gpus_the_process_has_memory_on_now():
    none(build(calls=ramp(12000.0, 3000.0), memory=False, **EVICTED))  # on no GPU NVML sees: nothing to name
    # it left GPU-old 30 s ago (its memory there last seen at 330 s)
    h = build(calls=ramp(12000.0, 3000.0), **EVICTED)
    add(h, "gpuwatch.process.gpu.memory.usage", lambda t: 20.0 * GIB, PROC, range(0, 331, 10), resource="GPU-old")
    assert one(h).resource == GPU


def test_other_processes_not_judged_do_not_hide_the_one_that_is():
    h = build(util=after(0.92, 0.31), **EVICTED)
    util = "gpuwatch.process.gpu.utilization"
    for pid, fn, times in (("0", BUSY, range(0, 201, 10)),  # gone
                           ("1", BUSY, range(340, 361, 10)),  # too young
                           ("2", BUSY, range(0, 361, 10)),  # busy
                           ("3", after(0.9, 0.1), range(0, 361, 10))):  # fell, no host series
        add(h, util, fn, {"pid": pid, "process": "x"}, times, resource="GPU-0")
    assert one(h).attrs["cause"] == "page_cache_eviction"


# --- through the runner, to `gpuwatch findings` ----------------------------------------------------

def test_a_host_bound_finding_opens_and_closes_as_events_and_renders_in_findings(capsys):
    import subprocess

    from gpuwatch.agent import cli
    from gpuwatch.agent.api import Probe
    from gpuwatch.agent.runner import Runner, finding_attrs

    recover = 420

    class Playback(Probe):
        """The eviction case's series of a real process, one collection per 10 s; the GPU busy
        again at `recover`."""
        name, interval = "playback", 10.0

        def __init__(self, pid):
            self.pid, self.t = str(pid), 0

        def collect(self):
            t, self.t = self.t, self.t + 10
            h = build(util=lambda x: 0.31 if AT <= x < recover else 0.92, resident=lambda x: 0.04 if x >= AT else 1.0,
                      major=ramp(2.0, 9000.0), readers=EVICTED["readers"], seconds=t)
            out = []
            for metric in {k[0] for k in h._series}:
                for (_, res, labels), pts in h.series(metric):
                    lab = dict(labels)
                    if lab.get("pid") == PID:
                        lab["pid"] = self.pid
                    out.append(Sample(metric, pts[-1][1], res, lab, pts[-1][0]))
            return out

    child = subprocess.Popen(["sleep", "600"])
    try:
        now, events = [0.0], []
        r = Runner([Playback(child.pid)], detectors=[HostBoundDetector()], clock=lambda: now[0],
                   wallclock=lambda: T0 + now[0], on_event=events.append)
        seen = []
        for t in range(0, 600, 10):
            now[0] = float(t)
            snap = r.tick_once()
            if snap.findings:
                seen.append(t)
                shown = snap
        assert seen and AT < seen[0] <= AT + 30 and recover <= seen[-1] < recover + 60
        assert [s.metric for s in shown.samples if s.metric.startswith("gpuwatch.host_bound")] == [
            "gpuwatch.host_bound.suspected"]
    finally:
        child.kill()
        child.wait()
    kinds = [e.kind for e in events if e.kind.startswith("finding.")]
    assert kinds == ["finding.opened", "finding.closed"]
    opened = events[[e.kind for e in events].index("finding.opened")]
    assert opened.resource == GPU and opened.attrs["cause"] == "page_cache_eviction"
    found = {"open": [dict(finding_attrs(f), resource=f.resource, ts=f.ts) for f in shown.findings],
             "recent": [{"ts": e.ts, "event": e.kind, "resource": e.resource, **e.attrs} for e in events
                        if e.kind.startswith("finding.")]}
    cli._print_findings(found, "findings")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"WARNING page cache eviction of {MODEL}: 100 % -> 4 % resident")
    assert (f"    cause page_cache_eviction, pid {child.pid}: GPU utilisation 92 % -> 31 % over the last "
                        "30 s") in lines  # after the summary, wrapped at 200 columns
    recent = [ln.split()[2] for ln in lines[lines.index("recent:") + 1:] if ln.startswith("  20")]
    assert recent == ["opened", "closed"]
