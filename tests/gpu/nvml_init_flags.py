"""Whether NVML can start without mapping libcuda, and what each way of starting costs resident (issue 36).

    python3 tests/gpu/nvml_init_flags.py        (on the GPU machine; round_check.sh nvml_flags)

nvml_memory.py showed nvmlInit() adding 18 MiB resident, most of it libcuda, which libnvidia-ml
loads. Each way of starting runs in a fresh interpreter: nvmlInit(), nvmlInitWithFlags with
NVML_INIT_FLAG_NO_ATTACH and with NVML_INIT_FLAG_NO_GPUS. After the start, and again after the
calls the daemon's probe makes every tick (count, memory, utilization, temperature, power, clocks,
processes), it prints VmRSS, RssAnon, whether libcuda is mapped, and which calls failed: a way of
starting that saves memory but loses a reading is no way for the daemon.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, sys
def state():
    with open("/proc/self/status") as f:
        st = dict(l.split(":", 1) for l in f if ":" in l)
    with open("/proc/self/maps") as f:
        cuda = any("libcuda.so" in l for l in f)
    return {"rss": int(st["VmRSS"].split()[0]) / 1024, "anon": int(st["RssAnon"].split()[0]) / 1024,
            "threads": int(st["Threads"]), "libcuda": cuda}
import pynvml as N
out = {"imported": state()}
how = sys.argv[1]
try:
    if how == "init":
        N.nvmlInit()
    else:
        N.nvmlInitWithFlags(getattr(N, how))
except N.NVMLError as e:
    print(json.dumps({"init_error": str(e)})); sys.exit(0)
out["started"] = state()
failed, values = [], {}
def q(name, fn):
    try:
        values[name] = fn()
    except N.NVMLError as e:
        failed.append(f"{name}: {e}")
q("count", N.nvmlDeviceGetCount)
h = None
try:
    h = N.nvmlDeviceGetHandleByIndex(0)
except N.NVMLError as e:
    failed.append(f"handle: {e}")
if h is not None:
    q("memory_used", lambda: N.nvmlDeviceGetMemoryInfo(h).used)
    q("util_gpu", lambda: N.nvmlDeviceGetUtilizationRates(h).gpu)
    q("temperature", lambda: N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU))
    q("power_mw", lambda: N.nvmlDeviceGetPowerUsage(h))
    q("sm_clock", lambda: N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM))
    q("processes", lambda: len(N.nvmlDeviceGetComputeRunningProcesses(h)))
    q("uuid", lambda: N.nvmlDeviceGetUUID(h))
out["queried"] = state()
out["failed"] = failed
out["values"] = {k: v for k, v in values.items() if k != "uuid"}
N.nvmlShutdown()
# the daemon's NVML probe, started the same way: which series it gives, and what it holds resident
if how != "init":
    N.nvmlInit = lambda: N.nvmlInitWithFlags(getattr(N, how))
import time
from gpuwatch.probes.nvml.backend import RealBackend
from gpuwatch.probes.nvml.probe import NvmlProbe
p = NvmlProbe(RealBackend, interval=1.0, slow_interval=1.0)
p.start()
series = set()
for _ in range(3):
    series |= {(s.metric, tuple(sorted(s.labels.items())) if isinstance(s.labels, dict) else tuple(s.labels))
               for s in p.collect()}
    time.sleep(0.3)
out["probe"] = state()
out["series"] = sorted(f"{m}{dict(l)}" for m, l in series)
p.shutdown()
print(json.dumps(out))
"""


def main() -> int:
    rows = []
    for how in ("init", "NVML_INIT_FLAG_NO_ATTACH", "NVML_INIT_FLAG_NO_GPUS"):
        p = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            print(f"{how}: no result (rc {p.returncode}): {p.stderr.strip()[-300:]}")
            continue
        rows.append((how, r))
    print(f"{'start':26} {'step':9} {'VmRSS':>7} {'anon':>7} {'thr':>4} libcuda  failed calls")
    for how, r in rows:
        if "init_error" in r:
            print(f"{how:26} init failed: {r['init_error']}")
            continue
        for step in ("imported", "started", "queried", "probe"):
            s = r[step]
            extra = "; ".join(r["failed"]) if step == "queried" else ""
            print(f"{how:26} {step:9} {s['rss']:>7.1f} {s['anon']:>7.1f} {s['threads']:>4d} {str(s['libcuda']):8} {extra}")
        print(f"{'':26} values: {json.dumps(r['values'])}; the probe's series: {len(r['series'])}")
    full = dict(rows).get("init", {}).get("series")
    for how, r in rows:
        if full is not None and "series" in r and how != "init":
            lost, extra = sorted(set(full) - set(r["series"])), sorted(set(r["series"]) - set(full))
            print(f"{how}: series lost against nvmlInit: {len(lost)} {lost[:8]}; new: {len(extra)} {extra[:4]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
