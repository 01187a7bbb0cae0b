"""Launch anomalies on series shaped like the eBPF probe's, NVML's and the in-process agent's."""
from gpuwatch.agent.api import Sample
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
