"""What the detectors cost the agent: one judgement of each over a full history.

Builds the history the agent holds after 12 minutes (720 points a series) for N GPUs with K
processes each — NVML device and per-process memory, the in-process agent's allocated/reserved,
throttle counters, temperatures, eBPF launch counts, CUPTI kernel series — and times each
detector's observe(). Detectors judge every 10 s, so the cost per second is a tenth of this.

    python3 bench/bench_detectors.py --gpus 8 --procs-per-gpu 8 --repeat 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors.launch import LaunchDetector
from gpuwatch.detectors.leak import LeakDetector
from gpuwatch.detectors.thermal import ThermalDetector

GIB = 1 << 30


def build(gpus: int, procs: int, points: int) -> History:
    h = History(maxlen=points)
    t0 = time.time() - points
    for i in range(points):
        t = t0 + i
        s = []
        for g in range(gpus):
            gpu = f"GPU-{g:08x}-0000-0000-0000-000000000000"
            s += [Sample("gpuwatch.gpu.up", 1.0, gpu, {}, t),
                  Sample("hw.gpu.memory.limit", 141.0 * GIB, gpu, {}, t),
                  Sample("hw.gpu.memory.usage", 80.0 * GIB, gpu, {}, t),
                  Sample("hw.temperature", 60.0, gpu, {"sensor": "gpu"}, t),
                  Sample("hw.temperature.limit", 89.0, gpu, {"threshold": "slowdown"}, t)]
            for reason in ("sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown", "hw_power_brake_slowdown"):
                s.append(Sample("gpuwatch.gpu.clock_event.duration", 0.0, gpu, {"reason": reason}, t))
            for p in range(procs):
                lab = {"pid": str(1000 + g * procs + p), "process": "python3"}
                step = (i % 3) * GIB
                s += [Sample("gpuwatch.process.gpu.memory.usage", 9.0 * GIB, gpu, lab, t),
                      Sample("gpuwatch.process.gpu.memory.allocated", 4.0 * GIB + step, gpu, lab, t),
                      Sample("gpuwatch.process.gpu.memory.reserved", 8.0 * GIB, gpu, lab, t),
                      Sample("gpuwatch.cuda.calls", 5000.0 * i, "", dict(lab, api="cuLaunchKernel"), t)]
                for k in range(10):
                    kl = dict(lab, kernel=f"kernel_{k}")
                    s += [Sample("gpuwatch.process.kernel.duration", 0.01 * i, "", kl, t),
                          Sample("gpuwatch.process.kernel.launches", 100.0 * i, "", kl, t),
                          Sample("gpuwatch.process.kernel.theoretical_occupancy", 0.5, "", kl, t),
                          Sample("gpuwatch.process.kernel.grid_blocks", 132.0, "", kl, t)]
        h.append(s)
    return h


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--procs-per-gpu", type=int, default=8)
    ap.add_argument("--points", type=int, default=720)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    h = build(a.gpus, a.procs_per_gpu, a.points)
    res = {"series": len(h), "points_per_series": a.points}
    for det in (LeakDetector(), ThermalDetector(), LaunchDetector()):
        times = []
        for _ in range(a.repeat):
            t = time.process_time()
            found = list(det.observe(h))
            times.append(time.process_time() - t)
        res[det.name] = {"cpu_seconds_median": statistics.median(times), "findings": len(found),
                         "per_second_at_interval": statistics.median(times) / det.interval}
    print(json.dumps(res, indent=1))
    total = sum(res[d]["per_second_at_interval"] for d in ("leak", "thermal", "launch"))
    print(f"{res['series']} series x {a.points} points: leak {res['leak']['cpu_seconds_median'] * 1e3:.0f} ms, "
          f"thermal {res['thermal']['cpu_seconds_median'] * 1e3:.0f} ms, launch "
          f"{res['launch']['cpu_seconds_median'] * 1e3:.0f} ms of CPU per judgement; every 10 s: "
          f"{total * 1e3:.1f} ms of CPU per second")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
