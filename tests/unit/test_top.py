"""agent/top.py: the view built from samples, findings and history, and its layout at any size."""
import re

import pytest

from gpuwatch.agent import top
from gpuwatch.agent.api import Finding, Sample
from gpuwatch.agent.history import History
from gpuwatch.agent.wire import TopResult

UUID = "GPU-0af39ec1-025b-b990-3dc9-475f5d35d110"
NOW = 1_800_000_000.0
GIB = 1 << 30


def _samples(ts=NOW, calls=0.0):
    g = lambda metric, v, **labels: Sample(metric, v, UUID, labels, ts)  # noqa: E731
    p = lambda metric, v, pid, **labels: Sample(metric, v, UUID if "gpu." in metric else "",  # noqa: E731
                                                 {"pid": str(pid), "process": f"job{pid}", **labels}, ts)
    return [
        g("gpuwatch.gpu", 1.0, gpu_index="0", name="NVIDIA H200"), g("gpuwatch.gpu.up", 1.0),
        g("hw.temperature", 61.0, sensor="gpu"), g("hw.temperature", 70.0, sensor="memory"),
        g("hw.gpu.utilization", 0.93, task="general"), g("hw.gpu.utilization", 0.5, task="encoder"),
        g("hw.power", 650.0), g("gpuwatch.gpu.power.limit", 700.0, limit="enforced"),
        g("gpuwatch.gpu.power.limit", 800.0, limit="max"),
        g("hw.gpu.memory.usage", 40.0 * GIB), g("hw.gpu.memory.limit", 141.0 * GIB),
        g("gpuwatch.gpu.clock.frequency", 1.755e9, clock="sm"), g("gpuwatch.gpu.clock.max_frequency", 1.98e9, clock="sm"),
        g("gpuwatch.gpu.clock_event.active", 1.0, reason="sw_power_cap"),
        g("gpuwatch.gpu.clock_event.active", 1.0, reason="gpu_idle"),  # not throttling
        g("gpuwatch.gpu.clock_event.active", 0.0, reason="hw_slowdown"),
        p("gpuwatch.process.gpu.memory.usage", 30.0 * GIB, 4242), p("gpuwatch.process.gpu.memory.reserved", 28.0 * GIB, 4242),
        p("gpuwatch.process.gpu.memory.allocated", 20.0 * GIB, 4242),
        p("gpuwatch.process.gpu.memory.usage", 10.0 * GIB, 77),
        p("gpuwatch.process.cuda.memory.pooled", 6.0 * GIB, 77, allocator="pytorch"),
        p("gpuwatch.process.cuda.memory.pooled", 1.0 * GIB, 77, allocator="cupy"),
        p("gpuwatch.process.cuda.memory.pooled", 2.0 * GIB, 77, allocator="none"),
        p("gpuwatch.process.cpu.utilization", 1.5, 77), p("gpuwatch.process.memory.rss", 3.0 * GIB, 77),
        p("gpuwatch.process.cpu.utilization", 0.2, 4242),
        p("gpuwatch.cuda.calls", calls, 77, api="cuLaunchKernel"), p("gpuwatch.cuda.calls", calls / 2, 77, api="cuMemcpy"),
        p("gpuwatch.process.kernel.duration", 3.0, 4242, kernel="ampere_bf16_gemm"),
        p("gpuwatch.process.kernel.duration", 9.0, 4242, kernel="other"),  # folded: not a kernel
        p("gpuwatch.process.kernel.duration", 1.0, 4242, kernel="gelu"),
        p("gpuwatch.cuda.calls", 5.0, 99, api="cuInit"),  # eBPF sees it, NVML does not list it here
    ]


LEAK = Finding("memory_leak", UUID, "critical", f"process job4242 (pid 4242) on GPU {UUID} leaks tensors",
               {"pid": "4242", "process": "job4242", "color": "white", "rate_bytes_per_second": 50.0 * 2**20,
                "time_to_oom_seconds": 1500.0}, ts=NOW)
HOT = Finding("thermal_margin", UUID, "warning", f"GPU {UUID} is at 85 °C", {}, ts=NOW - 5)


def _view(**kw):
    history = History()
    history.append(_samples(NOW - 4, calls=1000.0))
    history.append(_samples(NOW, calls=9000.0))
    return top.build(_samples(NOW, calls=9000.0), [HOT, LEAK], history, {UUID: {"result": "slower", "ts": NOW - 60}},
                     now=NOW, user=lambda pid: {4242: "alice"}.get(pid), **kw)


def test_the_view_of_one_gpu_and_its_processes():
    v = _view()
    TopResult.parse({"pid": 1, **v})
    (g,) = v["gpus"]
    assert g == {"uuid": UUID, "index": 0, "name": "NVIDIA H200", "up": True, "temperature_celsius": 61.0,
                 "utilization": 0.93, "power_watts": 650.0, "power_limit_watts": 700.0,
                 "memory_used_bytes": 40.0 * GIB, "memory_total_bytes": 141.0 * GIB, "sm_clock_hz": 1.755e9,
                 "sm_clock_max_hz": 1.98e9, "throttle": ["sw_power_cap"], "baseline": {"result": "slower", "ts": NOW - 60}}
    a, b = v["processes"]  # by GPU memory; pid 99 has no memory NVML charges on this GPU
    assert (a["pid"], a["user"], a["black"], a["grey"], a["white"]) == (4242, "alice", 30 * GIB, 28 * GIB, 20 * GIB)
    assert a["leak"] == {"color": "white", "rate_bytes_per_second": 50.0 * 2**20, "time_to_oom_seconds": 1500.0,
                         "severity": "critical"}
    assert a["top_kernel"] == "ampere_bf16_gemm" and a["calls_per_second"] is None  # no eBPF series of it
    # grey from eBPF's pools where no in-process agent reports it: every allocator's, not memory outside any
    assert (b["pid"], b["user"], b["grey"], b["white"], b["leak"]) == (77, None, 7 * GIB, None, None)
    assert b["calls_per_second"] == pytest.approx((9000 - 1000) * 1.5 / 4)
    assert (b["cpu"], b["rss_bytes"]) == (1.5, 3.0 * GIB)
    assert [f["kind"] for f in v["findings"]] == ["memory_leak", "thermal_margin"]  # worst first


