"""The reference workload: a fused GEMM + bias + GELU in Triton beside cuBLAS, an unfused
PyTorch version and a bandwidth kernel, timed in one run with the GPU's clocks, power and
throttle reasons, and checked against a float64 reference (docs/baseline.md).

torch and triton are the optional extra `gpuwatch[baseline]`; this module imports neither, so
the agent can say what is missing without them.
"""
from __future__ import annotations

import importlib.util

INSTALL_HINT = "pip install 'gpuwatch[baseline]' (torch and triton) in gpuwatch's environment"


def missing() -> str | None:
    """Why the workload cannot run here (a sentence with the fix), or None when it can be tried."""
    absent = [m for m in ("torch", "triton") if importlib.util.find_spec(m) is None]
    if absent:
        return f"{' and '.join(absent)} not importable: {INSTALL_HINT}"
    return None
