"""Check the NVML probe against nvidia-smi on a real GPU, sampled at the same moments.

Each round reads the probe, runs `nvidia-smi --query-gpu`, and reads the probe again;
nvidia-smi's value must lie within the two probe readings widened by the tolerance:
temperature 2 °C, power 10 %, memory used 1 %, clocks exact.

  python3 tests/gpu/compare_nvidia_smi.py --seconds 60 --out compare.json

Run it while a load runs (tests/gpu/load.py), as tests/gpu/h200_check.sh does.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time

from gpuwatch.probes.nvml.backend import RealBackend
from gpuwatch.probes.nvml.probe import NvmlProbe

FIELDS = ["uuid", "temperature.gpu", "power.draw", "memory.used", "clocks.sm", "clocks.mem", "clocks.gr",
          "utilization.gpu"]
MIB = 2**20

# (name, nvidia-smi field, probe metric, probe labels, scale to nvidia-smi unit, tolerance kind, tolerance)
CHECKS = [
    ("temperature", "temperature.gpu", "hw.temperature", {"sensor": "gpu"}, 1.0, "abs", 2.0),
    ("power", "power.draw", "hw.power", {}, 1.0, "rel", 0.10),
    ("memory used", "memory.used", "hw.gpu.memory.usage", {}, 1 / MIB, "rel", 0.01),
    ("sm clock", "clocks.sm", "gpuwatch.gpu.clock.frequency", {"clock": "sm"}, 1e-6, "abs", 0.0),
    ("memory clock", "clocks.mem", "gpuwatch.gpu.clock.frequency", {"clock": "memory"}, 1e-6, "abs", 0.0),
    ("graphics clock", "clocks.gr", "gpuwatch.gpu.clock.frequency", {"clock": "graphics"}, 1e-6, "abs", 0.0),
]


def smi() -> dict[str, dict[str, float]]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(FIELDS), "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    rows = {}
    for line in out.strip().splitlines():
        vals = [v.strip() for v in line.split(",")]
        rows[vals[0]] = {f: float(v) for f, v in zip(FIELDS[1:], vals[1:]) if v not in ("[N/A]", "N/A")}
    return rows


def readings(probe: NvmlProbe) -> dict[tuple, float]:
    return {(s.resource, s.metric, tuple(sorted(s.labels.items()))): s.value for s in probe.collect()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--every", type=float, default=2.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    probe = NvmlProbe(RealBackend, slow_interval=3600, xid_events=False)
    probe.start()
    rounds, results = 0, {name: {"ok": 0, "n": 0, "worst": 0.0, "fails": []} for name, *_ in CHECKS}
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        before = readings(probe)
        ref = smi()
        after = readings(probe)
        rounds += 1
        for uuid, row in ref.items():
            for name, field, metric, labels, scale, kind, tol in CHECKS:
                if field not in row:
                    continue
                key = (uuid, metric, tuple(sorted(labels.items())))
                if key not in before or key not in after:
                    results[name]["fails"].append(f"round {rounds}: probe has no {metric}{labels}")
                    results[name]["n"] += 1
                    continue
                lo, hi = sorted((before[key] * scale, after[key] * scale))
                want = row[field]
                slack = tol if kind == "abs" else tol * max(abs(want), 1e-9)
                dev = 0.0 if lo <= want <= hi else min(abs(want - lo), abs(want - hi))
                r = results[name]
                r["n"] += 1
                r["worst"] = max(r["worst"], dev if kind == "abs" else dev / max(abs(want), 1e-9))
                if dev <= slack:
                    r["ok"] += 1
                else:
                    r["fails"].append(f"round {rounds}: nvidia-smi {want} vs probe {lo:g}..{hi:g}")
        time.sleep(max(0.0, a.every))
    probe.shutdown()
    summary = {"rounds": rounds, "checks": {n: {k: v if k != "fails" else v[:10] for k, v in r.items()}
                                            for n, r in results.items()}}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=2)
    print(f"{'check':<16}{'match':>10}{'worst deviation':>18}")
    for name, *_rest in CHECKS:
        r = results[name]
        kind, tol = _rest[-2], _rest[-1]
        worst = f"{r['worst']:.3g}" + (" (rel)" if kind == "rel" else "")
        print(f"{name:<16}{r['ok']:>5}/{r['n']:<4}{worst:>18}")
    return 0 if all(r["ok"] == r["n"] and r["n"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
