"""Check the eBPF CUDA probe on a GPU against a PyTorch process whose calls are known.

Attaches to an already running process (tests/gpu/cuda_workload.py), as `gpuwatch trace --pid`
will, and compares per-API call and byte deltas with what the workload did. Also times the
workload's tiny-op launch loop with the probe detached and attached (its overhead: launches are
hooked at entry only, the default), and the probe's compile, attach and detach.

  python3 tests/gpu/ebpf_check.py --out ebpf.json     (bcc importable; see tests/gpu/ebpf_check.sh)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import workload  # tests/gpu/workload.py
from gpuwatch.probes.ebpf.probe import EbpfCudaProbe


def main() -> int:
    ap = argparse.ArgumentParser()
    workload.add_arguments(ap)
    ap.add_argument("--rounds", type=int, default=7, help="add phases timed detached, and attached")
    ap.add_argument("--out")
    a = ap.parse_args()
    # The workload must not see the bcc bundle's libraries (GPU.md): give it the original environment.
    work = workload.start(a, rounds=a.rounds)

    def step(name):
        work.stdin.write("go\n")
        work.stdin.flush()
        line = work.stdout.readline().split()
        assert line[:2] == ["done", name], line
        return float(line[2])

    ready = work.stdout.readline().split()
    assert ready[0] == "ready", ready
    pid = int(ready[1])
    result: dict = {"pid": pid}
    detached = [step("add") for _ in range(a.rounds)]

    probe = EbpfCudaProbe(pid=pid)
    t = time.perf_counter()
    probe.start()
    result["start_seconds"] = round(time.perf_counter() - t, 3)
    result["compile_seconds"] = round(probe._loader.compile_seconds, 3)
    result["libraries"] = [{k: (v if k != "attached" else len(v)) for k, v in lib.items()} for lib in probe.attached()]

    def calls():
        return {api: (s["calls"], s["errors"], s["bytes"]) for api, s in probe.snapshot(pid)["apis"].items()}

    def delta(before, after):
        return {api: tuple(x - y for x, y in zip(v, before.get(api, (0, 0, 0))))
                for api, v in after.items() if v != before.get(api, (0, 0, 0))}

    attached = [step("add") for _ in range(a.rounds - 1)]
    s0 = calls()
    attached.append(step("add"))
    s1 = calls()
    step("malloc")
    s2 = calls()
    step("matmul")
    s3 = calls()
    step("fresh")
    s4 = calls()
    step("triton")
    s5 = calls()
    step("graph")
    s6 = calls()
    step("expand")
    s7 = calls()
    snap = probe.snapshot(pid)
    samples = probe.collect()
    t = time.perf_counter()
    probe.shutdown()
    result["shutdown_seconds"] = round(time.perf_counter() - t, 3)
    work.stdin.write("bye\n")
    work.stdin.flush()
    work.wait(30)

    phases = {"add": delta(s0, s1), "malloc": delta(s1, s2), "matmul": delta(s2, s3), "fresh": delta(s3, s4),
              "triton": delta(s4, s5), "graph": delta(s5, s6), "expand": delta(s6, s7)}
    launches = lambda ph: sum(ph.get(api, (0,))[0] for api in ("cuLaunchKernel", "cuLaunchKernelEx"))  # noqa: E731
    created = phases["expand"].get("cuMemCreate", (0, 0, 0))[2]
    mapped = phases["expand"].get("cuMemMap", (0, 0, 0))[2]
    result["phases"] = {k: {api: list(v) for api, v in d.items()} for k, d in phases.items()}
    checks = [
        ("add: cuLaunchKernel calls", phases["add"].get("cuLaunchKernel", (0,))[0], a.adds),
        ("malloc: cuMemAlloc_v2 calls", phases["malloc"].get("cuMemAlloc_v2", (0,))[0], a.mallocs),
        ("malloc: cuMemAlloc_v2 bytes", phases["malloc"].get("cuMemAlloc_v2", (0, 0, 0))[2], a.mallocs * a.malloc_bytes),
        ("malloc: cuMemFree_v2 calls", phases["malloc"].get("cuMemFree_v2", (0,))[0], a.mallocs),
        ("matmul: cuLaunchKernelEx calls", phases["matmul"].get("cuLaunchKernelEx", (0,))[0], a.matmuls),
        ("fresh: cuLaunchKernel calls", phases["fresh"].get("cuLaunchKernel", (0,))[0], 200),
        ("triton: kernel launches", launches(phases["triton"]), 300),
        ("graph: cuGraphLaunch calls", phases["graph"].get("cuGraphLaunch", (0,))[0], 97),
        # mapped in 20 MiB pages; the segment's first page (earlier tensors) may hold the start
        ("expand: cuMemMap bytes >= 1 GiB - 20 MiB", int(mapped >= (1 << 30) - (20 << 20)), 1),
        ("expand: cuMemCreate bytes = cuMemMap bytes", int(created == mapped), 1),
    ]
    triton_k = [k for k in snap.get("kernels", []) if "gw_scale_kernel" in str(k.get("name"))]
    checks.append(("triton: gw_scale_kernel named, launches", triton_k[0]["launches"] if triton_k else 0, 300))
    total = sum(k["launches"] for k in snap.get("kernels", []))
    named = sum(k["launches"] for k in snap.get("kernels", []) if k.get("name"))
    result["named_launch_fraction"] = round(named / total, 4) if total else None
    result["name_sources"] = {src: sum(k["launches"] for k in snap.get("kernels", []) if k.get("name_source") == src)
                              for src in ("hook", "driver", None)}
    result["expand"] = {"cuMemCreate_bytes": created, "cuMemMap_bytes": mapped,
                        "calls": {api: v for api, v in phases["expand"].items()}}
    checks.append(("kernel launches named >= 95 %", int(total > 0 and named >= 0.95 * total), 1))
    result["checks"] = [{"what": w, "seen": seen, "expected": exp, "ok": seen == exp} for w, seen, exp in checks]
    alloc = snap["apis"].get("cuMemAlloc_v2", {})
    result["cuMemAlloc_v2_mean_latency_us"] = round(alloc.get("mean_latency_s", 0) * 1e6, 2)
    result["cuMemAlloc_v2_histogram"] = alloc.get("histogram")
    result["kernels"] = snap.get("kernels", [])[:10]
    # Medians over the rounds, leaving out the very first phase (warm-up).
    det, att = statistics.median(detached[1:] or detached), statistics.median(attached)
    result["add_phase_seconds"] = {"detached": detached, "attached": attached}
    result["per_add_us_detached"] = round(det / a.adds * 1e6, 2)
    result["per_add_us_attached"] = round(att / a.adds * 1e6, 2)
    result["attached_over_detached"] = round(att / det, 3)
    result["samples"] = len(samples)
    result["live_bytes_at_end"] = snap["memory"]["live_bytes"]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    for c in result["checks"]:
        print(f"{'OK ' if c['ok'] else 'BAD'} {c['what']:34s} seen {c['seen']:>12} expected {c['expected']:>12}")
    for k in ("compile_seconds", "start_seconds", "shutdown_seconds", "per_add_us_detached", "per_add_us_attached",
              "attached_over_detached", "cuMemAlloc_v2_mean_latency_us"):
        print(f"{k:34s} {result[k]}")
    print("other APIs seen per phase:", {k: sorted(v) for k, v in phases.items()})
    print("named launch fraction:", result["named_launch_fraction"], "by source:", result["name_sources"])
    print("expand phase:", result["expand"])
    for k in result["kernels"][:8]:
        print(f"kernel {k['handle']} [{k.get('name_source')}] {str(k.get('name'))[:90]}: {k['launches']} launches, grid {k['grid']} "
              f"block {k['block']}, shared {k['shared_mem_bytes']} B, degenerate {k['degenerate_launches']}")
    fresh_kernels = [k for k in snap.get("kernels", []) if k["launches"] == 100]
    result["fresh_kernels_named"] = sum(1 for k in fresh_kernels if k.get("name"))
    print(f"kernels first launched after attach: {len(fresh_kernels)}, named: {result['fresh_kernels_named']}")
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
