"""The leak detector for one process on two GPUs: each GPU judged on its own series.

NVML charges the process per GPU (black, by UUID); its in-process agent reports white and grey per
device, which the daemon names by the UUID the process gave (probes/cupti/reports.py). eBPF's live
driver bytes are per process with no GPU: for a process on two GPUs they cannot be split, and the
detector leaves them out rather than give one GPU the other's allocations.
"""
import pytest

from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors.leak import BLACK, GREY, WHITE, LeakDetector

GIB, MIB = 1 << 30, 1 << 20
GPU0 = "GPU-0af39ec1-025b-b990-3dc9-475f5d35d110"
GPU1 = "GPU-8a3f1c2d-4e5f-6071-8293-a4b5c6d7e8f9"
LIMIT = 141 * GIB
PROC = {"pid": "4242", "process": "python3"}
T0 = 1_800_000_000.0
RATE = GIB / 60  # 1 GiB a minute


def steady(base):
    return lambda i: base + (2 * GIB if i % 3 else 0)  # PyTorch's step shape: no leak


def growing(base, rate=RATE):
    return lambda i: base + rate * i


def build(seconds, per_gpu, others, live=None, extra=None):
    """per_gpu: {uuid: {color: fn of t}}; others: {uuid: bytes other processes hold there};
    live: eBPF's live bytes of the process (no GPU), a fn of t or None; extra: more samples, a fn
    of the time."""
    metric = {WHITE: "gpuwatch.process.gpu.memory.allocated", GREY: "gpuwatch.process.gpu.memory.reserved",
              BLACK: "gpuwatch.process.gpu.memory.usage"}
    h = History(maxlen=720)
    for i in range(seconds):
        t = T0 + i
        samples = []
        for gpu, colors in per_gpu.items():
            for color, fn in colors.items():
                samples.append(Sample(metric[color], float(fn(i)), gpu, PROC, t))
            used = others[gpu] + (colors[BLACK](i) if BLACK in colors else 0.0)
            samples += [Sample("hw.gpu.memory.limit", float(LIMIT), gpu, {}, t),
                        Sample("hw.gpu.memory.usage", float(used), gpu, {}, t)]
        if live is not None:
            samples.append(Sample("gpuwatch.process.cuda.memory.live", float(live(i)), "", PROC, t))
        if extra is not None:
            samples += extra(t)
        h.append(samples)
    return h


def three_colors(white):
    """White as given, grey 4 GiB above it (the pool follows the tensors), black 600 MiB above grey."""
    grey = lambda i: white(i) - (2 * GIB if i % 3 else 0) + 4 * GIB  # noqa: E731
    return {WHITE: white, GREY: grey, BLACK: lambda i: grey(i) + 600 * MIB}


def test_only_gpu1_grows_one_finding_names_gpu1_with_its_numbers():
    colors0, colors1 = three_colors(steady(20 * GIB)), three_colors(lambda i: 30 * GIB + RATE * i)
    others = {GPU0: 10 * GIB, GPU1: 80 * GIB}
    h = build(240, {GPU0: colors0, GPU1: colors1}, others)
    (f,) = LeakDetector().observe(h)
    assert (f.resource, f.attrs["pid"], f.attrs["color"]) == (GPU1, "4242", WHITE)
    assert f.attrs["rate_bytes_per_second"] == pytest.approx(RATE, rel=0.05)
    free1 = LIMIT - (others[GPU1] + colors1[BLACK](239))
    headroom = free1 + colors1[GREY](239) - colors1[WHITE](239)  # GPU 1's free memory, not GPU 0's
    assert f.attrs["headroom_bytes"] == pytest.approx(headroom)
    assert f"on GPU {GPU1}" in f.summary and GPU0 not in f.summary


def test_both_gpus_grow_one_finding_each_with_its_own_rate_and_headroom():
    colors0 = three_colors(lambda i: 20 * GIB + RATE / 2 * i + (2 * GIB if i % 3 else 0))
    colors1 = three_colors(lambda i: 30 * GIB + RATE * i + (2 * GIB if i % 3 else 0))
    others = {GPU0: 10 * GIB, GPU1: 80 * GIB}
    h = build(240, {GPU0: colors0, GPU1: colors1}, others)
    by_gpu = {f.resource: f for f in LeakDetector().observe(h)}
    assert set(by_gpu) == {GPU0, GPU1}
    for gpu, colors, rate in ((GPU0, colors0, RATE / 2), (GPU1, colors1, RATE)):
        f = by_gpu[gpu]
        assert (f.attrs["pid"], f.attrs["color"]) == ("4242", WHITE)
        assert f.attrs["rate_bytes_per_second"] == pytest.approx(rate, rel=0.05)
        free = LIMIT - (others[gpu] + colors[BLACK](239))
        assert f.attrs["headroom_bytes"] == pytest.approx(free + colors[GREY](239) - colors[WHITE](239))
        assert f"on GPU {gpu}" in f.summary


