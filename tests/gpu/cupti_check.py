"""The in-process agent on a GPU, against the ground truth of tests/gpu/cupti_workload.py.

Runs the workload under `gpuwatch run --kernels continuous` with no daemon (so the agent
reports to its file), reads that file ten times a second while the job runs, and checks:
  - three colors: every white/grey the agent reported equals the job's own
    torch.cuda.memory_allocated()/memory_reserved() in force at that moment, GPU UUID included;
  - kernels: the add kernel's launches equal the job's count exactly; the cuBLAS GEMM kernels'
    CUPTI durations add up to the CUDA-event time of the same matmuls;
  - torch.profiler: while it runs the agent steps aside (its kernels are the profiler's, not
    ours, and the profiler sees them), and the agent resumes after (the next kernels counted);
  - no records dropped; theoretical occupancy on every kernel.
Also keeps the raw records (GPUWATCH_RUN_RECORD) as the CI fixture tests/fixtures/cupti-h200.json.
Usage (repo root, gpuwatch and cupti-python importable): python3 tests/gpu/cupti_check.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--timeout", type=float, default=120)
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
work = tempfile.mkdtemp(prefix="gw-cupti-")
log_path = os.path.join(work, "workload.jsonl")
record_path = os.path.join(a.out, "cupti-h200.json")
env = dict(os.environ, GPUWATCH_RUN_RECORD=record_path, GPUWATCH_RUN_RECORD_MAX="3000")
cmd = [sys.executable, "-m", "gpuwatch.agent.cli", "run", "--kernels", "continuous", "--interval", "0.2",
       "--report-dir", work, "--socket", os.path.join(work, "no-agent.sock"), "--",
       sys.executable, "tests/gpu/cupti_workload.py", "--log", log_path]
t_start = time.time()
proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
report_path = os.path.join(work, f"gpuwatch-run-{proc.pid}.json")  # exec keeps the PID
seen: dict[float, dict] = {}
states: list[str] = []
last: dict = {}
while proc.poll() is None and time.time() - t_start < a.timeout:
    try:
        with open(report_path) as f:
            r = json.load(f)
    except (OSError, ValueError):
        time.sleep(0.05)
        continue
    last = r
    for m in r.get("memory", []):
        seen.setdefault(m["ts"], m)
    st = r["cupti"]["state"]
    if not states or states[-1] != st:
        states.append(st)
    time.sleep(0.1)
if proc.poll() is None:
    proc.kill()
output = proc.communicate()[0]
with open(report_path) as f:
    final = json.load(f)
if not states or states[-1] != final["cupti"]["state"]:
    states.append(final["cupti"]["state"])
log = [json.loads(line) for line in open(log_path)]
results: list[tuple[bool, str]] = []


def check(ok: bool, what: str) -> None:
    results.append((ok, what))


print("workload exit", proc.returncode, "| agent output:\n" + output.strip())
check(proc.returncode == 0, f"workload exit code {proc.returncode} (0 expected)")

# -- three colors -------------------------------------------------------------------------
changes = [e for e in log if "allocated" in e]
memory_end = next(e["t"] for e in log if e.get("phase") == "adds begin")  # then the job moves on
uuid = next(e["uuid"] for e in log if e.get("phase") == "start")
compared = equal = ambiguous = 0
mismatches = []
for ts, m in sorted(seen.items()):
    if m["device"] != 0 or ts >= memory_end:
        continue
    if any(c["t0"] <= ts <= c["t"] for c in changes):
        ambiguous += 1  # sampled while the job was changing it
        continue
    before = [c for c in changes if c["t"] < ts]
    if not before:
        continue
    truth = before[-1]
    compared += 1
    if (m["allocated"], m["reserved"], m["uuid"]) == (truth["allocated"], truth["reserved"], uuid):
        equal += 1
    else:
        mismatches.append({"ts": ts, "agent": m, "job": truth})
phases = {c["phase"] for c in changes}
covered = {max((c for c in changes if c["t"] < ts), key=lambda c: c["t"])["phase"]
           for ts, m in seen.items() if any(c["t"] < ts for c in changes) and ts < memory_end}
check(compared >= 10 and equal == compared and phases <= covered,
      f"three colors: {equal}/{compared} agent samples equal the job's memory_allocated/memory_reserved "
      f"(and UUID {uuid}); {len(covered & phases)}/{len(phases)} memory states seen, {ambiguous} samples "
      f"taken mid-change skipped")

# -- kernels --------------------------------------------------------------------------------
kernels = final["kernels"]
adds = next(e["adds"] for e in log if e.get("phase") == "adds end")
add_launches = sum(k["launches"] for k in kernels if "add" in k["name"].lower())
check(add_launches == adds, f"add kernel: {add_launches} launches seen by CUPTI, the job made {adds}")
mm = next(e for e in log if e.get("phase") == "matmuls")
gemm = [k for k in kernels if any(s in k["name"].lower() for s in ("gemm", "nvjet", "cutlass", "sm90"))]
gemm_launches = sum(k["launches"] for k in gemm)
per_matmul = sum(k["gpu_seconds"] for k in gemm) / max(1, gemm_launches)
ratio = per_matmul * mm["matmuls"] / mm["event_seconds"]
check(gemm_launches == mm["matmuls"] + mm["warmup"] and 0.85 <= ratio <= 1.02,
      f"matmuls: {gemm_launches} GEMM kernel launches (job: {mm['matmuls']} + {mm['warmup']} warm-up); CUPTI "
      f"{per_matmul * 1e3:.3f} ms each x {mm['matmuls']} = {ratio:.3f} x the CUDA-event time "
      f"{mm['event_seconds'] * 1e3:.2f} ms")

# -- torch.profiler ----------------------------------------------------------------------------
prof = next(e for e in log if e.get("phase") == "profiler")
after = next(e for e in log if e.get("phase") == "after profiler")
sqrt_ours = sum(k["launches"] for k in kernels if "sqrt" in k["name"].lower())
neg_ours = sum(k["launches"] for k in kernels if "neg" in k["name"].lower())
check(sqrt_ours == 0 and prof["profiler_sqrt_events"] >= prof["sqrts"] and "yielded" in states
      and neg_ours == after["negs"],
      f"torch.profiler: agent states {' -> '.join(states)}; the profiler saw {prof['profiler_sqrt_events']} sqrt "
      f"events (job made {prof['sqrts']}), the agent {sqrt_ours}; after it, the agent counted {neg_ours} of "
      f"{after['negs']} neg kernels")

# -- health ----------------------------------------------------------------------------------
c = final["cupti"]
check(c["dropped"] == 0, f"records: {c['records']} decoded in {c['decode_seconds'] * 1e3:.1f} ms "
      f"({c['decode_seconds'] / max(1, c['records']) * 1e6:.2f} us each), {c['dropped']} dropped, libcupti {c['libcupti']}")
occ = [k for k in kernels if k.get("occupancy") is not None]
check(len(occ) == len(kernels) and kernels,
      f"theoretical occupancy on {len(occ)}/{len(kernels)} kernels, e.g. "
      + "; ".join(f"{k['name'][:40]} block {k['block']} regs {k['registers']} -> {k['occupancy']:.0%} "
                  f"({k['occupancy_limiter']})" for k in occ[:3]))
try:
    with open(record_path) as f:
        n_recorded = len(json.load(f)["records"])
except (OSError, ValueError, KeyError):
    n_recorded = 0
check(n_recorded > 100, f"raw records kept for the CI fixture: {n_recorded} in {record_path}")

with open(os.path.join(a.out, "cupti.json"), "w") as f:
    json.dump({"final_report": final, "workload_log": log, "memory_samples": list(seen.values()),
               "mismatches": mismatches[:20], "states": states,
               "results": [{"ok": ok, "what": w} for ok, w in results]}, f, indent=1)
print("== summary")
for ok, what in results:
    print(("OK   " if ok else "BAD  ") + what)
sys.exit(0 if all(ok for ok, _ in results) else 1)
