"""A PyTorch job whose GPU work and allocator bytes are known, for tests/gpu/cupti_check.py.

Run under `gpuwatch run` (the in-process agent). It writes its own ground truth as JSON lines
to --log: every change of torch.cuda.memory_allocated()/memory_reserved() with the time it
took effect, the exact number of launches of the add kernel, the CUDA-event time of a run of
matmuls, and what torch.profiler saw while the agent stepped aside.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--log", required=True)
ap.add_argument("--adds", type=int, default=1000)
ap.add_argument("--matmuls", type=int, default=20)
ap.add_argument("--hold", type=float, default=1.2, help="seconds between memory changes")
a = ap.parse_args()
log = open(a.log, "w", buffering=1)


def note(**kw) -> None:
    log.write(json.dumps(dict(kw, t=time.time())) + "\n")


def memory(phase: str, change=lambda: None) -> None:
    """Make one change, then record when it began (t0) and ended (t) with the bytes it left."""
    t0 = time.time()
    change()
    torch.cuda.synchronize()
    note(phase=phase, t0=t0, allocated=torch.cuda.memory_allocated(0), reserved=torch.cuda.memory_reserved(0))
    time.sleep(a.hold)


torch.cuda.init()
note(phase="start", uuid="GPU-" + str(torch.cuda.get_device_properties(0).uuid))
# Memory: white up (new tensors), white down with grey kept (freed into the cache), grey down.
held: list = []
memory("empty")
for mib in (64, 256, 1024):
    memory(f"alloc {mib} MiB", lambda: held.append(torch.empty(mib << 20, dtype=torch.uint8, device="cuda")))
memory("freed 256 MiB (cached)", lambda: held.pop(1))
memory("freed all (cached)", held.clear)
memory("empty_cache", torch.cuda.empty_cache)

# Kernels with known counts: one add kernel, a.adds times, on a tensor no other op touches.
x = torch.zeros(1 << 20, device="cuda")
torch.cuda.synchronize()
note(phase="adds begin")
for _ in range(a.adds):
    x.add_(1.0)
torch.cuda.synchronize()
note(phase="adds end", adds=a.adds, value=float(x[0]))

# Matmuls timed by CUDA events on the stream: CUPTI's kernel durations should add up to it.
m = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    m @ m  # cuBLAS heuristics and workspace before the timed run
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(a.matmuls):
    m @ m
end.record()
torch.cuda.synchronize()
note(phase="matmuls", matmuls=a.matmuls, warmup=3, event_seconds=start.elapsed_time(end) / 1e3)
time.sleep(1.5)  # a report with all of the above

# torch.profiler takes CUPTI; the agent steps aside and comes back after.
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        x.sqrt_()
    torch.cuda.synchronize()
    time.sleep(0.6)  # a report while the profiler holds CUPTI
cuda_events = sum(1 for e in prof.events() if "sqrt" in e.name)
note(phase="profiler", sqrts=10, profiler_sqrt_events=cuda_events)
time.sleep(1.0)
for _ in range(100):
    x.neg_()
torch.cuda.synchronize()
note(phase="after profiler", negs=100)
time.sleep(1.5)
note(phase="end")
