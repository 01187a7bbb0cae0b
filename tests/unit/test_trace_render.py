"""The live view of `gpuwatch trace` (render_live) within a terminal's size: never more lines than
it has, never a line wider (tests/ebpf/test_trace_tty.py checks a real one, tmux at 80x24)."""
import io

import pytest
from rich.console import Console

from gpuwatch.agent.trace.render import render_live

LONG = "void flash::flash_fwd_splitkv_kernel<cutlass::bfloat16_t, 128, 64>(Flash_fwd_params)"
BUSY = {
    "apis": {f"cuVeryLongApiNameNumber{i}_ptsz": {
        "calls": 1000 - i, "errors": i % 3, "bytes": 0, "seconds": 1e-3, "mean_latency_s": 1e-6, "histogram": {10: 5},
        "errors_by_code": {"CUDA_ERROR_INVALID_VALUE": i % 3} if i % 3 else {}} for i in range(30)},
    "kernels": [{"handle": hex(0x1000 + i), "name": f"{LONG}{i}", "launches": 500 - i, "grid": [3, 5, 7],
                 "block": [32, 4, 2], "stacks": [{"frames": ["f [libcuda.so]", "main+0x22c [driver]"],
                                                  "python": ["train.py:10 step"]}]} for i in range(15)],
    "memory": {"live_bytes": 10 << 30, "live_allocations": 123456, "allocations": 999999, "frees": 888888},
    "stacks": [{"bytes": 1 << 30, "allocations": 5, "frames": ["cuMemAlloc_v2", "c10::cuda::malloc(int)+0x1c", "x"]}] * 3,
    "dropped_events": 3, "graphs": {"launches": 5, "kernel_launches": 50, "unknown_content_launches": 1},
    "gpu": {"state": "up", "mode": "on", "kernels": [{"name": "k", "display_name": "gemm" * 40, "launches": 4,
                                                       "gpu_seconds": 0.5}]},
}


def _lines(snap: dict, width: int, height: int, process: str = "python3") -> list[str]:
    c = Console(width=width, height=height, file=io.StringIO(), record=True)
    c.print(render_live(snap, None, 1.0, 3.0, pid=123, process=process, uprobes=105, duration=20.0,
                        height=height, width=width))
    return c.export_text().rstrip("\n").split("\n")


@pytest.mark.parametrize("width, height", [(80, 24), (60, 12), (200, 50), (80, 8), (40, 5)])
@pytest.mark.parametrize("snap", [BUSY, dict(BUSY, gpu=None), {"apis": {}, "memory": {}}], ids=["busy", "no-gpu", "empty"])
def test_the_live_view_fits_the_terminal(snap, width, height):
    lines = _lines(snap, width, height, process="python3 " * 10)
    assert len(lines) <= height, "\n".join(lines)
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    assert lines[-1].startswith("q or Ctrl-C: stop")  # one footer line, the last


def test_at_80x24_names_give_way_to_the_numbers():
    lines = _lines(BUSY, 80, 24)
    assert lines[0] == "trace PID 123 (python3) · 3/20 s · 29565 calls, 30 errors · 105 uprobes"
    api = next(line for line in lines if line.startswith("cuVeryLongApiNameNumber1_ptsz"))
    assert api.split()[1:] == ["0", "999", "1", "INVALID_VALUE", "1", "µs", "≤1.02", "µs"]  # every column whole
    kernel = next(line for line in lines if line.startswith("void flash::"))
    assert "…" in kernel and kernel.split()[-4:] == ["0", "500", "3×5×7", "32×4×2"]
    assert sum(line.startswith("… ") and "more" in line for line in lines) == 2  # APIs and kernels left out, said


def test_the_summary_at_80_columns_keeps_every_number_and_header_whole():
    """Issue 35 item 8: the summary's kernel table cut its headers and numbers ("1-…", "la…") to keep
    long kernel names; now the names give way."""
    from gpuwatch.agent.trace.render import render_summary

    summary = {"pid": 1, "process": "p", "duration_seconds": 3.0, "ended": "duration", "dropped_events": 0,
               "apis": {k: dict(v, p50_latency_s=1e-6, p99_latency_s=2e-6) for k, v in BUSY["apis"].items()},
               "kernels": [dict(k, graph_launches=0, shared_mem_bytes=0, degenerate_launches=0)
                           for k in BUSY["kernels"]], "memory": BUSY["memory"]}
    c = Console(width=80, file=io.StringIO(), record=True)
    c.print(render_summary(summary))
    lines = c.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    head = next(line for line in lines if line.startswith("kernel "))
    assert head.split() == ["kernel", "launches", "in", "graphs", "grid", "block", "shared", "mem", "1-block", "launches"]
    row = next(line for line in lines if line.startswith("void flash::"))
    assert row.split()[-7:] == ["500", "0", "3×5×7", "32×4×2", "0", "B", "0"], row
