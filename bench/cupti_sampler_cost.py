"""What device-wide PM sampling costs the daemon: CPU of the sampler child and of the probe
that supervises it, as a fraction of one core, while a GPU job runs.

    python3 bench/cupti_sampler_cost.py --seconds 30 --out sampler_cost.json
(repo root on a GPU machine; gpuwatch and cupti-python importable, see tests/gpu/cupti_check.sh)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import psutil

from gpuwatch.probes.cupti.devicewide import CuptiSamplerProbe

# A GPU kept busy with GEMMs, so the counters have work to see (tests/gpu/load.py, also used by h200_check.sh).
LOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu", "load.py")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    load = subprocess.Popen([sys.executable, LOAD, "--seconds", str(a.seconds + 20), "--hold-gib", "0",
                             "--duty", "1"], stdout=subprocess.DEVNULL)
    me = psutil.Process()
    probe = CuptiSamplerProbe()
    probe.start()
    try:
        # Wait for the child's first counter values (the probe's state series come at once): CUDA
        # context and enable are start-up, not steady cost.
        end = time.monotonic() + 60
        while time.monotonic() < end and not (probe.child_pid and any(
                s.metric == "gpuwatch.gpu.achieved_occupancy" for s in probe.collect())):
            time.sleep(0.5)
        child = psutil.Process(probe.child_pid) if probe.child_pid else None
        t0 = time.monotonic()
        own0, child0 = sum(me.cpu_times()[:2]), sum(child.cpu_times()[:2]) if child else 0.0
        samples = 0
        while time.monotonic() - t0 < a.seconds:
            time.sleep(1.0)  # the runner's cadence
            samples += len(probe.collect())
        wall = time.monotonic() - t0
        own = sum(me.cpu_times()[:2]) - own0
        child_cpu = (sum(child.cpu_times()[:2]) - child0) if child and child.is_running() else float("nan")
    finally:
        probe.shutdown()
        load.kill()
    res = {"seconds": wall, "sampler_child_cpu_seconds": child_cpu, "probe_cpu_seconds": own,
           "core_fraction": (child_cpu + own) / wall, "samples_collected": samples,
           "restarts": probe.restarts(), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(res))
    print(f"device-wide sampling: child {child_cpu / wall:.2%} + probe {own / wall:.2%} of one core "
          f"= {(child_cpu + own) / wall:.2%} over {wall:.0f} s ({samples} samples collected)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
