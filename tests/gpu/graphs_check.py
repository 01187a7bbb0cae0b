"""The eBPF probe's CUDA-graph kernels against CUPTI on a GPU (tests/gpu/graphs_workload.py).

Three probes on libcuda, as gpuwatch runs them:
  daemon   every process, started before the workload, the daemon's launch duty cycle (0.1);
  exact    every process, started before the workload, every launch probed (ebpf.launch_sampling=1);
  trace    `gpuwatch trace -p` standalone: attached to the workload after its graphs were captured.
The daemon and exact probes are collected every second in a thread, as the daemon does. For each
case the workload captures its graphs, the trace probe attaches, then N replays run under
torch.profiler. Checks: the exact probe's kernels (through graphs + direct) equal CUPTI's; its
replays are N, all of known content; names for >= 95 % of graph kernel launches; the daemon's
replays are N (partial content when a capture began while its launch probes were off, said so);
the trace probe counts the N replays as of unknown content, and no kernel for them.

  python3 tests/gpu/graphs_check.py --out graphs.json   (bcc importable; see tests/gpu/graphs_check.sh)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import workload  # tests/gpu/workload.py: the workload's environment (no bcc libraries)
from gpuwatch.probes.ebpf.probe import EbpfCudaProbe

HERE = os.path.dirname(os.path.abspath(__file__))


def graph_delta(before: dict, after: dict) -> dict:
    g0, g1 = before["graphs"], after["graphs"]
    k0 = {k["handle"]: k for k in before["kernels"]}
    d = {f: g1[f] - g0.get(f, 0) for f in ("launches", "kernel_launches", "unknown_content_launches",
                                            "partial_content_launches")}
    graph = direct = named = 0
    for k in after["kernels"]:
        b = k0.get(k["handle"], {})
        dg = k["graph_launches"] - b.get("graph_launches", 0)
        graph += dg
        direct += k["direct_launches"] - b.get("direct_launches", 0)
        named += dg if k["name"] else 0
    d.update(graph_kernel_launches=graph, direct_kernel_launches=direct,
             named_fraction=round(named / graph, 4) if graph else None,
             graph_launch_calls=sum(a["calls"] for api, a in after["apis"].items() if api.startswith("cuGraphLaunch"))
             - sum(a["calls"] for api, a in before["apis"].items() if api.startswith("cuGraphLaunch")))
    return d


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="cudagraph compile decode")
    ap.add_argument("--replays", type=int, default=97)
    ap.add_argument("--out")
    a = ap.parse_args()
    libcuda = [p for p in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout.split()
               if p.endswith("/libcuda.so.1")][0]
    libcuda = os.path.realpath(libcuda)
    probes = {"daemon": EbpfCudaProbe(libraries=[libcuda], launch_sampling=0.1),
              "exact": EbpfCudaProbe(libraries=[libcuda], launch_sampling=1.0)}
    for p in probes.values():
        p.start()
        p.collect()
    stop = threading.Event()

    def collector():
        while not stop.wait(1.0):
            for p in probes.values():
                p.collect()
    threading.Thread(target=collector, daemon=True).start()

    work = subprocess.Popen([sys.executable, os.path.join(HERE, "graphs_workload.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=workload.env())
    ready = work.stdout.readline().split()
    assert ready[0] == "ready", ready
    pid = int(ready[1])

    def ask(line: str) -> dict:
        work.stdin.write(line + "\n")
        work.stdin.flush()
        return json.loads(work.stdout.readline())

    results: dict = {"pid": pid, "libcuda": libcuda, "cases": {}}
    checks: list[tuple[str, bool, str]] = []
    for case in a.cases.split():
        t0 = time.perf_counter()
        cap = ask(f"capture {case}")
        r: dict = {"capture": cap, "capture_seconds": round(time.perf_counter() - t0, 2)}
        results["cases"][case] = r
        if "error" in cap:
            checks.append((f"{case}: captured", False, cap["error"]))
            continue
        trace = EbpfCudaProbe(libraries=[libcuda], pid=pid)  # attached after the capture
        trace.start()
        before = {name: p.snapshot(pid) for name, p in probes.items()}
        before["trace"] = trace.snapshot(pid)
        rep = ask(f"replay {case} {a.replays}")
        time.sleep(0.2)
        after = {name: p.snapshot(pid) for name, p in probes.items()}
        after["trace"] = trace.snapshot(pid)
        trace.shutdown()
        r["replay"] = rep
        if "error" in rep:
            checks.append((f"{case}: replayed", False, rep["error"]))
            continue
        d = {name: graph_delta(before[name], after[name]) for name in after}
        r["deltas"] = d
        n, cupti = a.replays, rep["cupti_kernels"]
        e, dm, tr = d["exact"], d["daemon"], d["trace"]
        checks += [
            (f"{case}: exact: kernels (graph {e['graph_kernel_launches']} + direct {e['direct_kernel_launches']}) "
             f"= CUPTI {cupti}", e["graph_kernel_launches"] + e["direct_kernel_launches"] == cupti, ""),
            (f"{case}: exact: {e['launches']} replays of known content = {n}",
             e["launches"] == n and e["unknown_content_launches"] == 0 and e["partial_content_launches"] == 0, ""),
            (f"{case}: exact: named {e['named_fraction']} >= 0.95 of graph kernel launches",
             (e["named_fraction"] or 0) >= 0.95, ""),
            (f"{case}: daemon (duty cycle): {dm['launches']} replays = {n} (partial {dm['partial_content_launches']}, "
             f"graph kernels {dm['graph_kernel_launches']} vs exact {e['graph_kernel_launches']})",
             dm["launches"] == n and dm["unknown_content_launches"] == 0
             and (dm["partial_content_launches"] > 0 or dm["graph_kernel_launches"] == e["graph_kernel_launches"]), ""),
            (f"{case}: trace attached after capture: {tr['unknown_content_launches']} of {tr['launches']} replays "
             f"said unknown, {tr['graph_kernel_launches']} kernels claimed",
             tr["launches"] == n and tr["unknown_content_launches"] == n and tr["graph_kernel_launches"] == 0, ""),
        ]
        # who launched them: the Python frames of each kernel's most sampled launch (or capture)
        k0 = {k["handle"]: k for k in before["exact"]["kernels"]}
        launched, with_py, launchers = 0, 0, []
        for k in after["exact"]["kernels"]:
            n_k = k["launches"] - k0.get(k["handle"], {}).get("launches", 0)
            if n_k <= 0:
                continue
            launched += n_k
            py = next((st["python"] for st in k.get("stacks") or [] if st.get("python")), [])
            with_py += n_k if py else 0
            if len(launchers) < 5:
                launchers.append({"kernel": (k["name"] or k["handle"])[:80], "launches": n_k, "python": py[:4],
                                  "native": ((k.get("stacks") or [{}])[0].get("frames") or [])[:4]})
        r["launchers"] = launchers
        r["python_frames"] = after["exact"].get("python_frames")
        frac = with_py / launched if launched else 0.0
        checks.append((f"{case}: kernels with their Python launcher named: {frac:.3f} of launches "
                       f"({after['exact'].get('python_frames')})", frac >= 0.9, ""))
        if case == "decode":
            # The token step's direct kernels (pos.add_; the token's copy is a cudaMemcpyAsync, no
            # kernel): each must be named as launched from replay().
            direct = [k for k in after["exact"]["kernels"]
                      if k.get("direct_launches", 0) > k0.get(k["handle"], {}).get("direct_launches", 0)]
            step = [k for k in direct
                    if any("graphs_workload.py" in f and "replay" in f for st in k.get("stacks") or []
                           for f in st.get("python") or [])]
            checks.append((f"decode: the token step's direct kernels named as launched from replay() "
                           f"({len(step)} of {len(direct)} kernels)", len(direct) >= 1 and len(step) == len(direct), ""))
        if cap.get("kernel_nodes") is not None:
            per = e["graph_kernel_launches"] / n if n else 0
            checks.append((f"{case}: graph kernel launches per replay {per:g} = kernel nodes {cap['kernel_nodes']} "
                           f"(cudaGraphGetNodes)", per == cap["kernel_nodes"], ""))
    stop.set()
    ask("bye")
    work.stdin.close()
    work.wait(60)
    for p in probes.values():
        p.shutdown()
    results["checks"] = [{"check": c, "ok": ok, "error": err} for c, ok, err in checks]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    for c, ok, err in checks:
        print(f"{'OK ' if ok else 'BAD'} {c}" + (f": {err}" if err else ""))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
