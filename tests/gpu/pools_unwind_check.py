"""Colors from who allocates, through code without frame pointers (issue 33), daemon only, on a GPU.

A real `gpuwatch agent` with its eBPF probe (no `gpuwatch run`, no in-process agent: only the
daemon's allocation stacks say who allocated), then one leak after another, each beside a ballast
that leaves --free-gib of the GPU free, until the leaker's OOM:

  cupy  CuPy arrays kept alive in its default memory pool (tests/gpu/frameworks_program.py leak):
        its chunks are cuMemAlloc'd by libcudart_static inside CuPy's runtime module, called from
        cupy/cuda/memory*.so: grey, allocator "cupy";
  jax   JAX arrays kept alive while XLA's BFC allocator grows its region (no preallocation, so
        the growth reaches the driver): grey, allocator "xla";
  raw   cupy.cuda.runtime.malloc (or libcudart's cudaMalloc through ctypes without CuPy), never
        freed: the same runtime module, but not the pool's: black, allocator "none".

Each must be found with its color and allocator within 90 s of its start, and the time-to-OOM
forecast when found must be within 20 % of the OOM that came. Prints OK/BAD/SKIP lines and a
short table last; pools.json and agent.log go to --out. Exit 0 when all that ran are OK, 1 if
not, 2 when nothing ran. About 90 s a case (--cases to split them over device calls).

Usage: tests/gpu/pools_unwind_check.sh OUTDIR [--cases cupy,jax,raw] [--free-gib 6] [--step-mib 36]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from agent_proc import start_agent  # tests/gpu/agent_proc.py
from frameworks_leak_check import JAX_GROW, PROBES, free_bytes
from gpuwatch.agent import control

HERE = os.path.dirname(os.path.abspath(__file__))
MIB, GIB = 1 << 20, 1 << 30
WANT = {"cupy": ("grey", "cupy"), "jax": ("grey", "xla"), "raw": ("black", "none")}

RAW = r'''
import json, os, sys, time
log, step = open(sys.argv[1], "a", buffering=1), int(sys.argv[2])
def note(**kw):
    log.write(json.dumps(dict(kw, t=time.time(), pid=os.getpid())) + "\n")
try:
    import cupy
    malloc = cupy.cuda.runtime.malloc
    def raw(n):
        return malloc(n)
    OOM = cupy.cuda.runtime.CUDARuntimeError
except ImportError:  # the runtime PyTorch ships, called as user code calls it
    import ctypes, glob, torch
    torch.cuda.init()
    rt = ctypes.CDLL(sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu*", "lib",
                                                   "libcudart.so*")))[0])
    class OOM(Exception):
        pass
    def raw(n):
        p = ctypes.c_void_p()
        if rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)) != 0:
            raise OOM("cudaMalloc failed")
        return p.value
kept = [raw(1 << 20)]
note(event="leak_start", step_bytes=step)
try:
    while True:
        kept.append(raw(step))
        time.sleep(0.5)
except OOM as e:
    note(event="oom", error=str(e)[:200])
    sys.exit(1)
'''


def events(log: str, pid: int) -> dict:
    out = {}
    try:
        with open(log) as f:
            for line in f:
                e = json.loads(line)
                if e.get("pid") == pid:
                    out.setdefault(e["event"], e)
    except OSError:
        pass
    return out


def workload_env(**extra: str) -> dict:
    """The programs' environment: without the agent's bcc libraries (WORKLOAD_* from the .sh)."""
    env = dict(os.environ, **extra)
    for var in ("LD_LIBRARY_PATH", "PYTHONPATH"):
        env.pop(var, None)
        if os.environ.get(f"WORKLOAD_{var}"):
            env[var] = os.environ[f"WORKLOAD_{var}"]
    return env


def usable(fw: str) -> str:
    """"" when the programs' python3 can use the framework on the GPU, else why not."""
    try:
        p = subprocess.run([sys.executable, "-c", PROBES[fw]], capture_output=True, text=True, timeout=180,
                           env=workload_env(**JAX_GROW))
    except subprocess.TimeoutExpired:
        return "its first GPU use did not finish in 180 s"
    return "" if p.returncode == 0 else (p.stderr.strip().splitlines() or ["failed"])[-1][:200]


