"""What allocation stack copies cost (probes/ebpf/unwind.py, cuda.bpf.c gw_copy_stack), side by side.

Real uprobes on the fake libcuda of the tests (tests/ebpf/fakecuda.c) or, with --libcuda, on a
real one (H200). bench/alloc_stacks.c makes cuMemAlloc_v2 + cuMemFree_v2 pairs and reports its
thread CPU time per pair (a uprobe's time is the thread's system time). Each round starts a fresh
process per state, the states' order rotated round by round:

  none        no probe attached
  copies off  the probe, this process's copies used up (USTACKS_PER_PID): the frame-pointer walk only
  seen        the probe, every allocation from one stack: copied once, then one hash lookup each
  copy        the probe, every allocation from a new stack depth: an 8 KiB copy each (the worst case)

and in the agent (this process, as the daemon's loader): CPU time per stack unwound by
Loader.unwind_copies (the first round parses the binaries: "cold"), and RSS per stack kept.

  sudo .venv/bin/python bench/stack_cost.py [--rounds 15] [--pairs 250] [--libcuda PATH] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(d: Path, libcuda: str | None) -> tuple[str, str]:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        sys.exit("no C compiler: install gcc")
    lib = Path(libcuda) if libcuda else d / "libcuda.so.1"
    if not libcuda:
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                        str(ROOT / "tests/ebpf/fakecuda.c")], check=True)
    prog = d / "alloc_stacks"
    subprocess.run([cc, "-O2", "-fomit-frame-pointer", "-o", str(prog), str(ROOT / "bench/alloc_stacks.c"),
                    f"-L{lib.parent}", "-l:libcuda.so.1", f"-Wl,-rpath,{lib.parent}"], check=True)
    return str(lib.resolve()), str(prog)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def spread(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": round(statistics.median(xs), 2), "p25": round(q[0], 2), "p75": round(q[2], 2), "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pairs", type=int, default=250, help="allocations per process (< USTACKS_PER_PID)")
    ap.add_argument("--libcuda", help="hook this libcuda (default: build the tests' fake one)")
    ap.add_argument("--out")
    a = ap.parse_args()
    from gpuwatch.probes.ebpf import loader, symbols

    d = Path(tempfile.mkdtemp(prefix="gpuwatch-stack-cost-"))
    lib, prog = build(d, a.libcuda)
    ld = loader.Loader()
    states = ("none", "copies off", "seen", "copy")
    per_pair: dict[str, list[float]] = {s: [] for s in states}
    unwind_cpu: list[float] = []
    frames: list[int] = []
    cold = None
    rss0 = rss_kib()
    cap = symbols.ctype("u32")(symbols.USTACKS_PER_PID)
    try:
        for r in range(a.rounds):
            for state in states[r % 4:] + states[:r % 4]:
                p = subprocess.Popen([prog], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                pid = int(p.stdout.readline().split()[1])
                if state == "none":
                    ld.detach(loader.file_id(lib))
                else:
                    ld.attach(lib)
                if state == "copies off":
                    ld.maps["ustack_count"].update(symbols.ctype("u32")(pid), cap)
                if state == "seen":
                    p.stdin.write("1 0\n")  # the one stack's copy made
                    p.stdin.flush()
                    p.stdout.readline()
                p.stdin.write(f"{a.pairs} {0 if state == 'seen' else 1}\n")
                p.stdin.flush()
                per_pair[state].append(float(p.stdout.readline()))
                if state == "copy":  # unwound now, while the process and its mappings are there
                    before = len(ld._unwound)
                    c0 = time.process_time()
                    n = ld.unwind_copies()
                    took = (time.process_time() - c0) / max(n, 1)
                    frames += [len(v) for v in list(ld._unwound.values())[before:]]
                    if cold is None:
                        cold = took
                    else:
                        unwind_cpu.append(took)
                ld.unwind_copies()
                p.stdin.close()
                p.wait(10)
                if state != "copy":  # (the copy rounds' stacks stay: the RSS they take is measured)
                    ld.forget({pid})
        kept = len(ld._unwound)
        rss1 = rss_kib()
        dropped = ld.dropped_by_kind().get("stack_copies", 0)
    finally:
        ld.close()
        shutil.rmtree(d, ignore_errors=True)
    res = {"libcuda": lib, "pairs_per_process": a.pairs, "rounds": a.rounds,
           "per_pair_ns": {s: spread(v) for s, v in per_pair.items()},
           "unwind_us_per_stack": {"cold": round((cold or 0) * 1e6, 1), "warm": spread([x * 1e6 for x in unwind_cpu])},
           "frames_per_stack": round(statistics.mean(frames), 1) if frames else 0,
           "stacks_kept": kept, "agent_rss_kib": {"before": rss0, "after": rss1,
                                                  "per_stack_bytes": round((rss1 - rss0) * 1024 / max(kept, 1))},
           "budget_bytes_per_stack": loader.UNWOUND_BYTES + loader.UNWOUND_FRAME_BYTES * round(
               statistics.mean(frames) if frames else 0),
           "kernel_copy_bytes": ctypes.sizeof(symbols.ctype("gw_ustack")), "stack_copies_dropped": dropped}
    base = per_pair["none"]
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"per cuMemAlloc_v2+cuMemFree_v2 pair, thread CPU ns ({a.rounds} processes x {a.pairs} pairs each state)")
    print(f"{'state':12s} {'median':>9s} {'p25':>9s} {'p75':>9s} {'vs none':>9s}")
    for s in states:
        r = res["per_pair_ns"][s]
        print(f"{s:12s} {r['median']:>9.1f} {r['p25']:>9.1f} {r['p75']:>9.1f} {r['median'] - statistics.median(base):>+9.1f}")
    w = res["unwind_us_per_stack"]
    print(f"unwinding in the agent, CPU per stack: cold (binaries parsed) {w['cold']:.1f} us; warm median "
          f"{w['warm']['median']:.1f} us (p25 {w['warm']['p25']:.1f}, p75 {w['warm']['p75']:.1f}); "
          f"{res['frames_per_stack']} frames a stack")
    print(f"agent RSS {rss0} -> {rss1} KiB for {kept} stacks kept ({res['agent_rss_kib']['per_stack_bytes']} B each; "
          f"budget charge {res['budget_bytes_per_stack']} B each); a copy in the kernel {res['kernel_copy_bytes']} B "
          f"(<= {symbols.MAP_SIZES['USTACK_COPIES_MAX']} waiting); copies dropped {dropped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
