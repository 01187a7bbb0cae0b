"""Which way of making the CUDA context lets the PM sampler run on this GPU machine.

Runs the sampler child (python -X faulthandler -m gpuwatch.probes.cupti.sampler) with each
--context for a few seconds while a matmul load runs, and prints per context: exit status,
values per metric group, unsupported/fatal/error lines, and the end of stderr (a crash's
Python stack). Usage (repo root, GPU machine): python3 tests/gpu/sampler_contexts.py [--seconds 6]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

from gpuwatch.probes.cupti.sampler import CONTEXTS

# A GPU kept busy with GEMMs, so the counters have work to see (tests/gpu/load.py, also used by h200_check.sh).
LOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "load.py")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    load = subprocess.Popen([sys.executable, LOAD, "--seconds", "600", "--hold-gib", "0", "--duty", "1"],
                            stdout=subprocess.DEVNULL)
    time.sleep(3)
    results = {}
    try:
        for ctx in CONTEXTS:
            cmd = [sys.executable, "-X", "faulthandler", "-m", "gpuwatch.probes.cupti.sampler", "--devices", "0",
                   "--group-seconds", "0.5", "--context", ctx]
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                out, err = p.communicate(timeout=a.seconds)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    out, err = p.communicate(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, err = p.communicate()
            lines = []
            for line in out.splitlines():
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    pass
            values = collections.Counter(m["group"] for m in lines if m.get("type") == "value")
            means = {m["group"]: round(m["mean"], 3) for m in lines if m.get("type") == "value"}
            other = [m for m in lines if m.get("type") in ("unsupported", "fatal", "error", "busy")]
            results[ctx] = {"rc": p.returncode, "values": dict(values), "last_means": means, "other": other[:6],
                            "hello": any(m.get("type") == "hello" for m in lines), "stderr": err[-1500:]}
            ok = bool(values)
            print(f"{'OK ' if ok else 'BAD'} context {ctx:8} rc {p.returncode} hello {results[ctx]['hello']} "
                  f"values {dict(values)} means {means}", flush=True)
            for m in other[:4]:
                print(f"      {m}")
            if not ok and err.strip():
                print("      stderr: " + err.strip()[-800:].replace("\n", "\n      "))
    finally:
        load.kill()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