def ballast(leave: int) -> subprocess.Popen | None:
    """A process holding all but `leave` bytes of the GPU (PyTorch: its caching allocator, not leaking)."""
    n = free_bytes() - leave
    if n <= 0:
        return None
    p = subprocess.Popen([sys.executable, "-c", f"import torch,sys; x = torch.empty({n}, dtype=torch.uint8, "
                          "device='cuda'); print('ready', flush=True); sys.stdin.read()"], env=workload_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    return p


def memory_series(port: int, pid: int) -> dict[str, float]:
    """The daemon's GPU-memory series of process `pid` on its /metrics (NVML's charge, eBPF's live and
    pooled bytes): {'name{labels}': value}."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError as e:
        return {"error": str(e)}
    out = {}
    for line in text.splitlines():
        if f'pid="{pid}"' in line and "memory" in line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def run_case(case: str, sock: str, out: str, a) -> dict:
    log = os.path.join(out, f"{case}.jsonl")
    env = workload_env(**(JAX_GROW if case == "jax" else {}))
    if case == "raw":
        args = [sys.executable, "-c", RAW, log, str(a.step_mib * MIB)]
    else:
        args = [sys.executable, os.path.join(HERE, "frameworks_program.py"), "--framework", case, "--mode", "leak",
                "--step-mib", str(a.step_mib), "--log", log]
    hold = ballast(int(a.free_gib * GIB))
    t0 = time.time()
    p = subprocess.Popen(args, env=env, stdout=open(os.path.join(out, f"{case}.log"), "w"), stderr=subprocess.STDOUT)
    first, seen = None, []
    series = open(os.path.join(out, f"{case}-series.jsonl"), "w")  # what the daemon saw: a miss explains itself
    try:
        while p.poll() is None and time.time() - t0 < a.timeout:
            series.write(json.dumps({"t": time.time(), "series": memory_series(a.port, p.pid)}) + "\n")
            try:
                f = {x["pid"]: x for x in control.call(sock, "findings", {"kind": "memory_leak"}, timeout=5)["open"]}
            except control.ControlError:
                f = {}
            mine = f.get(str(p.pid))
            if mine is not None:
                seen.append({k: mine.get(k) for k in ("color", "allocator", "time_to_oom_seconds", "summary")})
                seen[-1]["ts"] = time.time()
                first = first or seen[-1]
            time.sleep(1)
        p.wait(max(1, a.timeout - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        p.kill()
    finally:
        series.close()
        if hold is not None:
            hold.stdin.close()
            hold.wait(30)
    ev = events(log, p.pid)
    # Out of memory when the allocation that failed was asked for (XLA raises ~10 s later, after retrying).
    start = ev.get("leak_start", {}).get("t", t0)
    oom = ev.get("oom", {}).get("requested_at", ev.get("oom", {}).get("t"))
    r = {"case": case, "pid": p.pid, "first": first, "found_after_s": first["ts"] - start if first else None,
         "oom_after_s": oom - start if oom else None, "looks": len(seen)}
    if first and oom and first.get("time_to_oom_seconds"):
        actual = oom - first["ts"]
        r["forecast_error"] = (first["time_to_oom_seconds"] - actual) / actual if actual > 0 else None
    # The daemon's own OOM event for the process (a driver's refusal is held until the process exits or
    # 15 s show it did not get over it): when it dates the OOM, against when the failing allocation was asked for.
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            ooms = [e for e in control.call(sock, "findings", {"kind": "oom"}, timeout=5).get("ooms", [])
                    if e.get("pid") == str(p.pid)]
        except control.ControlError:
            ooms = []
        if ooms:
            r["daemon_ooms"] = [{k: e.get(k) for k in ("ts", "cause", "came_after_seconds", "forecast_error_ratio",
                                                       "summary")} for e in ooms]
            if oom:
                r["daemon_oom_minus_requested_s"] = round(ooms[0]["ts"] - oom, 1)
            break
        time.sleep(1)
    print(f"{case}: daemon OOM events {r.get('daemon_ooms')}; first minus the failing request "
          f"{r.get('daemon_oom_minus_requested_s')} s", flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="cupy,jax,raw")
    ap.add_argument("--free-gib", type=float, default=6.0)
    ap.add_argument("--step-mib", type=int, default=36, help="every 0.5 s (36: 4.2 GiB a minute)")
    ap.add_argument("--timeout", type=float, default=150.0)
    ap.add_argument("--port", type=int, default=9431)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpuwatch-pools-")
    results: list[tuple[bool | None, str]] = []
    rows = []
    agent, sock = start_agent(work, a.port, ebpf=True)
    try:
        time.sleep(5)  # the probe attached
        for case in a.cases.split(","):
            why = usable(case) if case != "raw" else ""
            if why:
                results.append((None, f"SKIP {case}: {why}"))
                continue
            r = run_case(case, sock, a.out, a)
            rows.append(r)
            color, allocator = WANT[case]
            f = r["first"] or {}
            ok = (f.get("color"), f.get("allocator")) == (color, allocator) and (r["found_after_s"] or 1e9) <= 90
            err = r.get("forecast_error")
            ok_f = err is not None and abs(err) <= 0.2
            results.append((ok, f"{case}: {f.get('color')} / {f.get('allocator')!r} (want {color} / {allocator!r}) "
                                f"after {r['found_after_s'] if r['found_after_s'] is None else round(r['found_after_s'])} s "
                                f"(limit 90): {f.get('summary')}"))
            results.append((ok_f, f"{case}: forecast error {err if err is None else f'{err:+.0%}'} (limit 20 %), "
                                  f"OOM {r['oom_after_s'] if r['oom_after_s'] is None else round(r['oom_after_s'])} s "
                                  f"after the leak began"))
    finally:
        agent.terminate()
        agent.wait(30)
        os.system(f"cp {work}/agent.log {a.out}/agent.log 2>/dev/null")
        with open(os.path.join(a.out, "pools.json"), "w") as fh:
            json.dump(rows, fh, indent=1, default=str)
    for ok, line in results:
        print(("SKIP " if ok is None else "OK   " if ok else "BAD  ") + line.removeprefix("SKIP "))
    print(f"\n{'case':5s} {'color':6s} {'allocator':10s} {'found s':>8s} {'OOM s':>6s} {'forecast err':>12s}")
    for r in rows:
        f = r["first"] or {}
        err = r.get("forecast_error")
        print(f"{r['case']:5s} {str(f.get('color')):6s} {str(f.get('allocator')):10s} "
              f"{'-' if r['found_after_s'] is None else round(r['found_after_s']):>8} "
              f"{'-' if r['oom_after_s'] is None else round(r['oom_after_s']):>6} {'-' if err is None else f'{err:+.0%}':>12s}")
    ran = [ok for ok, _ in results if ok is not None]
    return 2 if not ran else 0 if all(ran) else 1


if __name__ == "__main__":
    raise SystemExit(main())
