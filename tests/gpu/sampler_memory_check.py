"""What the CUPTI sampler's CUDA context costs each GPU, for each way of making it (issue 34).

For each way — cuda.bindings' runtime (the default), libcudart through ctypes, PyTorch — with lazy
and eager module loading, and with a small per-thread stack limit:
  context   a process that only makes the context the sampler's way and waits: NVML's per-process
            used memory for it, and the GPU's used memory before/after;
  sampler   the real sampler child (python -X faulthandler -m gpuwatch.probes.cupti.sampler) made
            that way: whether its hello came (enable() returned, no hang: a timeout), whether
            values came, its per-process memory while it samples, how it ended (a crash's line).
One variant runs the sampler without preloading the newest libcupti (--no-preload), to see
whether that is what crashed PM sampling's enable on the H200 before.

Usage (repo root, GPU machine, CUPTI wheels from .whl/ via tests/gpu/env.sh):
    source tests/gpu/env.sh; python3 tests/gpu/sampler_memory_check.py --out "$OUT"
Prints a table last; writes $OUT/sampler_memory.json. About 2-3 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

import pynvml as N

from gpuwatch.probes.cupti.devicewide import child_env, crash_summary

MIB = 1 << 20
CONTEXT_ONLY = r"""
import os, sys, time
from gpuwatch.probes.cupti.sampler import Sampler, make_context
from cuda.bindings import runtime as rt
how, stack = sys.argv[1], int(sys.argv[2])
call = lambda rt_, name, *a: Sampler._rt(None, rt_, name, *a)
make_context(how, rt, 0, call)
if stack >= 0:
    call(rt, "cudaDeviceSetLimit", rt.cudaLimit.cudaLimitStackSize, stack)
# Further limits to try, "NAME=BYTES,..." (cudaLimitMallocHeapSize, cudaLimitPrintfFifoSize, ...).
for kv in filter(None, os.environ.get("GW_LIMITS", "").split(",")):
    name, value = kv.split("=")
    call(rt, "cudaDeviceSetLimit", getattr(rt.cudaLimit, name), int(value))
