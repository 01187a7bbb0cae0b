"""Host-side causes of slow GPU jobs, on a GPU (issue 20): the host_bound detector of a real agent
against jobs whose causes are known (tests/gpu/host_workload.py).

  eviction  a serving loop copies shards of an 8 GiB weights file to the GPU per request (mapping each shard, then unmapping it);
            after --before seconds (120) an "archiver" drops that file from the page cache every 2 s and
            reads through another file from disk for --during seconds, then stops (--after seconds
            more). The agent must open a host_bound finding with cause page_cache_eviction naming
            the weights file and the archiver (its pid) within 30 s of the archiver's start; the
            loop's p50/p99 step time before, during and after is kept beside the finding.
  input     a training loop fed by one loader thread that spends 150 ms of Python per batch, with
            a ~15 ms GPU step: input_thread, naming the thread "loader", within 150 s (its GPU is low from the start: a minute
            of baseline, then the 30 s window).
  quiet     the serving loop and a GPU-heavy training loop (a light loader) undisturbed for
            --quiet seconds: no host_bound finding for either.

A real `gpuwatch agent` (real NVML, host and page-cache probes at their defaults; eBPF, CUPTI
sampling and the reference workload off) on a private socket. Files go to the first disk-backed
directory of /var/tmp, /root, the working directory (not tmpfs: the page cache is the point).
Prints OK/BAD lines; host.json, jobs.jsonl and agent.log go to --out. Exit 0 when all are OK.

Usage: tests/gpu/host_check.sh OUTDIR [--cases eviction,input] [--quiet 540]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from agent_proc import start_agent  # tests/gpu/agent_proc.py
from gpuwatch.agent import control

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "host_workload.py")


def disk_dir() -> str:
    for d in ("/var/tmp", "/root", os.getcwd()):
        try:
            fs = subprocess.run(["stat", "-f", "-c", "%T", d], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if fs and fs not in ("tmpfs", "ramfs", "overlayfs") and os.access(d, os.W_OK):
            return d
    raise SystemExit("no disk-backed writable directory among /var/tmp, /root and the working directory")


def job(kind: str, log: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, JOB, kind, "--log", log, *args])


def host_bound(sock: str) -> list[dict]:
    try:
        return control.call(sock, "findings", {"kind": "host_bound"}, timeout=5).get("open", [])
    except control.ControlError:
        return []


def steps(log: str, pid: int, t0: float, t1: float) -> dict:
    xs = sorted(e["seconds"] for e in map(json.loads, open(log))
                if e["pid"] == pid and e["event"] == "step" and t0 <= e["t"] < t1)
    if not xs:
        return {"steps": 0}
    return {"steps": len(xs), "p50_ms": round(1000 * statistics.median(xs), 1),
            "p99_ms": round(1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1)}


def wait_for(sock: str, pid: int, cause: str, seconds: float, seen: list) -> dict | None:
    end = time.time() + seconds
    while time.time() < end:
        for f in host_bound(sock):
            if f.get("pid") == str(pid):
                seen.append({"t": time.time(), **{k: f.get(k) for k in ("cause", "summary", "ts")}})
                if f.get("cause") == cause:
                    return f
        time.sleep(1)
    return None


def case_eviction(sock, d, log, a, results, record) -> None:
    weights, big = os.path.join(d, "gw-weights.bin"), os.path.join(d, "gw-archive.bin")
    for path, gib in ((weights, 8), (big, 4)):
        if not os.path.exists(path) or os.path.getsize(path) != gib << 30:
            subprocess.run([sys.executable, JOB, "make", "--path", path, "--gib", str(gib), "--log", log], check=True)
    serve = job("serve", log, "--weights", weights, "--seconds", str(a.before + a.during + a.after + 120))
    seen: list = []
    try:
        time.sleep(a.before)
        t_evict = time.time()
        evictor = job("evict", log, "--target", weights, "--read", big, "--seconds", str(a.during))
        found = wait_for(sock, serve.pid, "page_cache_eviction", a.during, seen)
        delay = time.time() - t_evict if found else None
        evictor.wait(a.during + 30)
        t_after = time.time()
        time.sleep(a.after)
        still = [f for f in host_bound(sock) if f.get("pid") == str(serve.pid)]
    finally:
        serve.kill()
        serve.wait()
    timing = {"before": steps(log, serve.pid, t_evict - a.before + 30, t_evict),  # after its warm-up
              "during": steps(log, serve.pid, t_evict, t_after),
              "after": steps(log, serve.pid, t_after + 20, t_after + a.after)}
    record["eviction"] = {"finding": found, "seen": seen[-20:], "delay_seconds": delay, "step_time": timing,
                          "open_at_the_end": still, "serve_pid": serve.pid, "evictor_pid": evictor.pid}
    text = (found or {}).get("summary", "")
    ok = (found is not None and delay <= 30 and "gw-weights.bin" in text and "archiver" in text
          and str(evictor.pid) in text)
    results.append((ok, f"eviction: host_bound {(found or {}).get('cause')} {delay and round(delay)} s after the "
                        f"archiver began (limit 30 s): {text[:300] or seen[-1:] or 'no finding'}"))
    results.append((bool(timing["during"].get("p99_ms")), f"eviction: step time p50/p99 before "
                    f"{timing['before'].get('p50_ms')}/{timing['before'].get('p99_ms')} ms, during "
                    f"{timing['during'].get('p50_ms')}/{timing['during'].get('p99_ms')} ms, after "
                    f"{timing['after'].get('p50_ms')}/{timing['after'].get('p99_ms')} ms"))
    results.append((not still, f"eviction: {len(still)} host_bound findings still open {a.after:.0f} s after the "
                               "archiver stopped"))


def case_input(sock, d, log, a, results, record) -> None:
    train = job("train", log, "--loader-ms", "150", "--gemms", "8", "--seconds", "240")
    seen: list = []
    t0 = time.time()
    try:
        found = wait_for(sock, train.pid, "input_thread", 150, seen)
        delay = time.time() - t0 if found else None
    finally:
        train.kill()
        train.wait()
    record["input"] = {"finding": found, "seen": seen[-20:], "delay_seconds": delay,
                       "step_time": steps(log, train.pid, t0, time.time())}
    text = (found or {}).get("summary", "")
    results.append((found is not None and "loader" in text,
                    f"input: host_bound {(found or {}).get('cause')} {delay and round(delay)} s after its start "
                    f"(limit 150 s: a minute of baseline, then the 30 s window): {text[:300] or seen[-1:] or 'no finding'}"))


def case_quiet(sock, d, log, a, results, record) -> None:
    weights = os.path.join(d, "gw-weights.bin")
    if not os.path.exists(weights):
        subprocess.run([sys.executable, JOB, "make", "--path", weights, "--gib", "8", "--log", log], check=True)
    serve = job("serve", log, "--weights", weights, "--seconds", str(a.quiet + 60))
    train = job("train", log, "--loader-ms", "5", "--gemms", "48", "--seconds", str(a.quiet + 60))
    seen: list = []
    t0 = time.time()
    try:
        while time.time() - t0 < a.quiet:
            for f in host_bound(sock):
                if f.get("pid") in (str(serve.pid), str(train.pid)):
                    seen.append({"t": round(time.time() - t0), **{k: f.get(k) for k in ("pid", "cause", "summary")}})
            time.sleep(2)
    finally:
        for p in (serve, train):
            p.kill()
            p.wait()
    record["quiet"] = {"seconds": a.quiet, "findings": seen[:20],
                       "serve_step_time": steps(log, serve.pid, t0 + 30, time.time()),
                       "train_step_time": steps(log, train.pid, t0, time.time())}
    results.append((not seen, f"quiet: the serving and training loops undisturbed for {a.quiet:.0f} s: "
                              f"{len(seen)} host_bound sightings {seen[:2]}"))


CASES = {"eviction": case_eviction, "input": case_input, "quiet": case_quiet}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="eviction,input")
    ap.add_argument("--before", type=float, default=120.0)
    ap.add_argument("--during", type=float, default=60.0)
    ap.add_argument("--after", type=float, default=60.0)
    ap.add_argument("--quiet", type=float, default=600.0)
    ap.add_argument("--port", type=int, default=19839)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    d = disk_dir()
    work = tempfile.mkdtemp(prefix="gw-host-")
    log = os.path.join(a.out, "jobs.jsonl")
    record: dict = {"args": vars(a), "dir": d}
    results: list[tuple[bool, str]] = []
    agent, sock = start_agent(work, a.port)
    try:
        for case in a.cases.split(","):
            t = time.time()
            CASES[case](sock, d, log, a, results, record)
            print(f"[{time.time() - t:4.0f} s] {case} done", flush=True)
        try:
            record["host_series"] = [line for line in __import__("urllib.request").request.urlopen(
                f"http://127.0.0.1:{a.port}/metrics", timeout=5).read().decode().splitlines()
                if line.startswith(("gpuwatch_process_", "gpuwatch_node_", "gpuwatch_host_bound", "gpuwatch_probe_up"))][:400]
        except OSError as e:
            record["host_series"] = str(e)
    finally:
        agent.terminate()
        agent.wait(20)
    record["results"] = [{"ok": ok, "what": w} for ok, w in results]
    with open(os.path.join(a.out, "host.json"), "w") as f:
        json.dump(record, f, indent=1)
    os.replace(os.path.join(work, "agent.log"), os.path.join(a.out, "agent.log"))
    for ok, what in results:
        print(("OK   " if ok else "BAD  ") + what, flush=True)
    return 0 if results and all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
