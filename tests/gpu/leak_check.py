"""The leak detector on a GPU, against planted leaks (issue 5), in one run:

  - a real `gpuwatch agent` (real NVML; eBPF and device-wide sampling off) on a private socket;
  - a steady training loop under `gpuwatch run` for the whole run: it must raise no leak finding;
  - three leaks under `gpuwatch run`, one after the other (tests/gpu/leak_program.py: white, grey,
    black), each after a ballast that leaves --free-gib free and at --rate-mib-per-min: each must be
    classified with its color within 90 s of the leak's start, and the time-to-OOM forecast at
    detection must be within 20 % of the OOM the program then meets;
  - a slow black leak (--slow-rate-mib-per-min, 100) must be flagged within 5 minutes.

Prints OK/BAD lines and writes everything to --out. Usage (repo root, GPU machine, gpuwatch and
cupti-python importable, see tests/gpu/cupti_check.sh for the environment):
    python3 tests/gpu/leak_check.py --out leak.json [--free-gib 3 --rate-mib-per-min 1536]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from gpuwatch.agent import control

HERE = os.path.dirname(os.path.abspath(__file__))


def start_agent(work: str, port: int) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(work, "run", "control.sock")
    p = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "", "--listen",
                          f"127.0.0.1:{port}", "--state-dir", os.path.join(work, "state"), "--runtime-dir",
                          os.path.join(work, "run"), "--no-ebpf", "--no-cupti-sampling"],
                         stdout=open(os.path.join(work, "agent.log"), "w"), stderr=subprocess.STDOUT)
    for _ in range(100):
        try:
            control.call(sock, "ping", timeout=1)
            return p, sock
        except control.ControlError:
            time.sleep(0.2)
    raise SystemExit(f"the agent did not answer on {sock}; see {work}/agent.log")


def run_program(sock: str, mode: str, log: str, **opts) -> subprocess.Popen:
    args = [sys.executable, os.path.join(HERE, "leak_program.py"), "--mode", mode, "--log", log]
    for k, v in opts.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "run", "--quiet", "--socket", sock,
                             "--"] + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def events(log: str, pid_mode: str) -> list[dict]:
    try:
        return [e for e in map(json.loads, open(log)) if e["mode"] == pid_mode]
    except OSError:
        return []


def leak_findings(sock: str) -> list[dict]:
    try:
        return control.call(sock, "findings", {"kind": "memory_leak"}, timeout=5)["open"]
    except control.ControlError:
        return []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--free-gib", type=float, default=3.0)
    ap.add_argument("--rate-mib-per-min", type=float, default=1536.0)
    ap.add_argument("--slow-rate-mib-per-min", type=float, default=100.0)
    ap.add_argument("--modes", default="white,grey,black,slow")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="gw-leak-")
    log = os.path.join(work, "programs.jsonl")
    agent, sock = start_agent(work, 19837)
    results: list[tuple[bool, str]] = []
    record: dict = {"runs": {}, "args": vars(a)}
    steady = run_program(sock, "steady", log, seconds=3600)
    t_start = time.time()
    steady_findings = []
    try:
        for mode in a.modes.split(","):
            kind = "black" if mode == "slow" else mode
            rate = a.slow_rate_mib_per_min if mode == "slow" else a.rate_mib_per_min
            limit = 330 if mode == "slow" else 600
            p = run_program(sock, kind, log, free_gib=a.free_gib, rate_mib_per_min=rate, seconds=limit)
            first = None
            t0 = time.time()
            while p.poll() is None and time.time() - t0 < limit + 30:
                for f in leak_findings(sock):
                    if f["pid"] == str(p.pid) and first is None:
                        first = dict(f, seen_at=time.time())
                    if f["pid"] == str(steady.pid):
                        steady_findings.append(f)
                if mode == "slow" and first is not None:
                    break
                time.sleep(2)
            if p.poll() is None:
                p.kill()
                p.wait()
            ev = {e["event"]: e for e in events(log, kind) if e["t"] >= t0 - 1}
            start, oom = ev.get("leak_start"), ev.get("oom")
            run = {"first_finding": first, "program": ev}
            record["runs"][mode] = run
            if first is None or start is None:
                results.append((False, f"{mode}: no leak finding (program events {sorted(ev)})"))
                continue
            delay = first["seen_at"] - start["t"]
            ok_color = first["color"] == kind
            if mode == "slow":
                results.append((ok_color and delay <= 300, f"slow {rate:.0f} MiB/min: seen after {delay:.0f} s "
                                f"(limit 300 s) as {first['color']}"))
                continue
            line = f"{mode}: seen after {delay:.0f} s (limit 90 s) as {first['color']}"
            ok = ok_color and delay <= 90
            if oom is not None and first.get("time_to_oom_seconds"):
                actual = oom["t"] - first["seen_at"]
                err = abs(first["time_to_oom_seconds"] - actual) / actual
                line += (f"; forecast {first['time_to_oom_seconds']:.0f} s vs OOM after {actual:.0f} s "
                         f"({err:.0%} off, limit 20 %)")
                ok = ok and err <= 0.2
            else:
                line += f"; no OOM measured ({'oom' in ev}) or no forecast"
                ok = False
            results.append((ok, line))
        # The steady loop must have had 10 minutes without a finding.
        while time.time() - t_start < 600:
            steady_findings += [f for f in leak_findings(sock) if f["pid"] == str(steady.pid)]
            time.sleep(5)
        results.append((not steady_findings, f"steady training loop: {len(steady_findings)} leak findings in "
                        f"{time.time() - t_start:.0f} s (none expected)"))
    finally:
        steady.kill()
        agent.terminate()
        agent.wait(20)
    record["results"] = [{"ok": ok, "what": w} for ok, w in results]
    record["steady_findings"] = steady_findings[:5]
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1)
    for ok, what in results:
        print(("OK   " if ok else "BAD  ") + what, flush=True)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
