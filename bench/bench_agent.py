"""Agent cost: CPU time per tick, CPU and latency per scrape, RSS.

Runs `gpuwatch agent` as a subprocess, replaying a recorded NVML fixture as N GPUs
with K processes each (default 8 x 8 = 64 GPU processes), and measures it from
outside with psutil, the way an operator would see it:

  python3 bench/bench_agent.py --fixture tests/fixtures/nvml-h200.json --gpus 8 --procs-per-gpu 8

Without --fixture it runs against the real NVML of this machine.
Writes a JSON result (--out) and prints a short table. Medians and percentiles are
from one run; the goal from issue 2: <= 5 ms CPU per tick, scrape p99 <= 10 ms, RSS <= 80 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a Prometheus 2.x server sends: it prefers OpenMetrics.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def get(url: str) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", help="recorded NVML file to replay (default: real NVML)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--procs-per-gpu", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0, help="NVML probe interval, seconds")
    ap.add_argument("--idle-seconds", type=float, default=30.0, help="how long to measure ticks alone")
    ap.add_argument("--scrapes", type=int, default=300, help="back-to-back scrapes")
    ap.add_argument("--cold-scrapes", type=int, default=30, help="scrapes one interval apart (new snapshot each)")
    ap.add_argument("--no-ebpf", action="store_true", help="run the agent without its eBPF probe (RSS and CPU "
                    "with and without it)")
    ap.add_argument("--out", help="write the result as JSON here")
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="gpuwatch-bench-")
    port = free_port()
    cmd = [sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "",
           "--listen", f"127.0.0.1:{port}", "--state-dir", f"{tmp}/state", "--runtime-dir", f"{tmp}/run",
           "--nvml-interval", str(a.interval), "--log-level", "warning"]
    if a.no_ebpf:
        cmd.append("--no-ebpf")
    if a.fixture:
        cmd += ["--nvml-replay", a.fixture, "--nvml-replay-gpus", str(a.gpus),
                "--nvml-replay-processes-per-gpu", str(a.procs_per_gpu)]
    log = open(f"{tmp}/agent.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        end = time.monotonic() + 30
        body = b""
        while time.monotonic() < end:
            try:
                body = get(url)
                if b"hw_power_watts{" in body:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise SystemExit(f"agent did not serve GPU metrics; log: {open(f'{tmp}/agent.log').read()[-2000:]}")
        ps = psutil.Process(proc.pid)
        time.sleep(max(5.0, 3 * a.interval))  # warm-up: static and slow metrics read, caches filled
        gpus_seen = body.count(b"hw_power_watts{")
        # Phase 1: ticks alone.
        c0, t0 = ps.cpu_times(), time.monotonic()
        time.sleep(a.idle_seconds)
        c1, t1 = ps.cpu_times(), time.monotonic()
        idle_cpu = (c1.user + c1.system) - (c0.user + c0.system)
        ticks = (t1 - t0) / a.interval
        cpu_per_tick = idle_cpu / ticks
        # Phase 2: one scrape per new snapshot, as Prometheus does (every scrape renders afresh).
        cold = []
        c2, t2 = ps.cpu_times(), time.monotonic()
        rng = random.Random(0)
        for _ in range(a.cold_scrapes):
            # At a random phase to the ticks, as a Prometheus server's scrape timer is.
            time.sleep(a.interval * (0.5 + rng.random()))
            s = time.perf_counter()
            get(url)
            cold.append(time.perf_counter() - s)
        c3, t3 = ps.cpu_times(), time.monotonic()
        cold_cpu = (c3.user + c3.system) - (c2.user + c2.system) - cpu_per_tick * (t3 - t2) / a.interval
        # Phase 3: scrapes back to back (several scrapers, retries); ticks' share is subtracted.
        lat = []
        c4, t4 = ps.cpu_times(), time.monotonic()
        size = 0
        for _ in range(a.scrapes):
            s = time.perf_counter()
            size = len(get(url))
            lat.append(time.perf_counter() - s)
        c5, t5 = ps.cpu_times(), time.monotonic()
        scrape_cpu = (c5.user + c5.system) - (c4.user + c4.system) - cpu_per_tick * (t5 - t4) / a.interval
        mem = ps.memory_full_info()
        series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "source": f"replay {a.fixture} as {a.gpus} GPUs x {a.procs_per_gpu} processes" if a.fixture
                      else "real NVML",
            "ebpf": not a.no_ebpf,
            "gpus_exported": gpus_seen, "series": series, "exposition_bytes": size,
            "interval_s": a.interval, "ticks_measured": round(ticks, 1),
            "cpu_per_tick_ms": round(cpu_per_tick * 1e3, 3),
            "new_snapshot_scrapes": len(cold),
            "new_snapshot_cpu_per_scrape_ms": round(max(cold_cpu, 0.0) / len(cold) * 1e3, 3),
            "new_snapshot_scrape_p50_ms": round(statistics.median(cold) * 1e3, 3),
            "new_snapshot_scrape_p99_ms": round(pct(cold, 99) * 1e3, 3),
            "new_snapshot_scrape_max_ms": round(max(cold) * 1e3, 3),
            "back_to_back_scrapes": len(lat),
            "back_to_back_cpu_per_scrape_ms": round(max(scrape_cpu, 0.0) / a.scrapes * 1e3, 3),
            "back_to_back_scrape_p50_ms": round(statistics.median(lat) * 1e3, 3),
            "back_to_back_scrape_p99_ms": round(pct(lat, 99) * 1e3, 3),
            "rss_mib": round(mem.rss / 2**20, 1), "uss_mib": round(mem.uss / 2**20, 1),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        }
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    w = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{w}}  {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
