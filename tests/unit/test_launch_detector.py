"""Launch anomalies on series shaped like the eBPF probe's, NVML's and the in-process agent's."""
from gpuwatch.agent.api import Finding, Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors.launch import LaunchDetector

GPU = "GPU-c002ef2a-2a3c-e0e9-4d8a-a58bfd6b0084"
T0 = 1_800_000_000.0
PROC = {"pid": "4242", "process": "python3"}


def history(seconds, launches_per_s=0.0, util=None, kernels=()):
    """kernels: (name, launches/s, GPU seconds per launch, occupancy, grid blocks)."""
    h = History(maxlen=720)
    for i in range(seconds):
        t = T0 + i
        s = [Sample("gpuwatch.cuda.calls", launches_per_s * i, "", dict(PROC, api="cuLaunchKernel"), t),
             Sample("gpuwatch.cuda.calls", 10.0 * i, "", dict(PROC, api="cuMemAlloc_v2"), t),
             Sample("gpuwatch.cuda.calls", 1e6 * i, "", {"pid": "other", "process": "other", "api": "cuLaunchKernel"}, t)]
        if util is not None:
            s.append(Sample("gpuwatch.process.gpu.utilization", util, GPU, PROC, t))
        for name, rate, each, occ, blocks in kernels:
            lab = dict(PROC, kernel=name)
            s += [Sample("gpuwatch.process.kernel.launches", rate * i, "", lab, t),
                  Sample("gpuwatch.process.kernel.duration", rate * each * i, "", lab, t),
                  Sample("gpuwatch.process.kernel.theoretical_occupancy", occ, "", lab, t),
                  Sample("gpuwatch.process.kernel.grid_blocks", blocks, "", lab, t)]
        h.append(s)
    return h


def kinds(h):
    return sorted((f.kind, f.attrs["id"]) for f in LaunchDetector().observe(h))


def test_launch_bound_by_short_kernels_and_by_an_idle_gpu():
    h = history(120, launches_per_s=20000, kernels=[("add", 20000, 5e-6, 1.0, 1024)])
    (f,) = LaunchDetector().observe(h)
    assert f.kind == "launch_bound" and f.attrs["pid"] == "4242"
    assert abs(f.attrs["launches_per_second"] - 20000) < 100 and abs(f.attrs["mean_kernel_seconds"] - 5e-6) < 1e-7
    assert "CUDA graph" in f.summary and "5.0 µs" in f.summary
    assert kinds(history(120, launches_per_s=20000, util=0.3)) == [("launch_bound", "launch_bound")]


def test_many_launches_of_long_kernels_on_a_busy_gpu_are_fine():
    assert kinds(history(120, launches_per_s=20000, util=0.97, kernels=[("gemm", 20000, 45e-6, 0.5, 132)])) == []
    assert kinds(history(120, launches_per_s=1000, util=0.1)) == []  # few launches: not launch-bound
    assert kinds(history(20, launches_per_s=20000, util=0.1)) == []  # too short a look


def test_low_occupancy_and_degenerate_kernels_with_a_large_share():
    h = history(120, kernels=[("gemm", 100, 1e-3, 0.1875, 132),   # 0.1 s/s: 50 %
                              ("reduce", 1000, 4e-5, 1.0, 1),     # 0.04 s/s: 20 %, one block
                              ("tail", 10, 1e-4, 0.1, 1),         # 0.001 s/s: too small a share
                              ("norm", 600, 1e-4, 1.0, 264)])     # 0.06 s/s
    assert kinds(h) == [("degenerate_grid", "reduce"), ("low_occupancy", "gemm")]


def test_nothing_to_judge():
    assert list(LaunchDetector().observe(History())) == []


# Series point by point, for inputs that sit exactly on a threshold. Times are seconds after T0; with
# the default 60 s window and the newest point at 60, the window starts exactly at T0.
CUDA = "gpuwatch.cuda.calls"
UTIL = "gpuwatch.process.gpu.utilization"
FIX = (": the CPU's launches are the bottleneck; capture the steady part in a CUDA graph "
       "(torch.compile(mode='reduce-overhead'), torch.cuda.graphs) or fuse small ops")


