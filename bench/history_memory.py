"""What the detectors' history holds, and what reading it costs, at its default length.

    .venv/bin/python bench/history_memory.py [--series 126 1000] [--points 720]

For each number of series: the bytes Python allocates for the points (tracemalloc, after filling
every series to its length), per point; the median time of one append of a batch (one sample per
series, as a probe's collection makes) and of one select of a series, over a 300 s window and whole.
126 series is what one GPU of the replayed H200 makes (gpuwatch_history_series); an 8-GPU node
makes about eight times as many. Run it from another tree's root with PYTHONPATH=<that tree's
parent of gpuwatch/> to compare two versions side by side.
"""
from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History


def measure(n: int, points: int, rounds: int = 15) -> dict:
    h = History(maxlen=points)
    t0 = 1.7e9
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(points):
        ts = t0 + i
        h.append([Sample(f"m{j % 40}", float(i * j) + 0.5, f"GPU-{j // 40}", {}, ts) for j in range(n)])
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    append, window, whole = [], [], []
    for r in range(rounds):
        batch = [Sample(f"m{j % 40}", 1.0, f"GPU-{j // 40}", {}, t0 + points + r) for j in range(n)]
        t = time.perf_counter()
        h.append(batch)
        append.append(time.perf_counter() - t)
        now = t0 + points + r
        for since, out in ((now - 300, window), (None, whole)):
            t = time.perf_counter()
            for j in range(0, n, max(1, n // 20)):
                h.select(f"m{j % 40}", gpu=f"GPU-{j // 40}", since=since)
            out.append((time.perf_counter() - t) / len(range(0, n, max(1, n // 20))))
    return {"series": n, "MiB": held / 2**20, "bytes_a_point": held / (n * points),
            "append_us": statistics.median(append) * 1e6, "select_300s_us": statistics.median(window) * 1e6,
            "select_all_us": statistics.median(whole) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", type=int, nargs="+", default=[126, 1000])
    ap.add_argument("--points", type=int, default=720)
    args = ap.parse_args()
    print(f"{'series':>7} {'held MiB':>9} {'B/point':>8} {'append µs':>10} {'select 300 s µs':>16} {'select all µs':>14}")
    for n in args.series:
        m = measure(n, args.points)
        print(f"{m['series']:>7} {m['MiB']:>9.2f} {m['bytes_a_point']:>8.1f} {m['append_us']:>10.0f} "
              f"{m['select_300s_us']:>16.1f} {m['select_all_us']:>14.1f}")


if __name__ == "__main__":
    main()
