"""The eBPF stack map on a node that has run many processes: how many of a new process's stacks are
lost to the buckets of dead ones, with the reclaim (Loader.reclaim_stacks) and with it off, and what
a reclaim costs.

Five processes of tests/ebpf/stackflood.c allocate from 4,096 distinct stacks each and exit; then,
five times, a process allocates from 256 and exits. Last, one process holds 4,096 stacks at once: how
many its own collisions sent to the overflow map, and how many were lost. A stack id is the stack's hash modulo the map's
16,384 buckets: a stack whose bucket holds another is lost (bpf_get_stackid: -EEXIST), counted in
dropped_by_kind "allocation_stacks".

  sudo .venv/bin/python bench/stack_reclaim.py

Needs root, bcc, kernel headers and gcc (as the eBPF tests).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.ebpf.conftest import _build  # noqa: E402

from gpuwatch.probes.ebpf import loader  # noqa: E402
from gpuwatch.probes.ebpf.probe import EbpfCudaProbe  # noqa: E402


def run(lib: str, flood: str, reclaim: bool, checks: int) -> dict:
    p = EbpfCudaProbe(libraries=[lib], rescan_interval=3600)
    p.start()
    ld = p._loader
    if not reclaim:
        ld.reclaim_stacks = lambda idle_ns=0: set()  # the stacks stay, as before the reclaim
    lost = lambda: ld.dropped_by_kind().get("allocation_stacks", 0)  # noqa: E731
    timings: list[float] = []
    real = loader.Loader.reclaim_stacks

    def timed(idle_ns: int = loader.STACK_IDLE_NS) -> set[int]:
        t0 = time.perf_counter()
        try:
            return real(ld, idle_ns)
        finally:
            timings.append(time.perf_counter() - t0)
    if reclaim:
        ld.reclaim_stacks = timed

    def settle() -> None:  # the collection that sees the process gone, then the follow-up
        p.collect()
        time.sleep(loader.STACK_IDLE_NS / 1e9 + 0.1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            p.collect()
            if not reclaim or not ld.maps["stacks"].keys():
                break
            time.sleep(0.2)
    try:
        for _ in range(5):
            subprocess.run([flood, "4096", "free"], check=True)
        ids_after_floods = len(ld.maps["stacks"].keys())
        settle()
        ids_settled = len(ld.maps["stacks"].keys())
        per_check = []
        for _ in range(checks):
            before = lost()
            subprocess.run([flood, "256", "free"], check=True)
            per_check.append(lost() - before)
            settle()
        return {"ids_after_floods": ids_after_floods, "ids_after_reclaim": ids_settled, "lost_of_256": per_check,
                "reclaim_ms": [round(t * 1e3, 2) for t in timings]}
    finally:
        p.shutdown()


def dense(lib: str, flood: str) -> dict:
    """One running process holding 4,096 stacks: how many its own collisions sent to the overflow map,
    and how many were lost all the same."""
    p = EbpfCudaProbe(libraries=[lib], rescan_interval=3600)
    p.start()
    try:
        ld = p._loader
        before = ld.dropped_by_kind().get("allocation_stacks", 0)
        proc = subprocess.Popen([flood, "4096", "keep"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "done"
        ids = {sid for pid, _s, sid, _c, _sp in ld._live_records() if pid == proc.pid}
        lost = ld.dropped_by_kind().get("allocation_stacks", 0) - before
        proc.stdin.close()
        proc.wait()
        return {"overflow": sum(1 for sid in ids if sid >= loader.symbols.MAP_SIZES["STACKS_MAX"]), "lost": lost}
    finally:
        p.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checks", type=int, default=5)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="gpuwatch-stack-reclaim-"))
    try:
        lib = _build(d)["lib"]
        flood = d / "stackflood"
        subprocess.run(["gcc", "-O0", "-fno-omit-frame-pointer", "-o", str(flood), str(ROOT / "tests/ebpf/stackflood.c"),
                        f"-L{d}", "-l:libcuda.so.1", f"-Wl,-rpath,{d}"], check=True)
        print(f"{'':28} {'reclaim on':>24} {'reclaim off':>24}")
        on = run(lib, str(flood), True, args.checks)
        off = run(lib, str(flood), False, args.checks)
        for key, what in (("ids_after_floods", "stack ids after 5 floods"), ("ids_after_reclaim", "... once they are gone")):
            print(f"{what:28} {on[key]:>24} {off[key]:>24}")
        print(f"{'lost of a new 256 (each)':28} {str(on['lost_of_256']):>24} {str(off['lost_of_256']):>24}")
        print(f"{'median lost of 256':28} {statistics.median(on['lost_of_256']):>24} "
              f"{statistics.median(off['lost_of_256']):>24}")
        print(f"reclaim durations (ms): {on['reclaim_ms']}")
        one = dense(lib, str(flood))
        print(f"one running process of 4,096 stacks: {one['overflow']} in the overflow map (their bucket in the "
              f"first was taken: lost without it), {one['lost']} lost")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
