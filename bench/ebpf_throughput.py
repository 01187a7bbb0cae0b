"""How many hooked CUDA driver calls per second the eBPF probe counts exactly, and how many
per-call events per second go through its ring buffer (with drops counted).

Builds bench/hooked_calls.c against the fake libcuda of the tests (tests/ebpf/fakecuda.c: the true
signatures, no GPU), or uses prebuilt ones (--build-dir, e.g. built on another machine), runs it
with T threads x N calls, once with no probe, once with the default probe (counting; launches
entry-only), once with per-call events (`trace --output`: entry+return, one ring-buffer record per
call). Prints one table: calls/s, ns added per call, counted/expected, events recorded + dropped.

  sudo .venv/bin/python bench/ebpf_throughput.py [--threads 8] [--calls 500000] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(d: Path) -> tuple[str, str]:
    d = d.resolve()  # bcc looks a library path without a leading "/" up as a library name
    lib, prog = d / "libcuda.so.1", d / "hooked_calls"
    if lib.exists() and prog.exists():
        return str(lib), str(prog)
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        sys.exit("no C compiler: install gcc, or pass --build-dir with prebuilt libcuda.so.1 and hooked_calls")
    d.mkdir(parents=True, exist_ok=True)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                    str(ROOT / "tests/ebpf/fakecuda.c")], check=True)
    subprocess.run([cc, "-O2", "-pthread", "-o", str(prog), str(ROOT / "bench/hooked_calls.c"), f"-L{d}",
                    "-l:libcuda.so.1", "-Wl,-rpath,$ORIGIN"], check=True)
    return str(lib), str(prog)


def run_once(prog: str, mode: str, threads: int, calls: int, probe_factory=None) -> dict:
    p = subprocess.Popen([prog, mode, str(threads), str(calls)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    pid = int(p.stdout.readline().split()[1])
    probe = probe_factory(pid) if probe_factory else None
    try:
        if probe:
            probe.start()
        p.stdin.write("go\n")
        p.stdin.flush()
        seconds = float(p.stdout.readline().split()[1])
        p.stdin.close()
        p.wait(30)
        out = {"seconds": seconds, "calls": threads * calls}
        if probe:
            events = probe.stop_events()
            snap = probe.snapshot(pid)
            api = "cuStreamSynchronize" if mode == "sync" else "cuLaunchKernel"
            out["counted"] = snap["apis"].get(api, {}).get("calls", 0)
            out["dropped"] = snap["dropped_events"]
            if events is not None:
                out["events"] = events
    finally:
        if probe:
            probe.shutdown(wait=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--calls", type=int, default=500_000, help="calls per thread")
    ap.add_argument("--build-dir", type=Path)
    ap.add_argument("--out")
    a = ap.parse_args()
    from gpuwatch.probes.ebpf import EbpfCudaProbe
    lib, prog = build(a.build_dir or Path(tempfile.mkdtemp(prefix="gpuwatch-bench-")))
    rows = {}
    n = a.threads * a.calls
    rows["launch, no probe"] = run_once(prog, "launch", a.threads, a.calls)
    rows["launch, probe (entry-only)"] = run_once(
        prog, "launch", a.threads, a.calls, lambda pid: EbpfCudaProbe(libraries=[lib], pid=pid, driver_names=False))
    rows["sync, no probe"] = run_once(prog, "sync", a.threads, a.calls)
    rows["sync, probe (entry+return)"] = run_once(
        prog, "sync", a.threads, a.calls, lambda pid: EbpfCudaProbe(libraries=[lib], pid=pid, driver_names=False))
    raw = tempfile.mktemp(prefix="gpuwatch-events-")
    rows["sync, probe + events"] = run_once(
        prog, "sync", a.threads, a.calls,
        lambda pid: EbpfCudaProbe(libraries=[lib], pid=pid, driver_names=False, events_path=raw, max_events=n))
    os.unlink(raw)
    base = {"launch": rows["launch, no probe"]["seconds"], "sync": rows["sync, no probe"]["seconds"]}
    print(f"{a.threads} threads x {a.calls} calls = {n} calls per run, {os.cpu_count()} CPUs")
    print(f"{'run':30s} {'calls/s':>12s} {'ns/call added':>14s} {'counted':>10s} {'events rec+drop':>16s}")
    for name, r in rows.items():
        r["calls_per_second"] = round(r["calls"] / r["seconds"])
        mode = name.split(",")[0]
        added = (r["seconds"] - base[mode]) / r["calls"] * a.threads * 1e9  # per call, per thread's timeline
        r["ns_added_per_call"] = round(added, 1) if "no probe" not in name else 0.0
        ev = r.get("events")
        evs = f"{ev['recorded']}+{r['dropped']}" if ev else "-"
        if ev:
            r["events_per_second"] = round(ev["recorded"] / r["seconds"])
        counted = "-" if "counted" not in r else ("exact" if r["counted"] == r["calls"] else f"{r['counted']}")
        print(f"{name:30s} {r['calls_per_second']:>12,} {r['ns_added_per_call']:>14} {counted:>10s} {evs:>16s}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"threads": a.threads, "calls_per_thread": a.calls, "cpus": os.cpu_count(), "rows": rows}, f,
                      indent=1)
    ok = all(r.get("counted", r["calls"]) == r["calls"] for r in rows.values())
    ev = rows["sync, probe + events"]
    ok &= ev["events"]["recorded"] + ev["dropped"] + ev["events"]["not_written"] == ev["calls"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
