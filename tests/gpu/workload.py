"""Start tests/gpu/cuda_workload.py for the GPU checks, with the environment it must have.

The tracer runs with the bcc bundle's libraries on LD_LIBRARY_PATH and PYTHONPATH; the traced
workload must not (GPU.md): it gets the values saved in WORKLOAD_* by tests/gpu/ebpf_check.sh.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--adds", type=int, default=20000)
    ap.add_argument("--mallocs", type=int, default=500)
    ap.add_argument("--malloc-bytes", type=int, default=1 << 20)
    ap.add_argument("--matmuls", type=int, default=50)


def env() -> dict:
    """The environment for a workload: the tracer's own LD_LIBRARY_PATH and PYTHONPATH (bcc's)
    replaced by the WORKLOAD_ ones the scripts export (the workload must not load bcc's libraries)."""
    out = dict(os.environ)
    for var in ("LD_LIBRARY_PATH", "PYTHONPATH"):
        orig = os.environ.get(f"WORKLOAD_{var}")
        if orig is None:
            out.pop(var, None)
        else:
            out[var] = orig
    return out


def start(a: argparse.Namespace, rounds: int = 1) -> subprocess.Popen:
    environ = env()
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # the expand phase: cuMemCreate/cuMemMap
    return subprocess.Popen([sys.executable, os.path.join(HERE, "cuda_workload.py"), "--adds", str(a.adds),
                             "--mallocs", str(a.mallocs), "--malloc-bytes", str(a.malloc_bytes),
                             "--matmuls", str(a.matmuls), "--rounds", str(rounds)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environ)
