"""What the NVML probe costs the daemon resident, call by call, on a real GPU (issue 36).

    python3 tests/gpu/nvml_memory.py        (on the GPU machine; round_check.sh nvml_memory)

Every pynvml function is wrapped so that its first call records the resident memory it added
(VmRSS, RssAnon, threads) and whether libcuda or another library became mapped with it. Then the
daemon's NVML probe runs as the daemon runs it: start (nvmlInit, the XID thread), three
collections (fast, slow and static all due on the first), 2 s for the XID thread to wait, stop.
Prints the calls that added the most, the libraries each mapped, and the totals.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def state() -> tuple[float, float, int, frozenset[str]]:
    with open("/proc/self/status") as f:
        st = dict(line.split(":", 1) for line in f if ":" in line)
    with open("/proc/self/maps") as f:
        libs = frozenset(os.path.basename(p[5]) for p in (line.split() for line in f) if len(p) > 5 and ".so" in p[5])
    return (int(st["VmRSS"].split()[0]) / 1024, int(st["RssAnon"].split()[0]) / 1024, int(st["Threads"]), libs)


def main() -> int:
    start = state()
    import pynvml as N

    imported = state()
    first: dict[str, tuple[float, float, int, list[str]]] = {}
    lock = threading.Lock()

    def wrap(name, fn):
        @functools.wraps(fn)
        def call(*a, **k):
            if name in first:
                return fn(*a, **k)
            before = state()
            try:
                return fn(*a, **k)
            finally:
                after = state()
                with lock:
                    first.setdefault(name, (after[0] - before[0], after[1] - before[1], after[2] - before[2],
                                            sorted(after[3] - before[3])))
        return call

    for name in dir(N):
        fn = getattr(N, name)
        if name.startswith("nvml") and callable(fn) and not isinstance(fn, type):
            setattr(N, name, wrap(name, fn))

    from gpuwatch.probes.nvml.backend import RealBackend
    from gpuwatch.probes.nvml.probe import NvmlProbe

    modules = state()
    p = NvmlProbe(RealBackend, interval=1.0, slow_interval=1.0)
    p.start()
    started = state()
    for _ in range(3):
        n = len(p.collect())
        time.sleep(0.3)
    collected = state()
    time.sleep(2.0)
    waited = state()
    p.shutdown()
    stopped = state()

    print(f"{'step':34} {'VmRSS MiB':>10} {'RssAnon':>8} {'threads':>8}  libraries newly mapped")
    prev = start
    for label, s in (("python", start), ("import pynvml", imported), ("import the probe", modules),
                     ("start (nvmlInit, XID thread)", started), (f"3 collections ({n} samples)", collected),
                     ("2 s later", waited), ("shutdown", stopped)):
        print(f"{label:34} {s[0]:>10.1f} {s[1]:>8.1f} {s[2]:>8d}  {', '.join(sorted(s[3] - prev[3]))[:90]}")
        prev = s
    print(f"\nfirst calls that added most (of {len(first)} functions called)")
    print(f"{'function':44} {'+RSS MiB':>9} {'+anon':>7} {'+thr':>5}  libraries mapped")
    for name, (rss, anon, thr, libs) in sorted(first.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"{name:44} {rss:>9.2f} {anon:>7.2f} {thr:>5d}  {', '.join(libs)[:60]}")
    mapped = [(name, libs) for name, (_, _, _, libs) in first.items() if any("libcuda" in x for x in libs)]
    print("\nlibcuda mapped by: " + (", ".join(n for n, _ in mapped) if mapped else
                                     "no NVML call" + (" (mapped before)" if any("libcuda" in x for x in start[3]) else "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