def test_without_history_calls_per_second_is_unknown_not_zero():
    v = top.build(_samples(), [], None, now=NOW, user=lambda pid: None)
    assert {p["pid"]: p["calls_per_second"] for p in v["processes"]} == {4242: None, 77: None}


@pytest.mark.parametrize("sort,order", [("memory", [4242, 77]), ("cpu", [77, 4242]), ("pid", [77, 4242]),
                                         ("calls", [77, 4242])])
def test_sorting(sort, order):
    assert [p["pid"] for p in top.select(_view()["processes"], sort)] == order


def test_filter_by_command_user_or_pid():
    procs = _view()["processes"]
    assert [p["pid"] for p in top.select(procs, text="ALICE")] == [4242]
    assert [p["pid"] for p in top.select(procs, text="job77")] == [77]
    assert [p["pid"] for p in top.select(procs, pids=(77,))] == [77]
    assert top.select(procs, text="nothing") == []


@pytest.mark.parametrize("width,height", [(80, 24), (200, 50), (40, 10), (80, 8)])
def test_every_line_fits(width, height):
    lines = top.frame(_view(), width, height, top.Options(source="agent pid 1"))
    assert len(lines) <= height and all(line.cell_len <= width for line in lines)
    text = [line.plain for line in lines]
    assert text[0].startswith("gpuwatch top ")


def test_the_layout_at_80x24():
    lines = [line.plain.rstrip() for line in top.frame(_view(), 80, 24, top.Options(source="agent pid 1"))]
    assert len(lines) == 24
    assert re.match(r"  0 H200 +93% +40G/141G +61C +650/700W 1755/1980 slower +sw_power_cap$", lines[2]), lines[2]
    row = next(line for line in lines if line.split()[:1] == ["4242"])
    assert re.match(r" +4242 alice +0 +20G +28G +30G +25m +20% +— +— job4242$", row), row
    assert lines[-3] == "OPEN FINDINGS (2)"
    assert lines[-2] == "CRIT memory_leak process job4242 (pid 4242) on GPU 0 leaks tensors"  # the index, not the UUID
    assert lines[-1] == "WARN thermal_margin GPU 0 is at 85 °C"


def test_the_layout_at_200x50_shows_more():
    lines = [line.plain.rstrip() for line in top.frame(_view(), 200, 50, top.Options())]
    assert UUID in lines[2] and "█" in lines[2]
    row = next(line for line in lines if line.split()[:1] == ["77"])
    assert re.search(r" job77 +—$", row) and "TOP KERNEL" in lines[4]
    assert next(line for line in lines if line.split()[:1] == ["4242"]).endswith("ampere_bf16_gemm")


def test_a_long_process_list_is_cut_with_a_count():
    many = [dict(p, pid=1000 + i) for i, p in enumerate(_view()["processes"] * 20)]
    view = dict(_view(), processes=many)
    lines = [line.plain.rstrip() for line in top.frame(view, 80, 24, top.Options())]
    assert len(lines) == 24
    (more,) = [line for line in lines if "more (-p PID" in line]
    shown = sum(1 for line in lines if re.match(r" +1\d{3} ", line))
    assert more == f"  … {40 - shown} more (-p PID or --filter TEXT)"
    assert lines[-3] == "OPEN FINDINGS (2)"  # the findings keep their rows


@pytest.mark.parametrize("seconds,shown", [(None, "—"), (-3, "0s"), (59.9, "59s"), (60, "1m"), (7017, "1h56"),
                                           (86400 * 3 + 3600 * 4, "3d04"), (86400 * 500, "500d")])
def test_time_to_oom_fits_its_column(seconds, shown):
    assert top._duration(seconds) == shown and len(shown) <= 6


def test_the_top_kernel_is_cuptis_by_gpu_time_else_ebpfs_by_launches():
    v = top.build(_samples(), [], None, now=NOW, user=lambda pid: None, kernels={77: "add_kernel(float*, int)",
                                                                               4242: "launched_most"})
    assert {p["pid"]: p["top_kernel"] for p in v["processes"]} == {4242: "ampere_bf16_gemm", 77: "add_kernel(float*, int)"}


def test_h_shows_the_keys_in_place_of_the_processes():
    """Issue 35 item 8: top had no h/? help."""
    view = {"gpus": [], "processes": [], "findings": []}
    lines = [t.plain for t in top.frame(view, 80, 24, top.Options(help=True))]
    assert lines[0].endswith("  q quit · h help")
    assert any(x.startswith("  m c p n ") for x in lines) and any(x.startswith("  h, ? ") for x in lines)
    assert not any(x.startswith("GPU NAME") for x in lines) and all(len(x) <= 80 for x in lines)
    assert [t.plain for t in top.frame(view, 80, 24, top.Options())][1].startswith("GPU NAME")
