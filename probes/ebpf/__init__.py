"""eBPF probe on the CUDA driver API: uprobes on libcuda's exported functions.

Counts, errors, time and bytes per process and API, log2 latency histograms and live device
allocations are aggregated in the kernel (cuda.bpf.c); the hooked symbols and the struct layouts
shared with the C side are in symbols.py; compiler.py has bcc (Debian's python3-bpfcc) compile
the program in a child process and caches the object; loader.py loads it, finds libcuda and
attaches (bpfsys.py: the system calls); probe.py turns the maps into samples.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from gpuwatch.agent.registry import Context, ProbeEntry
from gpuwatch.agent.allocators import pool_table
from gpuwatch.probes.ebpf.probe import EbpfCudaProbe

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatch.agent.config import Config

__all__ = ["EbpfCudaProbe", "from_config", "PROBES"]


def from_config(cfg: Config) -> EbpfCudaProbe | None:
    """The daemon's system-wide eBPF probe; None when ebpf.enabled is false."""
    if not cfg.ebpf.enabled:
        return None
    p = EbpfCudaProbe(libraries=[cfg.ebpf.library] if cfg.ebpf.library else (), max_processes=cfg.ebpf.max_processes,
                      attach=cfg.ebpf.attach, launch_sampling=cfg.ebpf.launch_sampling,
                      pools=pool_table(cfg.ebpf.pool_libraries), exact_launch_rate=cfg.ebpf.launch_budget,
                      young_seconds=cfg.ebpf.new_process_exact)
    p.deadline = 30.0  # the first start on a machine compiles the BPF program (1-6 s; then it is cached)
    return p


def _made(ctx: Context) -> EbpfCudaProbe | None:
    p = from_config(ctx.cfg)
    if p is not None:
        p.budgets = ctx.budgets  # graphs, libraries, uprobes, stacks: one set with the other probes
    return p


PROBES = (ProbeEntry("ebpf", "ebpf", 20, _made),)