def build(*series):
    h = History(maxlen=720)
    for metric, labels, pts, resource in series:
        h.append([Sample(metric, float(v), resource, labels, T0 + t) for t, v in pts])
    return h


def calls(rate, api="cuLaunchKernel", times=range(61), labels=PROC, start=0.0):
    return (CUDA, dict(labels, api=api), [(t, start + rate * t) for t in times], "")


def util(pts, gpu=GPU, labels=PROC):
    return (UTIL, labels, pts, gpu)


def kernel(name, seconds=None, launches=None, occ=None, blocks=None, at=60, labels=PROC):
    """seconds, launches: counter points; occ, blocks: the gauges' newest value, at `at`."""
    lab = dict(labels, kernel=name)
    out = []
    if seconds is not None:
        out.append(("gpuwatch.process.kernel.duration", lab, seconds, ""))
    if launches is not None:
        out.append(("gpuwatch.process.kernel.launches", lab, launches, ""))
    if occ is not None:
        out.append(("gpuwatch.process.kernel.theoretical_occupancy", lab, [(at, occ)], ""))
    if blocks is not None:
        out.append(("gpuwatch.process.kernel.grid_blocks", lab, [(at, blocks)], ""))
    return out


def bound(rate, why, mean=None, gpu=None, ts=T0 + 60, pid="4242", process="python3"):
    return Finding("launch_bound", "", "warning",
                   f"process {pid} ({process}) launches {rate} kernels a second and {why}{FIX}",
                   {"id": "launch_bound", "pid": pid, "process": process,
                    "launches_per_second": float(rate.replace(",", "")), "mean_kernel_seconds": mean,
                    "gpu_utilization": gpu}, ts=ts)


def test_launch_bound_at_exactly_the_launch_rate_the_short_kernel_and_half_the_window():
    # 5000 launches/s over 30 s (half the window) = 5000/s; 20 s of GPU time in 1e6 kernels = 20 µs each
    add = kernel("add", seconds=[(0, 0), (60, 20.0)], launches=[(0, 0), (60, 1e6)], occ=1.0, blocks=1024)
    (f,) = LaunchDetector().observe(build(calls(5000, times=range(30, 61)), *add))
    assert f == bound("5,000", "its kernels run 20.0 µs on average (CUPTI)", mean=20e-6)
    assert f.summary == ("process 4242 (python3) launches 5,000 kernels a second and its kernels run 20.0 µs on "
                         "average (CUPTI): the CPU's launches are the bottleneck; capture the steady part in a "
                         "CUDA graph (torch.compile(mode='reduce-overhead'), torch.cuda.graphs) or fuse small ops")
    assert kinds(build(calls(4999, times=range(30, 61)), *add)) == []  # 4999/s: under the rate
    assert kinds(build(calls(5000, times=range(31, 61)), *add)) == []  # 29 s: under half the window
    longer = kernel("add", seconds=[(0, 0), (60, 20.000001)], launches=[(0, 0), (60, 1e6)], occ=1.0, blocks=1024)
    assert kinds(build(calls(5000, times=range(30, 61)), *longer)) == []  # 20.000001 µs: not short


def test_launch_bound_message_shows_the_mean_kernel_time_to_a_tenth_of_a_microsecond():
    # 1.234999 s / 1e5 kernels = 12.34999 µs: "12.3", not rounded up
    add = kernel("add", seconds=[(0, 0), (60, 1.234999)], launches=[(0, 0), (60, 1e5)])
    (f,) = LaunchDetector().observe(build(calls(6000), *add))
    assert f.summary == bound("6,000", "its kernels run 12.3 µs on average (CUPTI)").summary


