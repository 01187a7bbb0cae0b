"""What the eBPF probe's NCCL hooks cost a torch.distributed job, side by side in one run (GPU, root).

One worker process (world size 1: NCCL still runs every collective through libnccl) times loops of
all-reduces, round after round; every other round the probe is attached to its libcuda and libnccl
(pid filter, as `gpuwatch trace -p` does), so both states are measured in the same minutes. Work:
all-reduces of 16 floats (enqueue-bound: the worst case for a per-call cost) and of 1 MiB.
Overhead = the median per-call time attached / detached.

  python3 bench/nccl_overhead.py --rounds 11 --calls 2000 --out nccl-overhead.json   (bcc importable)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = r'''
import os, sys, time, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
tensors = {"small": torch.ones(16, device="cuda"), "large": torch.ones(1 << 18, device="cuda")}
for t in tensors.values():
    for _ in range(100):
        dist.all_reduce(t)
torch.cuda.synchronize()
print("ready", os.getpid(), flush=True)
for line in sys.stdin:
    what, n = line.split()
    t0 = time.perf_counter()
    for _ in range(int(n)):
        dist.all_reduce(tensors[what])
    torch.cuda.synchronize()
    print(f"{time.perf_counter() - t0:.6f}", flush=True)
dist.destroy_process_group()
'''


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out")
    a = ap.parse_args()
    from gpuwatch.probes.ebpf import loader
    from gpuwatch.probes.ebpf.probe import EbpfCudaProbe

    env = dict(os.environ, MASTER_PORT=str(29000 + os.getpid() % 1000), NCCL_NVLS_ENABLE="0")
    for var in ("LD_LIBRARY_PATH", "PYTHONPATH"):  # the worker must not load bcc's libraries (GPU.md)
        if f"WORKLOAD_{var}" in os.environ:
            env[var] = os.environ[f"WORKLOAD_{var}"]
        else:
            env.pop(var, None)
    w = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env)
    line = w.stdout.readline().split()
    assert line[:1] == ["ready"], line
    pid = int(line[1])
    libs = loader.libraries_in(pid, *loader.HOOKED_LIBRARIES)
    probe = EbpfCudaProbe(libraries=libs, pid=pid, driver_names=False)
    probe.start()  # compiled (or cached) once; detached and attached again by round
    probe.shutdown()

    def run(what: str) -> float:
        w.stdin.write(f"{what} {a.calls}\n")
        w.stdin.flush()
        return float(w.stdout.readline()) / a.calls

    times: dict[tuple[str, bool], list[float]] = {}
    calls_seen = 0
    for r in range(a.rounds):
        for attached in (r % 2 == 0, r % 2 == 1):  # which state goes first alternates too
            if attached:
                probe.start()
            for what in ("small", "large"):
                times.setdefault((what, attached), []).append(run(what))
            if attached:
                calls_seen += probe.snapshot(pid)["apis"].get("ncclAllReduce", {}).get("calls", 0)
                probe.shutdown()
    w.stdin.close()
    w.wait(60)
    result = {"rounds": a.rounds, "calls_per_round": a.calls, "libraries": libs, "allreduces_counted": calls_seen,
              "allreduces_made_attached": a.rounds * 2 * a.calls, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(f"{'all-reduce':>10} {'detached':>12} {'attached':>12} {'ratio':>7}")
    for what in ("small", "large"):
        off, on = statistics.median(times[(what, False)]), statistics.median(times[(what, True)])
        result[what] = {"detached_us": round(off * 1e6, 3), "attached_us": round(on * 1e6, 3),
                        "ratio": round(on / off, 4), "rounds_us": {k: [round(x * 1e6, 3) for x in times[(what, k)]]
                                                                   for k in (False, True)}}
        print(f"{what:>10} {off * 1e6:10.2f}us {on * 1e6:10.2f}us {on / off:7.3f}")
    print(f"all-reduces counted while attached: {calls_seen} of {result['allreduces_made_attached']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
