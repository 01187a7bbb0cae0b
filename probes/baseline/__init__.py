"""The reference workload: a fused GEMM + bias + GELU in Triton beside cuBLAS, an unfused
PyTorch version and a bandwidth kernel, timed in one run with the GPU's clocks, power and
throttle reasons, and checked against a float64 reference (docs/baseline.md).

torch and triton are the optional extra `gpuwatch[baseline]`; this module imports neither, so
the agent can say what is missing without them.
"""
from __future__ import annotations

import importlib.util

from gpuwatch.agent.registry import Context, ProbeEntry

INSTALL_HINT = "pip install 'gpuwatch[baseline]' (torch and triton) in gpuwatch's environment"


def missing() -> str | None:
    """Why the workload cannot run here (a sentence with the fix), or None when it can be tried."""
    absent = [m for m in ("torch", "triton") if importlib.util.find_spec(m) is None]
    if absent:
        return f"{' and '.join(absent)} not importable: {INSTALL_HINT}"
    return None


def _made(ctx: Context):
    """The reference workload: judged runs kept in the store; unavailable without torch/triton."""
    cfg = ctx.cfg.baseline
    if not cfg.enabled:
        return None
    from gpuwatch.agent.own import GpuTenant
    from gpuwatch.probes.baseline.probe import BaselineProbe
    from gpuwatch.probes.baseline.verdict import HealthSettings
    from gpuwatch.probes.cupti.reports import nvml_view

    return BaselineProbe(ctx.store, every=cfg.interval, python=cfg.python, timeout=cfg.timeout, replay=cfg.replay,
                         # The GPUs the NVML probe (their one owner) saw last, replayed ones included: a run is
                         # kept under the UUID of the GPU it was asked to run on, never under what the child printed.
                         gpus=lambda: [uuid for _, uuid in ctx.inventory().gpus],
                         # The agent's own CUDA contexts (the CUPTI sampler) are not a user's: left out of the
                         # busy check, and stepped aside while a run holds the GPU.
                         tenants=[p for p in ctx.probes if isinstance(p, GpuTenant)],
                         settings=HealthSettings(k_spread=cfg.k_spread, min_drop=cfg.min_drop,
                                                 min_drop_memory=cfg.min_drop_memory, retakes=cfg.retakes),
                         # replayed runs replay their own busy answers
                         compute_processes=None if cfg.replay
                         else lambda uuid: ctx.inventory().view(nvml_view).get(uuid))


PROBES = (ProbeEntry("baseline", "baseline", 90, _made),)