def test_launch_bound_by_an_idle_gpu_at_exactly_the_busy_threshold():
    (f,) = LaunchDetector().observe(build(calls(5000), util([(0, 0.6), (60, 0.6)])))
    assert f == bound("5,000", "the GPU is busy with it 60% of the time (NVML)", gpu=0.6)
    assert kinds(build(calls(5000), util([(0, 0.61), (60, 0.61)]))) == []
    # both reasons, joined
    add = kernel("add", seconds=[(0, 0), (60, 2.0)], launches=[(0, 0), (60, 1e5)])
    (f,) = LaunchDetector().observe(build(calls(5000), util([(0, 0.5), (60, 0.5)]), *add))
    assert f == bound("5,000", "its kernels run 20.0 µs on average (CUPTI) and the GPU is busy with it 50% of "
                      "the time (NVML)", mean=20e-6, gpu=0.5)


def test_gpu_utilization_is_the_mean_of_the_windows_points_over_all_gpus():
    # (0.2 + 0.2 + 1.0 + 1.0) / 4 = 0.6 over two GPUs: at the threshold
    two = [util([(0, 0.2), (60, 0.2)], gpu="GPU-a"), util([(0, 1.0), (60, 1.0)], gpu="GPU-b")]
    (f,) = LaunchDetector().observe(build(calls(5000), *two))
    assert f.attrs["gpu_utilization"] == 0.6
    # the point exactly at the window's start counts: (0.2 + 1.0) / 2 = 0.6
    (f,) = LaunchDetector().observe(build(calls(5000), util([(0, 0.2), (60, 1.0)])))
    assert f.attrs["gpu_utilization"] == 0.6
    # idle before the window, busy in it: not launch-bound
    assert kinds(build(calls(5000), util([(-20, 0.0), (-10, 0.0), (0, 1.0), (60, 1.0)]))) == []


def test_launches_are_summed_over_the_kernel_launch_apis_only():
    h = build((CUDA, PROC, [(t, 1e6 * t) for t in range(61)], ""),              # no api label
              calls(10, api="cuMemAlloc_v2"),                                     # not a launch
              calls(1e5, api="cuGraphLaunch"),                                    # a graph: many kernels, one call
              calls(1e6, labels={"pid": "other", "process": "other"}),            # folded processes
              (CUDA, {"process": "x", "api": "cuLaunchKernel"}, [(t, 1e6 * t) for t in range(61)], ""),  # no pid
              calls(1000, api="cuLaunchKernelEx", times=(-30, 60)),               # one point in the window
              calls(3000), calls(1500, api="cuLaunchKernel_ptsz"), calls(500, api="cuLaunchCooperativeKernel"),
              util([(0, 0.5), (60, 0.5)]), util([(0, 0.1), (60, 0.1)], labels={"pid": "other", "process": "other"}))
    (f,) = LaunchDetector().observe(h)
    assert f == bound("5,000", "the GPU is busy with it 50% of the time (NVML)", gpu=0.5)


def test_a_launch_series_with_two_points_in_the_window_is_enough():
    h = build(calls(5000, times=(0, 60)), util([(60, 0.5)]))
    assert LaunchDetector().observe(h) == [bound("5,000", "the GPU is busy with it 50% of the time (NVML)", gpu=0.5)]
    # sparse points (every 20 s) are fresh as long as the newest is
    h = build(calls(5000, times=(0, 20, 40, 60)), util([(60, 0.5)]))
    assert LaunchDetector().observe(h) == [bound("5,000", "the GPU is busy with it 50% of the time (NVML)", gpu=0.5)]


def test_launch_series_older_than_15_s_are_left_out():
    a, b, c = ({"pid": p, "process": "python3"} for p in ("1", "2", "3"))
    h = build(calls(100, labels=c),                                       # says what now is: 60
              calls(5000, labels=b, times=range(45)), util([(40, 0.5)], labels=b),   # newest 16 s ago
              calls(5000, labels=a, times=range(46)), util([(40, 0.5)], labels=a))   # newest 15 s ago
    # a: 45 s at 5000/s
    assert LaunchDetector().observe(h) == [bound("5,000", "the GPU is busy with it 50% of the time (NVML)",
                                                 gpu=0.5, pid="1")]


