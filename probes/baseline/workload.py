"""One run of the reference workload on one GPU (docs/baseline.md).

In one process and one run, on seeded inputs: the fused Triton GEMM + bias + GELU, the same GEMM
through cuBLAS (`torch.matmul`), cuBLASLt's own fused epilogue (`torch._addmm_activation`), the
unfused PyTorch chain matmul -> + bias -> GELU, and a bandwidth kernel, each timed with CUDA
events in interleaved rounds (so drift as the GPU warms touches all alike; medians of rounds).
NVML is read every 2 ms meanwhile: SM clock, power, temperature, throttle reasons, P-state.
The fused output is then checked (check.py). About 0.8 s of GPU time at 8192^3.

The daemon runs this as a child process (a crash or a hung GPU cannot take the agent down):
    python -m gpuwatch.probes.baseline.workload --gpu 0 [--shape 8192x8192x8192] [--force]
prints one JSON object; exit 0 ran, 3 skipped (the GPU has compute processes), 2 bad arguments,
1 failed (the message says why).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from typing import Callable

import torch
import triton

from gpuwatch.agent.api import GpuwatchError
from gpuwatch.probes.baseline import check as checks
from gpuwatch.probes.baseline import kernels

DEFAULT_SHAPE = (8192, 8192, 8192)
EXIT_SKIPPED = 3

# NVML's clock-event reason bits (nvml.h), by name, for the run's conditions.
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


class Busy(GpuwatchError):
    """The GPU has compute processes: a run would disturb them and measure them."""


class Conditions(threading.Thread):
    """Reads the GPU's clocks, power, temperature and throttle reasons every `period` s."""

    def __init__(self, handle, period: float = 0.002) -> None:
        super().__init__(name="baseline-nvml", daemon=True)
        import pynvml as N
        self.N, self.h, self.period = N, handle, period
        self.points: list[tuple[float, float, float, float, int, int]] = []  # t, sm MHz, W, C, reasons, pstate
        self._done = threading.Event()

    def run(self) -> None:
        N, h = self.N, self.h
        while not self._done.is_set():
            with contextlib.suppress(N.NVMLError):  # a reading missed; the run's numbers do not depend on it
                self.points.append((time.monotonic(), float(N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM)),
                                    N.nvmlDeviceGetPowerUsage(h) / 1000.0,
                                    float(N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU)),
                                    int(N.nvmlDeviceGetCurrentClocksEventReasons(h)),
                                    int(N.nvmlDeviceGetPerformanceState(h))))
            self._done.wait(self.period)

    def stop(self) -> None:
        self._done.set()
        self.join(1.0)

    def sm_clock(self, window: tuple[float, float]) -> float | None:
        """Mean SM clock (MHz) read within one window, or None when no reading fell in it."""
        sm = [p[1] for p in self.points if window[0] <= p[0] <= window[1]]
        return statistics.fmean(sm) if sm else None

    def power(self, window: tuple[float, float]) -> float | None:
        """Mean board power (W) read within one window, or None when no reading fell in it."""
        w = [p[2] for p in self.points if window[0] <= p[0] <= window[1]]
        return statistics.fmean(w) if w else None

    def during(self, windows: list[tuple[float, float]]) -> dict:
        pts = [p for p in self.points if any(t0 <= p[0] <= t1 for t0, t1 in windows)] or self.points
        if not pts:
            return {}
        reasons = 0
        for p in pts:
            reasons |= p[4]
        sm = [p[1] for p in pts]
        return {
            "samples": len(pts), "sm_clock_mhz": statistics.fmean(sm), "sm_clock_mhz_min": min(sm),
            "sm_clock_mhz_max": max(sm), "power_watts": statistics.fmean(p[2] for p in pts),
            "power_watts_max": max(p[2] for p in pts), "temperature_celsius": max(p[3] for p in pts),
            "throttle_reasons": sorted(n for bit, n in THROTTLE_REASONS.items() if reasons & bit),
            "pstate": max(p[5] for p in pts),
        }


def _nvml_handle(uuid: str):
    """NVML's handle for the GPU torch calls `uuid` (by UUID: CUDA_VISIBLE_DEVICES may renumber), or None."""
    try:
        import pynvml as N
        N.nvmlInit()
        return N.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:  # noqa: BLE001 - NVML missing or the UUID form unknown: run without conditions
        return None


def compute_pids(handle, ignore: frozenset[int] = frozenset()) -> list[int]:
    """The GPU's compute processes but this one and the agent's own (`ignore`: its sampler)."""
    import pynvml as N
    return sorted({p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(handle)} - {os.getpid()} - set(ignore))


def parse_pids(text: str) -> frozenset[int]:
    """--ignore-pids: comma-separated positive pids, at most 64."""
    parts = [p for p in text.split(",") if p.strip()]
    if len(parts) > 64 or not all(p.strip().isdigit() and 0 < int(p) < 1 << 31 for p in parts):
        raise argparse.ArgumentTypeError(f"expected up to 64 comma-separated pids, got {text[:80]!r}")
    return frozenset(int(p) for p in parts)


