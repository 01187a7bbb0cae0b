"""Issue 33 on a GPU: a server's CUDA graphs, counted whole at the daemon's defaults.

A real `gpuwatch agent` (defaults: ebpf.launch_sampling 0.1, launch_budget, new_process_exact; its
eBPF probe on the host's libcuda from its start, as on a node where the daemon runs before the
server) and tests/gpu/graphs_server_workload.py, twice: "once" (a decoder step captured once at start,
never again) and "batches" (12 batch sizes captured over ~5 s). After the captures ("ready"), two
traces attach: through the agent (AgentTrace: trace.snapshot, what a non-root `gpuwatch trace -p`
reads) and as root (its own uprobes, attached after the captures, then trace.graphs: what the agent
knew). Then N replays under torch.profiler. Checks, per workload: kernels through graphs equal
CUPTI's kernels exactly for the daemon (its exported counter), the agent trace and the root trace,
every replay of known content; a short table last.

  python3 tests/gpu/graphs_server_check.py [--replays 300] [--out FILE.json]   (bcc importable; see .sh)
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

import workload  # tests/gpu/workload.py: the workload's environment (no bcc libraries)
from gpuwatch.agent import control
from gpuwatch.agent.trace.pids import check_pid
from gpuwatch.agent.trace.session import AgentTrace, preload_graphs
from gpuwatch.probes.ebpf.probe import EbpfCudaProbe

HERE = os.path.dirname(os.path.abspath(__file__))


def metric(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def start_agent(work: str, port: int, libcuda: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(work, "run", "control.sock")
    p = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "", "--listen",
                          f"127.0.0.1:{port}", "--state-dir", os.path.join(work, "state"), "--runtime-dir",
                          os.path.join(work, "run"), "--no-cupti-sampling", "--no-baseline",
                          "--ebpf-library", libcuda],
                         stdout=open(os.path.join(work, "agent.log"), "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if control.call(sock, "status", timeout=2)["probes"].get("ebpf", {}).get("state") == "up":
                return p, sock
        except control.ControlError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the agent's eBPF probe is not up; see {work}/agent.log")


def run_case(mode: str, replays: int, sock: str, url: str, libcuda: str) -> dict:
    t0 = time.monotonic()
    work = subprocess.Popen([sys.executable, os.path.join(HERE, "graphs_server_workload.py"), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=workload.env())
    ready = work.stdout.readline().split()
    assert ready[:1] == ["ready"], ready
    pid = int(ready[1])
    out: dict = {"mode": mode, "pid": pid, "start_to_ready_s": round(time.monotonic() - t0, 1)}
    time.sleep(1.5)  # a collection of the agent's after the captures
    daemon0 = metric(url, "gpuwatch_cuda_graph_kernel_launches_total", pid=str(pid))
    agent = AgentTrace(sock, check_pid(pid))
    agent.start()
    root = EbpfCudaProbe(libraries=[libcuda], pid=pid)  # attached after the captures
    root.start()
    out["root_preload"] = preload_graphs(root, pid, sock)
    root0 = root.snapshot(pid)["graphs"]
    work.stdin.write(f"replay {replays}\n")
    work.stdin.flush()
    rep = json.loads(work.stdout.readline())
    time.sleep(2.5)  # the agent's next collections
    out["cupti_kernels"] = rep["cupti_kernels"]
    out["graphs_captured"] = rep["graphs"]
    g = agent.snapshot(pid)["graphs"]
    out["agent"] = {"kernels": g["kernel_launches"], "replays": g["launches"],
                    "not_known": g["unknown_content_launches"] + g["partial_content_launches"]}
    r = root.snapshot(pid)["graphs"]
    root.shutdown()
    out["root"] = {"kernels": r["kernel_launches"] - root0["kernel_launches"], "replays": r["launches"] - root0["launches"],
                   "not_known": r["unknown_content_launches"] + r["partial_content_launches"]
                   - root0["unknown_content_launches"] - root0["partial_content_launches"]}
    known = metric(url, "gpuwatch_cuda_graph_launches_total", pid=str(pid), content="known")
    out["daemon"] = {"kernels": metric(url, "gpuwatch_cuda_graph_kernel_launches_total", pid=str(pid)) - daemon0,
                     "replays_known_total": known,
                     "not_known_total": sum(metric(url, "gpuwatch_cuda_graph_launches_total", pid=str(pid), content=c)
                                            for c in ("partial", "unknown"))}
    out["launch_sampled_ratio"] = metric(url, "gpuwatch_ebpf_launch_sampled_ratio")
    out["launch_rate"] = metric(url, "gpuwatch_ebpf_launch_rate", what="measured")
    work.stdin.write("bye\n")
    work.stdin.flush()
    work.wait(60)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--out")
    a = ap.parse_args()
    libcuda = os.path.realpath([p for p in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout.split()
                                if p.endswith("/libcuda.so.1")][0])
    work = tempfile.mkdtemp(prefix="gpuwatch-graphs-server-")
    port = 9400 + os.getpid() % 500
    agent, sock = start_agent(work, port, libcuda)
    url = f"http://127.0.0.1:{port}/metrics"
    results, checks = [], []
    try:
        for mode in ("once", "batches"):
            r = run_case(mode, a.replays, sock, url, libcuda)
            results.append(r)
            print(json.dumps(r), flush=True)
            c = r["cupti_kernels"]
            checks += [
                (f"{mode}: daemon kernels through graphs {r['daemon']['kernels']:g} = CUPTI {c}, every replay known",
                 r["daemon"]["kernels"] == c and r["daemon"]["not_known_total"] == 0),
                (f"{mode}: agent trace {r['agent']['kernels']} = CUPTI {c}, {r['agent']['replays']} replays known",
                 r["agent"]["kernels"] == c and r["agent"]["replays"] == a.replays and r["agent"]["not_known"] == 0),
                (f"{mode}: root trace {r['root']['kernels']} = CUPTI {c}, {r['root']['replays']} replays known",
                 r["root"]["kernels"] == c and r["root"]["replays"] == a.replays and r["root"]["not_known"] == 0),
            ]
    finally:
        agent.terminate()
        agent.wait(60)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"results": results, "checks": [{"check": t, "ok": ok} for t, ok in checks]}, f, indent=1)
    for t, ok in checks:
        print(f"{'OK ' if ok else 'BAD'} {t}")
    print(f"\n{'workload':9s} {'CUPTI':>8s} {'daemon':>8s} {'agent':>8s} {'root':>8s} {'ready s':>8s} {'rate/s':>8s}")
    for r in results:
        print(f"{r['mode']:9s} {r['cupti_kernels']:>8} {r['daemon']['kernels']:>8g} {r['agent']['kernels']:>8} "
              f"{r['root']['kernels']:>8} {r['start_to_ready_s']:>8} {r['launch_rate']:>8.0f}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