def test_launch_rate_over_a_sub_second_window():
    # 5000 launches in 0.5 s: 10000/s
    h = build(calls(10000, times=(0, 0.5)), util([(0.5, 0.5)]))
    (f,) = LaunchDetector(window=1.0).observe(h)
    assert f.attrs["launches_per_second"] == 10000.0 and f.ts == T0 + 0.5


def test_a_launch_counter_that_resets_counts_its_rises():
    # 6000/s from 1e6, reset to 0 at 41 s, then 6000/s again: (40 + 19) * 6000 / 60 = 5900/s
    pts = [(t, 1e6 + 6000 * t) for t in range(41)] + [(t, 6000 * (t - 41)) for t in range(41, 61)]
    reason = "the GPU is busy with it 50% of the time (NVML)"
    gpu = util([(0, 0.5), (60, 0.5)])
    assert LaunchDetector().observe(build((CUDA, dict(PROC, api="cuLaunchKernel"), pts, ""), gpu)) == [
        bound("5,900", reason, gpu=0.5)]
    # reset on the newest point: 59 * 6000 / 60 = 5900/s
    pts = [(t, 1e6 + 6000 * t) for t in range(60)] + [(60, 0)]
    assert LaunchDetector().observe(build((CUDA, dict(PROC, api="cuLaunchKernel"), pts, ""), gpu)) == [
        bound("5,900", reason, gpu=0.5)]
    # reset right after the first point: 59 * 6000 / 60
    pts = [(0, 1e6)] + [(t, 6000 * (t - 1)) for t in range(1, 61)]
    assert LaunchDetector().observe(build((CUDA, dict(PROC, api="cuLaunchKernel"), pts, ""), gpu)) == [
        bound("5,900", reason, gpu=0.5)]
    # a reset that climbs back past the window's first value (100000 -> 340000, 0 -> 114000): still
    # (40 + 19) * 6000 / 60, not the 14000 / 60 that the newest minus the first would say
    pts = [(t, 100000 + 6000 * t) for t in range(41)] + [(t, 6000 * (t - 41)) for t in range(41, 61)]
    assert LaunchDetector().observe(build((CUDA, dict(PROC, api="cuLaunchKernel"), pts, ""), gpu)) == [
        bound("5,900", reason, gpu=0.5)]


def occupancy(name, share, occ, pid="4242", process="python3", ts=T0 + 60):
    return Finding("low_occupancy", "", "info",
                   f"kernel {name} of process {pid} ({process}) takes {share:.0%} of its GPU time at a theoretical "
                   f"occupancy of {occ:.0%}: its launch configuration (registers, shared memory, block size) keeps "
                   f"SMs under-filled",
                   {"id": name, "pid": pid, "process": process, "kernel": name, "share": share, "occupancy": occ},
                   ts=ts)


def degenerate(name, share, pid="4242", process="python3", ts=T0 + 60):
    return Finding("degenerate_grid", "", "warning",
                   f"kernel {name} of process {pid} ({process}) is launched with a grid of one block and takes "
                   f"{share:.0%} of its GPU time: one SM works, the rest idle",
                   {"id": name, "pid": pid, "process": process, "kernel": name, "share": share}, ts=ts)


def two_kernels(secs, occ=1.0, blocks=132, other=1.0):
    """kernel "k" with `secs` GPU seconds in the window and "rest" with 10 - secs (a share of secs / 10)."""
    return build(*kernel("k", seconds=[(0, 0), (60, secs)], launches=[(0, 0), (60, 100)], occ=occ, blocks=blocks),
                 *kernel("rest", seconds=[(0, 0), (60, 10.0 - secs)], launches=[(0, 0), (60, 100)], occ=other,
                         blocks=264))


def test_low_occupancy_at_exactly_the_occupancy_and_the_share():
    # 3 of 10 GPU seconds = 0.3 at an occupancy of 0.25
    assert LaunchDetector().observe(two_kernels(3.0, occ=0.25)) == [occupancy("k", 0.3, 0.25)]
    assert LaunchDetector().observe(two_kernels(3.0, occ=0.25))[0].summary == (
        "kernel k of process 4242 (python3) takes 30% of its GPU time at a theoretical occupancy of 25%: its "
        "launch configuration (registers, shared memory, block size) keeps SMs under-filled")
    assert kinds(two_kernels(3.0, occ=0.26)) == []
    assert kinds(two_kernels(2.9, occ=0.25)) == []


