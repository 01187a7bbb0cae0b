"""Issue 17 on a GPU: the hardened control plane keeps telling the truth about an honest job and
nothing a forger sends about the GPU.

  - a real `gpuwatch agent` (real NVML; eBPF, device-wide sampling and the baseline off) on a
    private socket and port;
  - honest: tests/gpu/cupti_workload.py under `gpuwatch run` reports to it. /metrics is scraped ten
    times a second; every white/grey value the agent exports for the job equals the job's own
    torch.cuda.memory_allocated()/memory_reserved() in force then (samples within a report
    interval plus a tick of a change are skipped as ambiguous), on the job's GPU UUID, as a
    verified series (NVML lists the job on that GPU), with the process named by its comm;
  - forger: a plain Python process with no CUDA sends reports naming the real GPU's UUID, a growing
    `allocated` and the process name "nvidia-smi". None of it may reach a verified white/grey series
    (what the leak detector and alert rules read), and no series may name it "nvidia-smi".

Writes control.json and the logs to --out; prints a table last. Usage (repo root, on the GPU
machine): source tests/gpu/env.sh; python3 tests/gpu/control_check.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

from gpuwatch.agent import control

SERIES = re.compile(r'^(gpuwatch_process_gpu_memory_(allocated|reserved)(_self_reported)?_bytes)\{([^}]*)\} (\S+)$')
FORGER = r"""
import json, sys, time
from gpuwatch.agent import control
sock, uuid = sys.argv[1], sys.argv[2]
for i in range(int(sys.argv[3])):
    r = {"version": 1, "process": "nvidia-smi", "ts": 4e9 - 1, "started": 0,
         "cupti": {"state": "on"}, "kernels": [],
         "memory": [{"device": 0, "uuid": uuid, "allocated": (i + 1) << 30, "reserved": (i + 2) << 30, "ts": 4e9 - 1}]}
    try:
        print(json.dumps(control.call(sock, "cupti.report", r)), flush=True)
    except control.ControlError as e:
        print("refused:", e, flush=True)
    time.sleep(0.5)
"""


def labels(text: str) -> dict:
    return dict(re.findall(r'(\w+)="([^"]*)"', text))


def scrape(url: str) -> list[tuple[str, dict, float]]:
    try:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return []
    out = []
    for line in body.splitlines():
        m = SERIES.match(line)
        if m:
            out.append((m.group(1), labels(m.group(4)), float(m.group(5))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=19838)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gw-control-")
    sock = os.path.join(work, "run", "control.sock")
    url = f"http://127.0.0.1:{a.port}/metrics"
    agent = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "", "--listen",
                              f"127.0.0.1:{a.port}", "--state-dir", os.path.join(work, "state"), "--runtime-dir",
                              os.path.join(work, "run"), "--no-ebpf", "--no-cupti-sampling", "--no-baseline"],
                             stdout=open(os.path.join(a.out, "agent.log"), "w"), stderr=subprocess.STDOUT)
    results: list[tuple[bool, str]] = []
    try:
        for _ in range(150):
            try:
                control.call(sock, "ping", timeout=1)
                break
            except control.ControlError:
                time.sleep(0.2)
        else:
            raise SystemExit("the agent did not answer; see agent.log")
        truth_log = os.path.join(work, "workload.jsonl")
        job = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "run", "--kernels", "sampled",
                                "--interval", "0.2", "--socket", sock, "--", sys.executable,
                                "tests/gpu/cupti_workload.py", "--log", truth_log, "--hold", "3"],
                               stdout=open(os.path.join(a.out, "job.log"), "w"), stderr=subprocess.STDOUT)
        uuid = ""
        for _ in range(300):
            try:
                uuid = next(json.loads(line)["uuid"] for line in open(truth_log) if '"start"' in line)
                break
            except (OSError, StopIteration, ValueError):
                time.sleep(0.1)
        forger = subprocess.Popen([sys.executable, "-c", FORGER, sock, uuid or "GPU-unknown", "40"],
                                  stdout=open(os.path.join(a.out, "forger.log"), "w"), stderr=subprocess.STDOUT)
        scrapes: list[tuple[float, list]] = []
        while job.poll() is None or forger.poll() is None:
            t = time.time()
            scrapes.append((t, scrape(url)))
            time.sleep(0.1)
        status = control.call(sock, "status", timeout=5)
        metrics_after = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        agent.terminate()
        agent.wait(30)
    log = [json.loads(line) for line in open(truth_log)]
    changes = [e for e in log if "allocated" in e]
    memory_end = next(e["t"] for e in log if e.get("phase") == "adds begin")
    # The value a scrape shows was reported within an interval (0.2 s) and published within a
    # runner tick (1 s) of it: a change that close before the scrape makes the sample ambiguous.
    lag = 1.5
    compared = equal = ambiguous = 0
    mismatches, job_names, verified_pids = [], set(), set()
    for t, series in scrapes:
        for name, lab, value in series:
            if lab.get("pid") == str(forger.pid):
                continue
            if lab.get("pid") != str(job.pid):
                continue
            job_names.add(lab.get("process"))
            if name.endswith("_self_reported_bytes"):
                mismatches.append({"t": t, "series": name, "why": "job's memory exported as self-reported"})
                continue
            verified_pids.add(lab["pid"])
            if t >= memory_end or lab.get("gpu") != uuid:
                continue
            if any(c["t0"] - 0.05 <= t and c["t"] >= t - lag for c in changes):
                ambiguous += 1
                continue
            before = [c for c in changes if c["t"] < t - lag]
            if not before:
                continue
            truth = before[-1]["allocated" if "allocated" in name else "reserved"]
            compared += 1
            if value == truth:
                equal += 1
            else:
                mismatches.append({"t": t, "series": name, "agent": value, "job": truth})
    results.append((job.returncode == 0, f"workload exit code {job.returncode}"))
    results.append((compared >= 20 and equal == compared,
                    f"honest job: {equal}/{compared} white/grey samples on /metrics equal memory_allocated/"
                    f"memory_reserved on {uuid} ({ambiguous} ambiguous skipped), verified"))
    comm = os.path.basename(sys.executable)[:15]  # `gpuwatch run` execs the job: its comm is the interpreter's
    results.append((job_names == {comm}, f"the job's process label is its comm {comm!r}: {sorted(job_names)}"))
    forged_verified = [(n, lab) for _, series in scrapes for n, lab, _ in series
                       if lab.get("pid") == str(forger.pid) and not n.endswith("_self_reported_bytes")]
    results.append((not forged_verified, f"forger: {len(forged_verified)} verified white/grey samples (0 expected)"))
    named = "nvidia-smi" in metrics_after or any(lab.get("process") == "nvidia-smi"
                                                 for _, series in scrapes for _, lab, _ in series)
    results.append((not named, "no series names a process nvidia-smi"))
    forger_out = open(os.path.join(a.out, "forger.log")).read()
    json.dump({"compared": compared, "equal": equal, "ambiguous": ambiguous, "mismatches": mismatches[:50],
               "job_names": sorted(job_names), "forged_verified": len(forged_verified),
               "forger_replies": forger_out.splitlines()[:5], "status_probes": status.get("probes"),
               "results": results}, open(os.path.join(a.out, "control.json"), "w"), indent=1, default=str)
    print(f"{'check':<100} result")
    for ok, what in results:
        print(f"{what:<100} {'PASS' if ok else 'FAIL'}")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
