"""Record what the leak detector reads on a GPU, for tests/unit/test_leak_recorded.py: a real agent's
/metrics scraped every second while a steady training loop runs under `gpuwatch run` and, from 30 s
on, a tensor leak (tests/gpu/leak_program.py --mode white) runs until its real OOM. Writes the
three colors per process, the GPU's memory series and the programs' ground truth as one JSON file.

    tests/gpu/leak_record.sh OUTDIR     (about 3 minutes; .whl carried)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from leak_check import events, run_program, start_agent  # noqa: E402

KEEP = ("gpuwatch.process.gpu.memory.allocated", "gpuwatch.process.gpu.memory.reserved",
        "gpuwatch.process.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.memory.usage", "gpuwatch.gpu.memory.free")


def main() -> int:
    from gpuwatch.agent import metrics

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=200.0)
    ap.add_argument("--leak-after", type=float, default=30.0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    by_prom = {metrics.get(n).prom_name: n for n in KEEP}
    work = tempfile.mkdtemp(prefix="gw-leakrec-")
    log = os.path.join(a.out, "programs.jsonl")
    port = 19839
    agent, sock = start_agent(work, port)
    points: list[list] = []  # [ts, metric, gpu, pid, process, value]
    steady = leak = None
    try:
        steady = run_program(sock, "steady", log, seconds=a.seconds + 60)
        t0 = time.time()
        while time.time() - t0 < a.seconds:
            if leak is None and time.time() - t0 >= a.leak_after:
                leak = run_program(sock, "white", log, free_gib=4.0, rate_mib_per_min=2048, seconds=a.seconds)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                time.sleep(1)
                continue
            now = time.time()
            for fam in text_string_to_metric_families(text):
                name = by_prom.get(fam.name)
                if name is None:
                    continue
                for s in fam.samples:
                    points.append([round(now, 3), name, s.labels.get("gpu", ""), s.labels.get("pid", ""),
                                   s.labels.get("process", ""), s.value])
            time.sleep(max(0.0, 1.0 - (time.time() - now)))
    finally:
        for p in (leak, steady):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        agent.terminate()
        agent.wait(20)
    record = {"recorded": "tests/gpu/leak_record.py on the H200, " + time.strftime("%Y-%m-%d"),
              "pids": {"steady": str(steady.pid), "white": str(leak.pid) if leak else ""},
              "programs": [e for mode in ("steady", "white") for e in events(log, mode)],
              "points": points}
    with open(os.path.join(a.out, "leak-h200-series.json"), "w") as f:
        json.dump(record, f)
    print(f"{len(points)} points, programs: {[(e['mode'], e['event']) for e in record['programs']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