def test_degenerate_grid_at_exactly_the_share():
    # 1 of 10 GPU seconds = 0.1 in grids of one block
    assert LaunchDetector().observe(two_kernels(1.0, blocks=1)) == [degenerate("k", 0.1)]
    assert LaunchDetector().observe(two_kernels(1.0, blocks=1))[0].summary == (
        "kernel k of process 4242 (python3) is launched with a grid of one block and takes 10% of its GPU time: "
        "one SM works, the rest idle")
    assert kinds(two_kernels(0.99, blocks=1)) == []
    assert kinds(two_kernels(5.0, blocks=2)) == []
    # grid_blocks is x * y * z: a grid of 1 x 1 x 4 has 4 blocks and is not degenerate
    assert kinds(two_kernels(5.0, blocks=1 * 1 * 4)) == []
    # both findings on one kernel
    assert LaunchDetector().observe(two_kernels(5.0, occ=0.25, blocks=1)) == [occupancy("k", 0.5, 0.25),
                                                                              degenerate("k", 0.5)]


def test_a_kernel_launched_once_in_the_window_with_one_block_is_degenerate():
    h = build(*kernel("once", seconds=[(0, 0), (60, 0.5)], launches=[(0, 7), (60, 8)], occ=1.0, blocks=1),
              *kernel("gemm", seconds=[(0, 0), (60, 0.5)], launches=[(0, 0), (60, 100)], occ=1.0, blocks=132))
    assert LaunchDetector().observe(h) == [degenerate("once", 0.5)]


def test_with_no_degenerate_share_every_one_block_kernel_that_ran_is_flagged():
    h = build(*kernel("idle", seconds=[(0, 0.5), (60, 0.5)], launches=[(0, 5), (60, 5)], blocks=1),  # not in the window
              *kernel("gauges", occ=1.0, blocks=1),                                                # no counters
              *kernel("once", seconds=[(0, 0), (60, 0.25)], launches=[(0, 0), (60, 1)], blocks=1),
              *kernel("gemm", seconds=[(0, 0), (60, 0.75)], launches=[(0, 0), (60, 100)], blocks=132))
    assert LaunchDetector(degenerate_share=0.0).observe(h) == [degenerate("once", 0.25)]


def test_no_kernel_gpu_time_in_the_window_judges_no_kernel():
    h = build(*kernel("k", seconds=[(0, 5.0), (60, 5.0)], launches=[(0, 100), (60, 100)], occ=0.1, blocks=1))
    assert LaunchDetector().observe(h) == []


def test_a_kernel_with_gauges_only_takes_no_gpu_time():
    # "add": 2 s in 1e5 kernels of one block (20 µs each, all the process's GPU time); "lonely": no counters
    h = build(calls(5000),
              *kernel("add", seconds=[(0, 0), (60, 2.0)], launches=[(0, 0), (60, 1e5)], occ=1.0, blocks=1),
              *kernel("lonely", occ=0.1, blocks=1))
    assert LaunchDetector().observe(h) == [bound("5,000", "its kernels run 20.0 µs on average (CUPTI)", mean=20e-6),
                                           degenerate("add", 1.0)]


def test_shares_count_only_the_windows_gpu_time_and_need_no_launch_counts():
    # No eBPF: the kernel series say what now is (120). "old" ran 100 s before the window, none in it.
    h = build(*kernel("old", seconds=[(0, 0), (50, 100.0), (120, 100.0)], launches=[(0, 0), (50, 1000), (120, 1000)],
                      occ=0.1, blocks=1, at=120),
              *kernel("new", seconds=[(60, 0), (120, 6.0)], launches=[(60, 0), (120, 600)], occ=0.2, blocks=132,
                      at=120))
    assert LaunchDetector().observe(h) == [occupancy("new", 1.0, 0.2, ts=T0 + 120)]


