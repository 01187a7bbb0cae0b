"""A job in one framework (PyTorch, CuPy or JAX) for tests/gpu/frameworks_leak_check.py, run under
`gpuwatch run`. It writes its own view of its memory to --log as JSON lines, the ground truth the
check holds the agent's reports against.

Modes:
  colors  holds a known amount: --hold-mib in live arrays, and as much again freed into the
          framework's pool (white below grey), then logs its own white and grey every 0.5 s for
          --seconds.
  leak    keeps --step-mib more in live arrays every 0.5 s until the framework raises its
          out-of-memory error; logs when the leak began and the OOM (its class, the bytes asked
          for), then raises it again, uncaught, as a job that dies of its OOM does.
  idle    imports the framework and never uses it: the agent must start no context or backend
          (it logs what the framework says about that at the end).

White and grey as the framework itself says them: torch.cuda.memory_allocated/memory_reserved,
CuPy's default pool used_bytes/total_bytes, JAX's device.memory_stats() bytes_in_use/pool_bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--framework", choices=("torch", "cupy", "jax"), required=True)
ap.add_argument("--mode", choices=("colors", "leak", "idle"), required=True)
ap.add_argument("--hold-mib", type=int, default=1024)
ap.add_argument("--step-mib", type=int, default=18)  # every 0.5 s: 2.1 GiB a minute
ap.add_argument("--seconds", type=float, default=10.0)
ap.add_argument("--log", required=True)
a = ap.parse_args()
log = open(a.log, "a", buffering=1)
MIB = 1 << 20


def note(**kw) -> None:
    log.write(json.dumps(dict(kw, t=time.time(), pid=os.getpid(), framework=a.framework, mode=a.mode)) + "\n")


if a.framework == "torch":
    import torch

    def alloc(n: int):
        return torch.empty(n, dtype=torch.uint8, device="cuda")

    def colors() -> tuple[int, int]:
        return torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)

    OOM = torch.OutOfMemoryError
elif a.framework == "cupy":
    import cupy

    def alloc(n: int):
        return cupy.empty(n, dtype=cupy.uint8)

    def colors() -> tuple[int, int]:
        pool = cupy.get_default_memory_pool()
        return pool.used_bytes(), pool.total_bytes()

    OOM = cupy.cuda.memory.OutOfMemoryError
else:
    import jax
    import jax.numpy as jnp

    def alloc(n: int):
        return jnp.zeros((n,), dtype=jnp.uint8).block_until_ready()

    def colors() -> tuple[int, int]:
        stats = jax.local_devices()[0].memory_stats() or {}
        return stats.get("bytes_in_use", -1), stats.get("pool_bytes", -1)

    OOM = RuntimeError  # jaxlib 0.4: XlaRuntimeError; newer: JaxRuntimeError; both RuntimeErrors, RESOURCE_EXHAUSTED

if a.mode == "idle":
    time.sleep(a.seconds)
    if a.framework == "jax":
        from jax._src import xla_bridge

        note(event="idle", backends_started=xla_bridge.backends_are_initialized())
    elif a.framework == "torch":
        note(event="idle", cuda_initialized=torch.cuda.is_initialized())
    else:
        note(event="idle")
    sys.exit(0)

if a.mode == "colors":
    kept = alloc(a.hold_mib * MIB)
    freed = alloc(a.hold_mib * MIB)
    del freed  # back into the pool: grey above white
    end = time.time() + a.seconds
    while time.time() < end:
        white, grey = colors()
        note(event="colors", white=white, grey=grey)
        time.sleep(0.5)
    sys.exit(0)

kept = [alloc(MIB)]  # the framework's context and pool first: the leak starts from there
note(event="leak_start", step_bytes=a.step_mib * MIB)
try:
    while True:
        asked = time.time()  # XLA retries a failed allocation for ~10 s before it raises: memory ran out here
        kept.append(alloc(a.step_mib * MIB))
        white, grey = colors()
        note(event="step", white=white, grey=grey, arrays=len(kept))
        time.sleep(0.5)
except OOM as e:
    if a.framework == "jax" and "RESOURCE_EXHAUSTED" not in str(e)[:40]:
        raise
    note(event="oom", error=f"{type(e).__module__}.{type(e).__qualname__}", message=str(e)[:300],
         requested_bytes=a.step_mib * MIB, arrays=len(kept), requested_at=asked)
    raise  # uncaught: the job dies of it
