"""What the in-process CUPTI agent costs a PyTorch job, side by side on one GPU.

Modes, each a fresh process, run alternately (none, sampled, continuous, profiler, none, ...)
so drift (clocks, temperature) hits every mode alike:
  none        plain python: the baseline
  sampled     `gpuwatch run` defaults: kernel activity on 10 % of each 10 s period
  continuous  `gpuwatch run --kernels continuous`
  profiler    plain python inside torch.profiler.profile(activities=[CUDA]) (CUPTI tracing by PyTorch)
Workloads: `train` (a GPU-bound transformer training step: bf16, forward, backward, AdamW),
`small` (a launch-bound MLP step: ~100 short kernels, the CPU is the bottleneck) and `tiny`
(a Python loop of one-element adds: every launch pays the per-launch cost in full). Each
process warms up, then runs for --seconds (a whole duty period, so sampled mode averages its
on and off windows) and reports its mean time per step (time / steps: the rate a user sees).
Prints, per workload and mode, the median over rounds and the ratio to none.

    python3 bench/cupti_overhead.py --rounds 3 --seconds 10 --out overhead.json
(repo root on a GPU machine; gpuwatch and cupti-python importable, see tests/gpu/cupti_check.sh)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("none", "sampled", "continuous", "profiler")

CHILD = r'''
import json, sys, time, torch
workload, seconds, warmup, profiler = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
torch.cuda.init()
if workload == "train":
    # GPU-bound, like real training: a 4-layer transformer (d 2048, ffn 8192, 8 x 1024 tokens),
    # bf16, forward, backward, AdamW. The CPU runs ahead of the GPU.
    layer = lambda: torch.nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True, norm_first=True)
    model = torch.nn.Sequential(*[layer() for _ in range(4)]).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(8, 1024, 2048, device="cuda", dtype=torch.bfloat16)
    def step():
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()
    sync_every = 1
elif workload == "small":
    # Launch-bound: an MLP so small that each step is ~100 short kernels; the CPU is the bottleneck.
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.LayerNorm(1024)]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, 1024, device="cuda")
    def step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    sync_every = 1
else:
    t = torch.zeros(1, device="cuda")
    def step():
        t.add_(1.0)
    sync_every = 1000
def run(duration):
    n, t0 = 0, time.perf_counter()
    while True:
        step()
        n += 1
        if n % sync_every == 0:
            torch.cuda.synchronize()
            if time.perf_counter() - t0 >= duration:
                return n, time.perf_counter() - t0
run(warmup)
if profiler:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]):
        n, dt = run(seconds)
else:
    n, dt = run(seconds)
print(json.dumps({"steps": n, "seconds": dt, "step_seconds": dt / n}))
'''


def one(workload: str, mode: str, seconds: float, warmup: float) -> dict:
    child = [sys.executable, "-c", CHILD, workload, str(seconds), str(warmup), "1" if mode == "profiler" else "0"]
    if mode in ("sampled", "continuous"):
        cmd = [sys.executable, "-m", "gpuwatch.agent.cli", "run", "--kernels", mode, "--quiet",
               "--socket", "/nonexistent/gpuwatch.sock", "--report-dir", os.environ.get("TMPDIR", "/tmp"), "--"] + child
    else:
        cmd = child
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + warmup + 120)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{workload}/{mode} failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--workloads", default="train,small,tiny")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out")
    a = ap.parse_args()
    modes = tuple(m for m in a.modes.split(",") if m)
    if "none" not in modes or set(modes) - set(MODES):
        ap.error(f"--modes: none and any of {', '.join(MODES)}")
    runs: dict[str, dict[str, list[float]]] = {}
    for workload in a.workloads.split(","):
        runs[workload] = {m: [] for m in modes}
        for r in range(a.rounds):
            order = modes if r % 2 == 0 else tuple(reversed(modes))
            for mode in order:
                res = one(workload, mode, a.seconds, a.warmup)
                runs[workload][mode].append(res["step_seconds"])
                print(f"{workload:6} round {r + 1} {mode:10} {res['step_seconds'] * 1e6:9.2f} us/step "
                      f"({res['steps']} steps)", flush=True)
    table = {}
    print(f"\n{'workload':8} {'mode':11} {'median us/step':>15} {'vs none':>8}")
    for workload, modes in runs.items():
        base = statistics.median(modes["none"])
        for mode, values in modes.items():
            med = statistics.median(values)
            table[f"{workload}/{mode}"] = {"median_step_seconds": med, "ratio": med / base, "runs": values}
            print(f"{workload:8} {mode:11} {med * 1e6:15.2f} {med / base:8.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "seconds": a.seconds, "rounds": a.rounds,
                       "results": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
