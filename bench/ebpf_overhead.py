"""What the eBPF probe costs a PyTorch job, measured side by side in one run (GPU machine, root).

Two identical worker processes run the same work in alternation, round after round: one loads the
real libcuda (where the probe's uprobes are), the other a byte-identical copy of it under another
inode (LD_LIBRARY_PATH), which no uprobe touches. The rounds first run with no probe at all (the
two processes' own difference), then with the default probe attached system-wide to the real
libcuda. Overhead = (traced / control with the probe) / (traced / control without): the same
machine state, the same minutes, medians over the rounds.

Work: a tiny-op launch loop (x.add_(1) on 16 floats: launch-bound, the worst case) and a
training step (a 4-layer MLP, batch 256, width 2048: forward, backward, AdamW).

  python3 bench/ebpf_overhead.py --rounds 9 --out overhead.json    (see tests/gpu/ebpf_check.sh)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

WORKER = r'''
import sys, time, torch
x = torch.zeros(16, device="cuda")
model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(2048, 2048), torch.nn.GELU())]).cuda()
opt = torch.optim.AdamW(model.parameters())
data = torch.randn(256, 2048, device="cuda")
def tiny(n):
    for _ in range(n):
        x.add_(1)
def train(n):
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        opt.step()
tiny(1000); train(5); torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    what, n = line.split()
    t = time.perf_counter()
    (tiny if what == "tiny" else train)(int(n))
    torch.cuda.synchronize()
    print(f"{time.perf_counter() - t:.6f}", flush=True)
'''


class Worker:
    def __init__(self, env: dict) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env)
        assert self.p.stdout.readline().strip() == "ready"

    def run(self, what: str, n: int) -> float:
        self.p.stdin.write(f"{what} {n}\n")
        self.p.stdin.flush()
        return float(self.p.stdout.readline())

    def libcuda(self) -> list[str]:
        from gpuwatch.probes.ebpf import loader
        return [p for p in loader.mapped_files(self.p.pid) if loader.LIBCUDA_RE.search(p)]

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(60)


def rounds(traced: Worker, control: Worker, what: str, n: int, k: int) -> list[float]:
    """k ratios traced/control, the order alternating so neither always runs first."""
    out = []
    for i in range(k):
        if i % 2:
            c, t = control.run(what, n), traced.run(what, n)
        else:
            t, c = traced.run(what, n), control.run(what, n)
        out.append(t / c)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tiny", type=int, default=20000, help="launches per tiny-op round")
    ap.add_argument("--steps", type=int, default=20, help="training steps per round")
    ap.add_argument("--out")
    a = ap.parse_args()
    from gpuwatch.probes.ebpf import EbpfCudaProbe
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    for var in ("LD_LIBRARY_PATH", "PYTHONPATH"):
        if os.environ.get(f"WORKLOAD_{var}"):
            env[var] = os.environ[f"WORKLOAD_{var}"]
    traced = Worker(env)
    real = traced.libcuda()[0]
    copy_dir = tempfile.mkdtemp(prefix="gpuwatch-libcuda-copy-")
    shutil.copy2(real, os.path.join(copy_dir, "libcuda.so.1"))
    cenv = dict(env, LD_LIBRARY_PATH=copy_dir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else ""))
    control = Worker(cenv)
    result: dict = {"traced_libcuda": real, "control_libcuda": control.libcuda()}
    assert control.libcuda() and os.path.samefile(control.libcuda()[0], os.path.join(copy_dir, "libcuda.so.1")), \
        f"the control process did not load the copy: {control.libcuda()}"
    before = {w: rounds(traced, control, w, n, a.rounds) for w, n in (("tiny", a.tiny), ("train", a.steps))}
    probe = EbpfCudaProbe(libraries=[real], driver_names=False)  # system-wide, the daemon's default set
    probe.start()
    try:
        n_tiny_before = probe.snapshot(traced.p.pid)["apis"].get("cuLaunchKernel", {}).get("calls", 0)
        after = {w: rounds(traced, control, w, n, a.rounds) for w, n in (("tiny", a.tiny), ("train", a.steps))}
        snap = probe.snapshot(traced.p.pid)
        ctl = probe.snapshot(control.p.pid)
        # absolute times per tiny launch, probe attached (the traced one pays it)
        per_launch = {label: statistics.median(w.run("tiny", a.tiny) for _ in range(3)) / a.tiny
                      for label, w in (("control", control), ("traced", traced))}
    finally:
        probe.shutdown(wait=False)
    tiny_launches = snap["apis"].get("cuLaunchKernel", {}).get("calls", 0) - n_tiny_before
    control.close()
    traced.close()
    shutil.rmtree(copy_dir, ignore_errors=True)
    for w in ("tiny", "train"):
        b, t = statistics.median(before[w]), statistics.median(after[w])
        result[w] = {"ratios_without_probe": [round(r, 4) for r in before[w]],
                     "ratios_with_probe": [round(r, 4) for r in after[w]],
                     "median_without": round(b, 4), "median_with": round(t, 4), "overhead": round(t / b - 1, 4)}
    result["launches_counted_in_traced"] = tiny_launches
    result["calls_counted_in_control"] = sum(x["calls"] for x in ctl["apis"].values())
    result["per_launch_us_end"] = {k: round(v * 1e6, 3) for k, v in per_launch.items()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'work':8s} {'ratio without':>14s} {'ratio with':>11s} {'overhead':>9s}")
    for w in ("tiny", "train"):
        r = result[w]
        print(f"{w:8s} {r['median_without']:>14.4f} {r['median_with']:>11.4f} {r['overhead'] * 100:>8.2f}%")
    print(f"launches counted in the traced worker: {tiny_launches} (training launches included); in the control: "
          f"{result['calls_counted_in_control']} calls (must be 0); per tiny launch at the end, control/traced "
          f"{result['per_launch_us_end']} us")
    return 0 if result["calls_counted_in_control"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