print("ready", flush=True)
time.sleep(60)
"""

# (label, context way, CUDA_MODULE_LOADING, stack bytes or -1, extra sampler args)
WAYS = [
    ("bindings lazy", "bindings", "LAZY", -1, []),
    ("bindings lazy stack 256", "bindings", "LAZY", 256, []),
    ("bindings lazy stack 0", "bindings", "LAZY", 0, []),
    ("bindings lazy stack 16", "bindings", "LAZY", 16, []),
    ("bindings eager", "bindings", "EAGER", -1, []),
    ("cudart lazy", "cudart", "LAZY", -1, []),
    ("torch lazy", "torch", "LAZY", -1, []),
    ("bindings lazy no-preload", "bindings", "LAZY", -1, ["--no-preload"]),
]


def used(handle) -> float:
    return N.nvmlDeviceGetMemoryInfo(handle).used / MIB


def per_process(handle, pid: int) -> float | None:
    for p in N.nvmlDeviceGetComputeRunningProcesses(handle):
        if p.pid == pid:
            return (p.usedGpuMemory or 0) / MIB
    return None


def wait_line(proc: subprocess.Popen, want, timeout: float) -> tuple[dict | str | None, list]:
    """Read stdout lines until want(line) or timeout; returns (the line, all lines read)."""
    end, lines, buf = time.monotonic() + timeout, [], b""
    fd = proc.stdout.fileno()
    while time.monotonic() < end:
        r, _, _ = select.select([fd], [], [], max(0.0, min(0.5, end - time.monotonic())))
        if not r:
            if proc.poll() is not None:
                break
            continue
        data = os.read(fd, 65536)
        if not data:
            break
        buf += data
        while b"\n" in buf:
            raw, buf = buf.split(b"\n", 1)
            text = raw.decode(errors="replace").strip()
            try:
                item = json.loads(text)
            except ValueError:
                item = text
            lines.append(item)
            if want(item):
                return item, lines
    return None, lines


def stop(proc: subprocess.Popen) -> tuple[int | None, str]:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    return proc.returncode, err


def measure_context(handle, how: str, loading: str, stack: int, timeout: float) -> dict:
    env = dict(child_env(), CUDA_MODULE_LOADING=loading)
    before = used(handle)
    t = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", CONTEXT_ONLY, how, str(stack)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    ready, _ = wait_line(p, lambda x: x == "ready", timeout)
    out = {"ready": ready is not None, "seconds": round(time.monotonic() - t, 2)}
    if ready:
        time.sleep(1.0)
        out.update(process_mib=per_process(handle, p.pid), device_delta_mib=round(used(handle) - before, 1))
    rc, err = stop(p)
    out.update(rc=rc, error="" if ready else (crash_summary(err) or err.strip()[-300:]))
    return out


def measure_sampler(handle, how: str, loading: str, stack: int, extra: list[str], seconds: float,
                    timeout: float) -> dict:
    env = dict(child_env(), CUDA_MODULE_LOADING=loading)
    before = used(handle)
    t = time.monotonic()
    cmd = [sys.executable, "-X", "faulthandler", "-m", "gpuwatch.probes.cupti.sampler", "--devices", "0",
           "--group-seconds", "0.5", "--context", how, "--stack-bytes", str(stack), *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    hello, lines = wait_line(p, lambda x: isinstance(x, dict) and x.get("type") in ("hello", "fatal"), timeout)
    out = {"hello": isinstance(hello, dict) and hello.get("type") == "hello",
           "hello_seconds": round(time.monotonic() - t, 2), "enable_hung": hello is None and p.poll() is None}
    if out["hello"]:
        out.update(libcupti=hello.get("libcupti"), preloaded=hello.get("preloaded"), context=hello.get("context"))
        value, more = wait_line(p, lambda x: isinstance(x, dict) and x.get("type") == "value", seconds + 5)
        lines += more
        out["first_value_seconds"] = round(time.monotonic() - t, 2) if value else None
        time.sleep(1.0)
        out.update(process_mib=per_process(handle, p.pid), device_delta_mib=round(used(handle) - before, 1))
        _, more = wait_line(p, lambda x: False, seconds)
        lines += more
    rc, err = stop(p)
    values = [x for x in lines if isinstance(x, dict) and x.get("type") == "value"]
    other = [x for x in lines if isinstance(x, dict) and x.get("type") in ("fatal", "error", "unsupported", "busy")]
    out.update(rc=rc, values=len(values), means={v["group"]: v["mean"] for v in values},
               other=[f"{x.get('type')}: {str(x.get('error'))[:200]}" for x in other[:4]],
               crash=crash_summary(err) if rc not in (0, None) else "")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seconds", type=float, default=3.0, help="sampling time per sampler variant")
    ap.add_argument("--timeout", type=float, default=45.0, help="hello/ready timeout (a hang in enable shows here)")
    a = ap.parse_args()
    N.nvmlInit()
    handle = N.nvmlDeviceGetHandleByIndex(0)
    idle = used(handle)
    results = []
    for label, how, loading, stack, extra in WAYS:
        row = {"way": label, "context": how, "module_loading": loading, "stack_bytes": stack, "extra": extra}
        if not extra:
            row["context_only"] = measure_context(handle, how, loading, stack, a.timeout)
            print(label, "context only:", row["context_only"], flush=True)
        row["sampler"] = measure_sampler(handle, how, loading, stack, extra, a.seconds, a.timeout)
        print(label, "sampler:", row["sampler"], flush=True)
        results.append(row)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sampler_memory.json"), "w") as f:
        json.dump({"idle_used_mib": idle, "results": results}, f, indent=1)
    print(f"\nGPU 0 used {idle:.0f} MiB before; MiB per process from NVML (device delta in brackets)")
    print(f"{'way':26} {'context only':>16} {'sampler':>16} {'hello s':>8} {'1st value s':>11} {'values':>6} "
          f"{'rc':>4}  note")
    for r in results:
        c, s = r.get("context_only", {}), r["sampler"]

        def mib(d):
            if d.get("process_mib") is None:
                return "-"
            return f"{d['process_mib']:.0f} [{d.get('device_delta_mib', 0):.0f}]"
        note = s.get("crash") or ("enable() HUNG" if s.get("enable_hung") else "") or "; ".join(s.get("other", []))[:60]
        if c and not c.get("ready"):
            note = f"context: {c.get('error', '')[:50]} " + note
        print(f"{r['way']:26} {mib(c) if c else 'n/a':>16} {mib(s):>16} {s.get('hello_seconds', '-'):>8} "
              f"{str(s.get('first_value_seconds', '-')):>11} {s.get('values', 0):>6} {str(s.get('rc')):>4}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
