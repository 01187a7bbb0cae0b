"""Exposition rendering: gpuwatch's renderer against prometheus_client's, on the same snapshots.

  python3 bench/bench_render.py [--fixture tests/fixtures/nvml-h200.json] [--gpus 8] [--procs-per-gpu 8]

Each round makes a new snapshot (replayed NVML) and renders it once with each renderer in
both formats, as the first scrape after a tick does. Prints medians and the ratio, one run.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from gpuwatch.agent.runner import Runner
from gpuwatch.exporters.prometheus import render
from gpuwatch.probes.nvml.probe import NvmlProbe
from gpuwatch.probes.nvml.replay import ReplayBackend

# The reference renderer is test code (tests/prometheus_reference.py), not part of the product.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from prometheus_reference import reference_registry  # noqa: E402

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "nvml-h200.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default=str(FIXTURE))
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--procs-per-gpu", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args()
    probe = NvmlProbe(functools.partial(ReplayBackend, a.fixture, gpus=a.gpus, processes_per_gpu=a.procs_per_gpu),
                      xid_events=False)
    runner = Runner([probe])
    times: dict[str, list[float]] = {k: [] for k in ("ours text", "ours openmetrics", "prometheus_client text",
                                                     "prometheus_client openmetrics")}
    try:
        for _ in range(a.rounds):
            snap = runner.tick_once()
            for name, fn in (("ours text", lambda: render(snap, False)),
                             ("ours openmetrics", lambda: render(snap, True)),
                             ("prometheus_client text", lambda: generate_latest(reference_registry(snap))),
                             ("prometheus_client openmetrics", lambda: generate_openmetrics(reference_registry(snap)))):
                t = time.process_time()
                fn()
                times[name].append(time.process_time() - t)
    finally:
        runner.shutdown()
    series = len(snap.samples)
    print(f"{series} samples per snapshot, {a.rounds} snapshots; CPU ms per render (median)")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:32s} {v:7.2f}")
    print(f"  ratio text {med['prometheus_client text'] / med['ours text']:.1f}x, "
          f"openmetrics {med['prometheus_client openmetrics'] / med['ours openmetrics']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
