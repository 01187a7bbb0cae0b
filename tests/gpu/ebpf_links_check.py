"""The eBPF probe's start, stop and memory on a GPU machine, with a PyTorch job running (root, bcc
importable: tests/gpu/ebpf_links_check.sh).

- `gpuwatch trace -p PID --duration 2`: ready (spawn to "tracing PID") with an empty compile cache
  and with the cache, and how long after the 2 s it is back; after SIGINT; after the process exits.
- The daemon (`gpuwatch agent`, default probes but CUPTI and baseline) for --seconds with the job
  running: RSS, PSS (anonymous and file-backed) and CPU per second, with eBPF on and with --no-ebpf,
  and how long it takes to stop after SIGTERM.

Prints a table last; the whole record goes to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import workload

JOB = r'''
import sys, time, torch
model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(2048, 2048), torch.nn.GELU())]).cuda()
opt = torch.optim.AdamW(model.parameters())
data = torch.randn(256, 2048, device="cuda")
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    opt.zero_grad(set_to_none=True)
    model(data).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
'''


def start_job(seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", JOB, str(seconds)], stdout=subprocess.PIPE, text=True, env=workload.env())
    assert p.stdout.readline().strip() == "ready"
    return p


def trace(pid: int, cache: str, *, duration: float | None = None, interrupt_after: float | None = None,
          until_exit: subprocess.Popen | None = None) -> dict:
    env = dict(os.environ, GPUWATCH_BPF_CACHE=cache)
    cmd = [sys.executable, "-m", "gpuwatch.agent.cli", "trace", "-p", str(pid)]  # root: standalone
    if duration:
        cmd += ["--duration", str(duration)]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ready = None
    lines = []
    for line in p.stderr:
        lines.append(line)
        if line.startswith("tracing PID"):
            ready = time.monotonic() - t0
            break
    out: dict = {"ready_s": round(ready, 3) if ready is not None else None, "attached": lines[-1].strip()[:300]}
    if ready is None:
        p.wait(30)
        out["error"] = "".join(lines)[-2000:]
        return out
    if interrupt_after is not None:
        time.sleep(interrupt_after)
        t1 = time.monotonic()
        p.send_signal(signal.SIGINT)
    elif until_exit is not None:
        until_exit.wait(120)
        t1 = time.monotonic()
    else:
        t1 = t0 + ready + duration
    rest, err = p.communicate(timeout=120)
    out["back_after_s"] = round(time.monotonic() - t1, 3)
    out["rc"] = p.returncode
    out["stderr_tail"] = err[-600:]
    return out


def smaps(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss", "Pss_Anon", "Pss_File", "Anonymous"):
                out[k] = round(int(v.split()[0]) / 1024, 1)
    return out


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def daemon(ebpf: bool, seconds: float, port: int, cache: str) -> dict:
    work = tempfile.mkdtemp(prefix="gpuwatch-links-")
    cmd = [sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "", "--listen", f"127.0.0.1:{port}",
           "--state-dir", os.path.join(work, "state"), "--runtime-dir", os.path.join(work, "run"),
           "--no-cupti-sampling", "--no-baseline"] + ([] if ebpf else ["--no-ebpf"])
    log = open(os.path.join(work, "agent.log"), "w+")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, GPUWATCH_BPF_CACHE=cache))
    time.sleep(5)  # started, first collections done (the cache holds the compiled probe)
    c0, t0 = cpu_seconds(p.pid), time.monotonic()
    time.sleep(seconds)
    out = {"cpu_percent": round(100 * (cpu_seconds(p.pid) - c0) / (time.monotonic() - t0), 3), **smaps(p.pid)}
    t1 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    p.wait(60)
    out["stop_s"] = round(time.monotonic() - t1, 3)
    log.seek(0)
    text = log.read()
    out["log_tail"] = [line for line in text.splitlines() if "eBPF" in line or "detached" in line or "ebpf" in line][-6:]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0, help="daemon measurement per configuration")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    result: dict = {"date": time.strftime("%Y-%m-%d"), "kernel": os.uname().release}
    try:
        result["driver"] = open("/sys/module/nvidia/version").read().strip()
    except OSError:
        pass
    cold = tempfile.mkdtemp(prefix="gpuwatch-cache-")
    job = start_job(600)
    try:
        result["trace_cold"] = trace(job.pid, cold, duration=2)
        result["trace_cached"] = trace(job.pid, cold, duration=2)
        result["trace_sigint"] = trace(job.pid, cold, interrupt_after=1.0)
        short = start_job(3)
        result["trace_process_exit"] = trace(short.pid, cold, until_exit=short)
        result["daemon_ebpf"] = daemon(True, a.seconds, 19871, cold)
        result["daemon_no_ebpf"] = daemon(False, a.seconds, 19872, cold)
    finally:
        job.kill()
        job.wait()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1)[-6000:])
    print(f"\n{'trace':22s} {'ready s':>8s} {'back after s':>13s}")
    for k in ("trace_cold", "trace_cached", "trace_sigint", "trace_process_exit"):
        r = result[k]
        print(f"{k:22s} {r.get('ready_s')!s:>8s} {r.get('back_after_s')!s:>13s}")
    print(f"\n{'daemon':16s} {'RSS MiB':>8s} {'PSS MiB':>8s} {'anon':>6s} {'file':>6s} {'CPU %':>7s} {'stop s':>7s}")
    for k in ("daemon_ebpf", "daemon_no_ebpf"):
        r = result[k]
        print(f"{k:16s} {r.get('Rss')!s:>8s} {r.get('Pss')!s:>8s} {r.get('Pss_Anon')!s:>6s} {r.get('Pss_File')!s:>6s} "
              f"{r['cpu_percent']:>7.3f} {r['stop_s']:>7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
