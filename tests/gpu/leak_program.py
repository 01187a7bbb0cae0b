"""A PyTorch job that leaks GPU memory one known way, for tests/gpu/leak_check.py.

Modes:
  white   tensors kept in a list                       (allocated, reserved and the driver's charge grow)
  grey    the caching allocator's pool grows: each block is freed on a stream never used again, so
          the pool keeps it                             (reserved and the driver's charge grow, allocated flat)
  black   raw cudaMalloc without free, outside PyTorch (the driver's charge grows, reserved flat)
  steady  a training loop: step-shaped allocations, empty_cache() every 2 minutes: no leak. It runs
          beside the leaks, so a leak that fills the GPU can make one of its steps fail: that step
          is logged and skipped, as a job with retries would (it is not what the test judges).

First a ballast leaves --free-gib of the GPU free, so the real OOM comes within minutes; the leak
then grows by --rate-mib-per-min, in steps every 0.5 s, until the GPU is full. Ground truth goes
to --log as JSON lines: when the leak started and when the OOM came.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--mode", choices=("white", "grey", "black", "steady"), required=True)
ap.add_argument("--free-gib", type=float, default=6.0)
ap.add_argument("--rate-mib-per-min", type=float, default=1024.0)
ap.add_argument("--seconds", type=float, default=900.0, help="give up (no OOM) after this long")
ap.add_argument("--log", required=True)
a = ap.parse_args()
log = open(a.log, "a", buffering=1)
MIB = 1 << 20


def note(**kw) -> None:
    log.write(json.dumps(dict(kw, t=time.time(), mode=a.mode)) + "\n")


torch.cuda.init()
dev = torch.device("cuda", 0)
end = time.time() + a.seconds

if a.mode == "steady":
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    last_empty = time.time()
    note(event="start")
    steps = ooms = 0
    while time.time() < end:
        batch = 256 + 128 * (steps % 4)  # varying shapes: the pool sees several sizes
        try:
            x = torch.randn(batch, 4096, device=dev)
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
        except torch.OutOfMemoryError as e:
            ooms += 1
            note(event="step_oom", steps=steps, error=str(e)[:120])
            time.sleep(1)
        steps += 1
        if time.time() - last_empty > 120:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            last_empty = time.time()
    note(event="end", steps=steps, ooms=ooms)
    raise SystemExit(0)

free, total = torch.cuda.mem_get_info(dev)
ballast_bytes = max(0, int(free - a.free_gib * (1 << 30)))
ballast = [torch.empty(min(1 << 30, ballast_bytes - i), dtype=torch.uint8, device=dev)
           for i in range(0, ballast_bytes, 1 << 30)]
torch.cuda.synchronize()
free_after, _ = torch.cuda.mem_get_info(dev)
step_bytes = int(a.rate_mib_per_min * MIB / 120)  # every 0.5 s
note(event="leak_start", free_bytes=free_after, ballast_bytes=ballast_bytes, rate_bytes_per_second=step_bytes * 2)

kept: list = []
cudart = None
if a.mode in ("black", "grey"):
    # The libcudart PyTorch loaded (the one in its maps): cudaMalloc outside its caching allocator,
    # streams of our own, in the context PyTorch made current.
    import glob
    import os

    mapped = [line.split()[-1] for line in open("/proc/self/maps") if "/libcudart.so" in line]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so.*"))
    cudart = ctypes.CDLL((mapped or found or ["libcudart.so"])[0])
k = 0
try:
    while time.time() < end:
        k += 1
        if a.mode == "white":
            kept.append(torch.empty(step_bytes, dtype=torch.uint8, device=dev))
        elif a.mode == "grey":
            # The caching allocator keeps a freed block for the stream it was used on: a block freed
            # on a stream that is never used again is reserved for good (allocated stays flat).
            raw = ctypes.c_void_p()
            if cudart.cudaStreamCreate(ctypes.byref(raw)) != 0:
                raise RuntimeError("cudaStreamCreate failed")
            before = torch.cuda.memory_reserved(dev)
            with torch.cuda.stream(torch.cuda.ExternalStream(raw.value, device=dev)):
                block = torch.empty(step_bytes, dtype=torch.uint8, device=dev)
                del block
            if torch.cuda.memory_reserved(dev) < before:
                # The GPU was full: the allocator gave its cached blocks back and retried. That is this
                # leak's out-of-memory moment (it would fail outright once nothing is cached).
                raise torch.OutOfMemoryError("the caching allocator hit the GPU's limit and emptied its cache")
        else:
            ptr = ctypes.c_void_p()
            rc = cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(step_bytes))
            if rc != 0:
                raise torch.OutOfMemoryError(f"cudaMalloc returned {rc}")
            kept.append(ptr)
        time.sleep(0.5)
    note(event="no_oom", steps=k)
except torch.OutOfMemoryError as e:
    note(event="oom", steps=k, error=str(e)[:200])