def _time_blocks(blocks: dict[str, tuple[Callable[[], object], int]], rounds: int,
                 windows: dict[str, list[tuple[float, float]]]) -> dict[str, list[float]]:
    """Seconds per call of each block, one value per round; rounds interleave the blocks."""
    per_call: dict[str, list[float]] = {name: [] for name in blocks}
    for _ in range(rounds):
        for name, (fn, n) in blocks.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.monotonic()
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            windows[name].append((t0, time.monotonic()))
            per_call[name].append(start.elapsed_time(end) / 1000.0 / n)
    return per_call


def run(gpu: int = 0, shape: tuple[int, int, int] = DEFAULT_SHAPE, seed: int = 0, rounds: int = 20,
        config: kernels.GemmConfig | None = None, force: bool = False, tiles: int = 8,
        target_block_seconds: float = 0.008, copy_bytes: int = 1 << 30, tile_seed: int | None = None,
        ignore: frozenset[int] = frozenset()) -> dict:
    """One run; returns the result as a JSON-able dict. Raises Busy when the GPU is in use.
    `seed` fixes the inputs (same inputs, same software: the same output digest); the checked tiles
    are drawn with `tile_seed`, by default a new one each run, so runs look at other tiles."""
    t_held = time.monotonic()  # the first CUDA call: from here the run holds the GPU (a context)
    dev = torch.device("cuda", gpu)
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    handle = _nvml_handle(_uuid(props))
    if handle is not None and not force:
        pids = compute_pids(handle, ignore)
        if pids:
            raise Busy(f"GPU {gpu} has compute processes {pids}: not running the baseline beside them")
    m, n, k = shape
    cfg = config or kernels.default_config(dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    b = (torch.randn(k, n, device=dev, generator=gen) / k ** 0.5).to(torch.bfloat16)
    bias = (0.5 * torch.randn(n, device=dev, generator=gen)).to(torch.bfloat16)
    fused_out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    src = torch.randn(copy_bytes // 4, device=dev, generator=gen)
    dst = torch.empty_like(src)
    gelu = torch.nn.functional.gelu

    steps: dict[str, Callable[[], object]] = {
        "fused": lambda: kernels.gemm_bias_gelu(a, b, bias, fused_out, cfg),
        "cublas": lambda: torch.matmul(a, b),
        "cublaslt_fused": lambda: torch._addmm_activation(bias, a, b, use_gelu=True),
        "unfused": lambda: gelu(torch.matmul(a, b) + bias, approximate="tanh"),
        "copy": lambda: kernels.copy(src, dst),
    }
    t_compile = time.monotonic()
    for fn in steps.values():  # compile, load modules, create handles
        fn()
    torch.cuda.synchronize()
    compile_seconds = time.monotonic() - t_compile
    # Calls per block so each block takes about target_block_seconds (events resolve ~µs).
    per_call = _time_blocks({name: (fn, 1) for name, fn in steps.items()}, 1, {s: [] for s in steps})
    reps = {name: max(1, min(200, round(target_block_seconds / max(v[0], 1e-6)))) for name, v in per_call.items()}

    conditions = Conditions(handle) if handle is not None else None
    if conditions:
        conditions.start()
    windows: dict[str, list[tuple[float, float]]] = {s: [] for s in steps}
    try:
        times = _time_blocks({name: (fn, reps[name]) for name, fn in steps.items()}, rounds, windows)
    finally:
        if conditions:
            conditions.stop()
    gpu_seconds = sum(sum(v) * reps[name] for name, v in times.items())
    kernels.gemm_bias_gelu(a, b, bias, fused_out, cfg)
    if tile_seed is None:
        tile_seed = int.from_bytes(os.urandom(4), "little")
    result_check = checks.check(a, b, bias, fused_out, tiles=tiles, seed=tile_seed)

    flop = 2.0 * m * n * k
    med = {name: statistics.median(v) for name, v in times.items()}
    spread = {name: (max(v) - min(v)) / med[name] for name, v in times.items()}
    cond = conditions.during(windows["fused"]) if conditions else {}
    cond_copy = conditions.during(windows["copy"]) if conditions else {}
    # Per block: the fused kernel's FLOP per SM cycle at the clock NVML read during that block
    # (under a power cap the clock moves within tens of ms), then the median of the blocks.
    per_cycle = []
    if conditions:
        for t, w in zip(times["fused"], windows["fused"]):
            mhz = conditions.sm_clock(w)
            if mhz:
                per_cycle.append(flop / t / (mhz * 1e6))
    block_clocks = {name: [conditions.sm_clock(w) for w in windows[name]] for name in ("fused", "cublas")} \
        if conditions else {}
    block_power = {name: [conditions.power(w) for w in windows[name]] for name in ("fused", "cublas")} \
        if conditions else {}
    out = {
        "gpu": gpu, "uuid": _uuid(props), "name": props.name, "sm_count": props.multi_processor_count,
        "shape": [m, n, k], "seed": seed, "config": cfg.as_dict(), "rounds": rounds, "calls_per_block": reps,
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "driver": _driver_version()},
        "seconds_per_call": med, "spread": spread,
        "gemm_flops_per_second": {name: flop / med[name] for name in ("fused", "cublas", "cublaslt_fused", "unfused")},
        "memory_bytes_per_second": 2.0 * src.numel() * src.element_size() / med["copy"],
        "fused_vs_cublas": med["cublas"] / med["fused"],
        "fused_vs_cublaslt": med["cublaslt_fused"] / med["fused"],
        "fused_speedup_vs_unfused": med["unfused"] / med["fused"],
        "conditions": cond, "conditions_copy": cond_copy,
        # Throughput per SM clock cycle: what the GPU does per cycle it was given, so a power cap
        # or a warm GPU's lower clock is not mistaken for a slower GPU (that is thermal's to say).
        "gemm_flop_per_cycle": statistics.median(per_cycle) if per_cycle else None,
        "blocks": {"seconds_per_call": times, "sm_clock_mhz": block_clocks, "power_watts": block_power},
        "check": result_check.as_dict(),
        "gpu_seconds": gpu_seconds, "compile_seconds": compile_seconds,
        # From the first CUDA call to the answer checked: how long the run held the GPU (its
        # context goes when the process exits, right after it prints).
        "held_seconds": time.monotonic() - t_held,
    }
    return out


def _uuid(props) -> str:
    u = str(getattr(props, "uuid", ""))
    return u if not u or u.startswith("GPU-") else f"GPU-{u}"


def _driver_version() -> str:
    try:
        import pynvml as N
        v = N.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v
    except Exception:  # noqa: BLE001
        return ""


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxNxK (e.g. 8192x8192x8192), got {text!r}") from None
    if min(m, n, k) < 16:
        raise argparse.ArgumentTypeError(f"each of M, N, K must be >= 16, got {text!r}")
    return m, n, k


def serve(rounds: int) -> int:
    """A prepared child: torch, Triton and the kernels imported, no CUDA call made (no context, no
    GPU memory), waiting for one request line on stdin; then one run, its JSON, exit (the context
    goes with the process). The agent keeps one ready so a run costs the GPU only the run.
    Request: {"gpu": N, "force": bool, "ignore_pids": [...], "visible": "GPU-uuid" or null}."""
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    line = sys.stdin.readline(1 << 16)
    if not line.strip():
        return 0  # the agent let it go unused
    try:
        req = json.loads(line)
        gpu = int(req.get("gpu", 0))
        visible = req.get("visible")
        ignore = parse_pids(",".join(str(int(p)) for p in req.get("ignore_pids", [])))
        if visible is not None and not (isinstance(visible, str) and len(visible) < 128):
            raise ValueError("visible")
    except (ValueError, TypeError, AttributeError, argparse.ArgumentTypeError) as e:
        print(json.dumps({"error": f"bad request: {type(e).__name__}: {str(e)[:100]}"}))
        return 2
    if visible:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # read by CUDA at its first call, which comes next
    return _one(gpu, DEFAULT_SHAPE, 0, int(req.get("rounds", rounds)), bool(req.get("force")), ignore)


def _one(gpu: int, shape, seed: int, rounds: int, force: bool, ignore: frozenset[int]) -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA GPU visible to torch"}))
        return 1
    if not 0 <= gpu < torch.cuda.device_count():
        print(json.dumps({"error": f"no GPU {gpu}: torch sees {torch.cuda.device_count()}"}))
        return 2
    try:
        print(json.dumps(run(gpu, shape, seed, rounds, force=force, ignore=ignore)))
    except Busy as e:
        print(json.dumps({"skipped": str(e)}))
        return EXIT_SKIPPED
    except torch.OutOfMemoryError as e:
        print(json.dumps({"error": f"out of GPU memory: {str(e)[:200]}"}))
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuwatch.probes.baseline.workload")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--shape", type=parse_shape, default=DEFAULT_SHAPE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--force", action="store_true", help="run even when the GPU has compute processes")
    ap.add_argument("--ignore-pids", type=parse_pids, default=frozenset(),
                    help="the agent's own processes (its CUPTI sampler), not counted as compute processes")
    ap.add_argument("--serve", action="store_true",
                    help="a prepared child: import everything, print a ready line, run once on the request read "
                         "from stdin")
    a = ap.parse_args(argv)
    if a.serve:
        return serve(a.rounds)
    return _one(a.gpu, a.shape, a.seed, a.rounds, a.force, a.ignore_pids)


if __name__ == "__main__":
    sys.exit(main())
