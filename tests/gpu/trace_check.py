"""Check `gpuwatch trace --pid` on a GPU: attach to a running PyTorch process with known calls.

Starts tests/gpu/cuda_workload.py, then `gpuwatch trace --pid` on it (as a user would, after the
workload is running), drives the workload's phases (add, add, malloc, matmul), stops the trace
with Ctrl-C and compares its --summary-json with the known counts.

  python3 tests/gpu/trace_check.py --out trace-summary.json    (bcc importable; tests/gpu/ebpf_check.sh)
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import workload


def main() -> int:
    ap = argparse.ArgumentParser()
    workload.add_arguments(ap)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    work = workload.start(a)
    pid = int(work.stdout.readline().split()[1])
    perfetto = a.out.replace(".json", "") + "-perfetto.json"
    trace = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "trace", "--pid", str(pid),
                              "--summary-json", a.out, "--interval", "1", "--output", perfetto],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    for line in trace.stderr:
        print("trace:", line.rstrip(), flush=True)
        if line.startswith("tracing PID"):
            break
    ready = time.monotonic() - t0
    for phase in ("add", "add", "malloc", "matmul", "fresh", "triton", "graph", "expand"):
        work.stdin.write("go\n")
        work.stdin.flush()
        print("workload:", work.stdout.readline().strip(), flush=True)
    time.sleep(1.5)
    trace.send_signal(signal.SIGINT)
    out, err = trace.communicate(timeout=120)
    print(out[-3000:])
    print(err[-1500:])
    work.stdin.close()  # the workload ends at the end of its input
    work.wait(30)
    summary = json.load(open(a.out))
    apis = summary["apis"]
    get = lambda api, k="calls": apis.get(api, {}).get(k, 0)  # noqa: E731
    checks = [
        # the runtime's launches (2 add phases, fresh: 200, expand: 1), cuBLAS's and Triton's (300), by either API
        ("cuLaunchKernel + cuLaunchKernelEx calls", get("cuLaunchKernel") + get("cuLaunchKernelEx"),
         2 * a.adds + 200 + a.matmuls + 300 + 1),  # + the expand phase's fill_
        ("cuMemAlloc_v2 calls", get("cuMemAlloc_v2"), a.mallocs),
        ("cuMemAlloc_v2 bytes", get("cuMemAlloc_v2", "bytes"), a.mallocs * a.malloc_bytes),
        ("cuMemFree_v2 calls", get("cuMemFree_v2"), a.mallocs),
        ("cuGraphLaunch calls", get("cuGraphLaunch"), 97),
    ]
    kernels = summary.get("kernels", [])
    total = sum(k["launches"] for k in kernels)
    named = sum(k["launches"] for k in kernels if k.get("name"))
    triton_k = [k for k in kernels if "gw_scale_kernel" in str(k.get("name"))]
    checks.append(("gw_scale_kernel (Triton) launches", triton_k[0]["launches"] if triton_k else 0, 300))
    checks.append(("launches named >= 95 % (per mille)", int(total > 0 and named >= 0.95 * total), 1))
    # --output: one event per call, the same counts as the summary
    doc = json.load(open(perfetto))
    per_api: dict = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            per_api[e["name"]] = per_api.get(e["name"], 0) + 1
    lost = summary.get("dropped_events", 0) + summary.get("events", {}).get("not_written", 0)
    checks.append(("trace file events = calls - dropped", sum(per_api.values()),
                   sum(x["calls"] for x in apis.values()) - lost))
    checks.append(("trace file cuLaunchKernel events", per_api.get("cuLaunchKernel", 0),
                   get("cuLaunchKernel") - (lost if lost else 0)))
    print(f"named launches {named}/{total} = {named / max(total, 1):.4f}; events {summary.get('events')}, "
          f"dropped {summary.get('dropped_events')}; top kernels:")
    for k in kernels[:8]:
        print(f"  [{k.get('name_source')}] {str(k.get('name'))[:100]}: {k['launches']}")
    ok = True
    for what, seen, want in checks:
        ok &= seen == want
        print(f"{'OK ' if seen == want else 'BAD'} {what:36s} seen {seen:>12} expected {want:>12}")
    print(f"ready after {ready:.2f} s; ended: {summary['ended']}; kernels: "
          f"{[(k['launches'], k['grid'], k['block']) for k in summary.get('kernels', [])[:4]]}")
    return 0 if ok and summary["ended"] == "interrupted" else 1


if __name__ == "__main__":
    raise SystemExit(main())
