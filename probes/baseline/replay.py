"""Replays reference-workload runs recorded on a GPU, for tests and demos without one
(baseline.replay): GPU N's nth run prints recorded run N + n, as the workload would have.

    python -m gpuwatch.probes.baseline.replay FILE --gpu N --nth K

FILE is JSON: {"runs": [run, ...]} (tests/fixtures/baseline-h200.json, recorded on the H200 by
tests/gpu/baseline_check.py). A run {"skipped": reason} replays a busy GPU (exit 3), {"error":
reason} a failed run (exit 1). The run's GPU index is set to N; its UUID is kept, with N added
to its last digit group for N > 0 so that each GPU replays as its own (the agent keeps the run
under the UUID its NVML probe gives GPU N, whatever this prints).
"""
from __future__ import annotations

import argparse
import json
import sys


def uuid_for(uuid: str, gpu: int) -> str:
    """The recorded GPU's UUID, made GPU `gpu`'s own (unchanged for 0)."""
    if not gpu:
        return uuid
    head, _, tail = uuid.rpartition("-")
    return f"{head}-{(int(tail, 16) + gpu) % (1 << 48):012x}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuwatch.probes.baseline.replay")
    ap.add_argument("file")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--nth", type=int, default=0)
    a = ap.parse_args(argv)
    with open(a.file) as f:
        runs = json.load(f)["runs"]
    run = dict(runs[(a.gpu + a.nth) % len(runs)])
    if "skipped" in run:
        print(json.dumps(run))
        return 3
    if "error" in run:
        print(json.dumps(run))
        return 1
    run["gpu"] = a.gpu
    run["uuid"] = uuid_for(run["uuid"], a.gpu)
    print(json.dumps(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