def test_grey_growing_on_gpu1_only_is_grey_there_and_nothing_on_gpu0():
    colors0 = three_colors(steady(20 * GIB))
    white1 = steady(30 * GIB)
    grey1 = lambda i: 36 * GIB + 300 * MIB / 60 * i  # noqa: E731
    colors1 = {WHITE: white1, GREY: grey1, BLACK: lambda i: grey1(i) + 600 * MIB}
    h = build(400, {GPU0: colors0, GPU1: colors1}, {GPU0: 0.0, GPU1: 0.0})
    (f,) = LeakDetector().observe(h)
    assert (f.resource, f.attrs["color"], f.attrs["grey_source"]) == (GPU1, GREY, "agent")


def test_black_on_gpu1_with_ebpf_live_bytes_growing_is_not_pinned_on_ebpf():
    """eBPF's live bytes grow (the process's driver allocations on both GPUs together): they are
    not split between the GPUs, so GPU 1's black finding does not claim eBPF's allocations, and
    GPU 0, flat in NVML, has none."""
    black0 = steady(8 * GIB)
    black1 = lambda i: 12 * GIB + 300 * MIB / 60 * i  # noqa: E731
    live = lambda i: 15 * GIB + 300 * MIB / 60 * i  # noqa: E731
    h = build(400, {GPU0: {BLACK: black0}, GPU1: {BLACK: black1}}, {GPU0: 0.0, GPU1: 0.0}, live=live)
    (f,) = LeakDetector().observe(h)
    assert (f.resource, f.attrs["color"]) == (GPU1, BLACK)
    assert f.attrs["grey_source"] == "none" and f.attrs["allocator"] is None
    assert "which part of the process grows is unknown" in f.summary


def test_the_same_ebpf_bytes_on_a_one_gpu_process_do_name_the_allocations():
    """The control for the test above: with the process on one GPU, eBPF's bytes are its bytes."""
    black1 = lambda i: 12 * GIB + 300 * MIB / 60 * i  # noqa: E731
    live = lambda i: 15 * GIB + 300 * MIB / 60 * i  # noqa: E731
    h = build(400, {GPU1: {BLACK: black1}}, {GPU1: 0.0}, live=live)
    (f,) = LeakDetector().observe(h)
    assert (f.resource, f.attrs["color"], f.attrs["grey_source"], f.attrs["allocator"]) == (GPU1, BLACK, "ebpf", "none")


BLACK1 = lambda i: 12 * GIB + 300 * MIB / 60 * i  # noqa: E731
LIVE = lambda i: 15 * GIB + 300 * MIB / 60 * i  # noqa: E731


def nvml_gpu0(count, listed=(), folded=False):
    """NVML's per-process view of GPU 0: how many processes it counts there, the pids it charges."""
    def samples(t):
        out = [Sample("gpuwatch.gpu.processes", float(count), GPU0, {"type": "compute"}, t),
               Sample("gpuwatch.gpu.processes", 0.0, GPU0, {"type": "graphics"}, t)]
        out += [Sample("gpuwatch.process.gpu.memory.usage", float(GIB), GPU0, {"pid": pid, "process": "other-job"}, t)
                for pid in listed]
        if folded:
            out.append(Sample("gpuwatch.process.gpu.memory.usage", float(GIB), GPU0,
                              {"pid": "other", "process": "other"}, t))
        return out
    return samples


def ebpf_named(extra):
    """The finding on GPU 1 for the process NVML charges there only, with eBPF's live bytes growing;
    GPU 0 is on the node, its NVML view as `extra` says."""
    h = build(400, {GPU1: {BLACK: BLACK1}}, {GPU1: 0.0, GPU0: 0.0}, live=LIVE, extra=extra)
    h.append([Sample("hw.gpu.memory.limit", float(LIMIT), GPU0, {}, T0 + 399)])
    (f,) = LeakDetector().observe(h)
    assert (f.resource, f.attrs["color"]) == (GPU1, BLACK)
    return f.attrs["grey_source"], f.attrs["allocator"]


def test_ebpf_bytes_are_the_one_gpus_when_nvml_lists_every_process_of_the_other():
    assert ebpf_named(nvml_gpu0(0)) == ("ebpf", "none")
    assert ebpf_named(nvml_gpu0(1, listed=["777"])) == ("ebpf", "none")  # another process there


@pytest.mark.parametrize("extra, why", [
    (nvml_gpu0(2, listed=["777"]), "NVML counts a process on GPU 0 it charges nothing: it may be this one"),
    (nvml_gpu0(3, listed=["777"], folded=True), "processes folded into other on GPU 0"),
    (lambda t: [], "GPU 0 lists no processes at all (not supported)"),
    (lambda t: nvml_gpu0(0)(t) + [Sample("gpuwatch.process.gpu.memory.allocated.self_reported", float(GIB), GPU0,
                                         PROC, t)],
     "the process's own agent says it holds memory on GPU 0"),
])
def test_ebpf_bytes_are_not_pinned_on_one_gpu_when_the_process_may_be_on_another(extra, why):
    assert ebpf_named(extra) == ("none", None), why
