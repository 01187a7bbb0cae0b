"""A small PyTorch job for the H200 checks: holds a known amount of memory and keeps the GPU busy.

Usage: python3 tests/gpu/load.py --seconds 120 --hold-gib 2 [--duty 0.7]
Prints one JSON line at start with its pid and the bytes it holds, so checks have ground truth.
"""
import argparse
import json
import os
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--seconds", type=float, default=120)
ap.add_argument("--hold-gib", type=float, default=2.0)
ap.add_argument("--size", type=int, default=4096)
ap.add_argument("--duty", type=float, default=0.7, help="fraction of each 100 ms spent in GEMMs")
a = ap.parse_args()

dev = torch.device("cuda")
hold = torch.empty(int(a.hold_gib * 2**30), dtype=torch.uint8, device=dev)
x = torch.randn(a.size, a.size, dtype=torch.bfloat16, device=dev)
y = torch.randn(a.size, a.size, dtype=torch.bfloat16, device=dev)
torch.cuda.synchronize()
print(json.dumps({"pid": os.getpid(), "held_bytes": hold.numel(),
                  "reserved_bytes": torch.cuda.memory_reserved()}), flush=True)
end = time.monotonic() + a.seconds
gemms = 0
while time.monotonic() < end:
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.1 * a.duty:
        for _ in range(8):
            z = x @ y
        torch.cuda.synchronize()
        gemms += 8
    time.sleep(max(0.0, 0.1 * (1 - a.duty)))
print(json.dumps({"gemms": gemms}), flush=True)