def test_the_rest_bucket_of_kernels_is_left_out_of_the_shares():
    # kernel="other" (the probe's rest) with 30 s is not part of the total: "gemm" has all of the 1 s
    h = build(*kernel("gemm", seconds=[(0, 0), (60, 1.0)], launches=[(0, 0), (60, 10)], occ=0.2, blocks=132),
              *kernel("other", seconds=[(0, 0), (60, 30.0)], launches=[(0, 0), (60, 1000)]),
              *kernel("other", seconds=[(0, 0), (60, 30.0)], launches=[(0, 0), (60, 1000)],
                      labels={"pid": "other", "process": "other"}))
    assert LaunchDetector().observe(h) == [occupancy("gemm", 1.0, 0.2)]


def test_a_small_total_of_gpu_time_is_still_judged():
    # 0.25 s in all, one kernel: 100 % at an occupancy of 0.1875
    h = build(*kernel("k", seconds=[(0, 0), (60, 0.25)], launches=[(0, 0), (60, 10)], occ=0.1875, blocks=132))
    (f,) = LaunchDetector().observe(h)
    assert f == occupancy("k", 1.0, 0.1875)
    assert "takes 100% of its GPU time at a theoretical occupancy of 19%" in f.summary


def test_kernel_series_older_than_15_s_are_left_out():
    # "lag16" (newest point 16 s ago, listed first) is left out; "lag15" counts: 1 of 2 s = 0.5
    h = build(*kernel("lag16", seconds=[(0, 0), (44, 2.0)], launches=[(0, 0), (44, 10)], occ=0.1, blocks=132, at=44),
              *kernel("lag15", seconds=[(0, 0), (45, 1.0)], launches=[(0, 0), (45, 10)], occ=0.1, blocks=132, at=45),
              *kernel("fresh", seconds=[(0, 0), (60, 1.0)], launches=[(0, 0), (60, 10)], occ=1.0, blocks=132))
    assert LaunchDetector().observe(h) == [occupancy("lag15", 0.5, 0.1)]


def test_a_kernel_counter_that_resets_counts_its_rises():
    # "k": 5 s, reset to 0, then 3 s: 3 of 3 + 7 = 0.3 at an occupancy of 0.25
    h = build(*kernel("k", seconds=[(0, 5.0), (30, 0.0), (60, 3.0)], launches=[(0, 100), (30, 0), (60, 30)],
                      occ=0.25, blocks=132),
              *kernel("rest", seconds=[(0, 0), (60, 7.0)], launches=[(0, 0), (60, 70)], occ=1.0, blocks=132))
    assert LaunchDetector().observe(h) == [occupancy("k", 0.3, 0.25)]


def test_series_without_a_process_label():
    lab = {"pid": "4242"}
    h = build(calls(5000, labels=lab), util([(0, 0.5), (60, 0.5)], labels=lab),
              *kernel("add", seconds=[(0, 0), (60, 2.0)], launches=[(0, 0), (60, 1e5)], occ=1.0, blocks=1, labels=lab))
    assert LaunchDetector().observe(h) == [
        bound("5,000", "its kernels run 20.0 µs on average (CUPTI) and the GPU is busy with it 50% of the time (NVML)",
              mean=20e-6, gpu=0.5, process=""),
        degenerate("add", 1.0, process="")]


def test_findings_of_every_process():
    a, b = {"pid": "1", "process": "train"}, {"pid": "2", "process": "serve"}
    h = build(calls(100, labels=a), calls(100, labels=b),
              *kernel("reduce", seconds=[(0, 0), (60, 1.0)], launches=[(0, 0), (60, 10)], blocks=1, labels=a),
              *kernel("gemm", seconds=[(0, 0), (60, 1.0)], launches=[(0, 0), (60, 10)], occ=0.1, labels=b))
    assert LaunchDetector().observe(h) == [degenerate("reduce", 1.0, pid="1", process="train"),
                                           occupancy("gemm", 1.0, 0.1, pid="2", process="serve")]
