"""eBPF probe on the CUDA driver API: bcc uprobes on libcuda's exported functions.

Counts, errors, time and bytes per process and API, log2 latency histograms and live device
allocations are aggregated in the kernel (cuda.bpf.c); the hooked symbols and the struct layouts
shared with the C side are in symbols.py; loader.py finds libcuda, compiles and attaches.
bcc (Debian's python3-bpfcc) is imported only when the probe starts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from gpuwatch.probes.ebpf.probe import EbpfCudaProbe
from gpuwatch.probes.ebpf.symbols import API_NAMES, HOOKS, Hook

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatch.agent.config import Config

__all__ = ["EbpfCudaProbe", "API_NAMES", "HOOKS", "Hook", "from_config"]


def from_config(cfg: Config) -> EbpfCudaProbe | None:
    """The daemon's system-wide eBPF probe (agent/daemon.py PROBE_FACTORIES); None when
    ebpf.enabled is false."""
    if not cfg.ebpf.enabled:
        return None
    p = EbpfCudaProbe(libraries=[cfg.ebpf.library] if cfg.ebpf.library else (), max_processes=cfg.ebpf.max_processes)
    p.deadline = 10.0  # the first collection compiles the BPF program (1-3 s)
    return p
