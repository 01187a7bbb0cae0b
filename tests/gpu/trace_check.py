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
    trace = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "trace", "--pid", str(pid),
                              "--summary-json", a.out, "--interval", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    for line in trace.stderr:
        print("trace:", line.rstrip(), flush=True)
        if line.startswith("tracing PID"):
            break
    ready = time.monotonic() - t0
    for phase in ("add", "add", "malloc", "matmul"):
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
        ("cuLaunchKernel calls (2 add phases)", get("cuLaunchKernel"), 2 * a.adds),
        ("cuMemAlloc_v2 calls", get("cuMemAlloc_v2"), a.mallocs),
        ("cuMemAlloc_v2 bytes", get("cuMemAlloc_v2", "bytes"), a.mallocs * a.malloc_bytes),
        ("cuMemFree_v2 calls", get("cuMemFree_v2"), a.mallocs),
        ("cuLaunchKernelEx calls", get("cuLaunchKernelEx"), a.matmuls),
    ]
    ok = True
    for what, seen, want in checks:
        ok &= seen == want
        print(f"{'OK ' if seen == want else 'BAD'} {what:36s} seen {seen:>12} expected {want:>12}")
    print(f"ready after {ready:.2f} s; ended: {summary['ended']}; kernels: "
          f"{[(k['launches'], k['grid'], k['block']) for k in summary.get('kernels', [])[:4]]}")
    return 0 if ok and summary["ended"] == "interrupted" else 1


if __name__ == "__main__":
    raise SystemExit(main())
