"""NVML probe: GPU health, clocks, power, memory, processes, GPM activity and XID events.

Every NVML call goes through backend.Backend.call. Recording and replay of NVML answers
(the only fake in gpuwatch) live in gpuwatch.probes.nvml.replay.
"""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Callable

from gpuwatch.agent.registry import ProbeEntry
from gpuwatch.probes.nvml.backend import Backend, RealBackend
from gpuwatch.probes.nvml.probe import NvmlProbe

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatch.agent.config import Config


def backend_factory(cfg: Config) -> Callable[[], Backend]:
    """The NVML backend the config asks for: the real library, or a recorded H200 replayed."""
    if cfg.nvml.replay:
        from gpuwatch.probes.nvml.replay import ReplayBackend

        return functools.partial(ReplayBackend, cfg.nvml.replay, gpus=cfg.nvml.replay_gpus or None,
                                 processes_per_gpu=cfg.nvml.replay_processes_per_gpu or None,
                                 event_wait_s=1.0,  # wait for XIDs as long as the real library does
                                 # Test tooling only (tests/reliability): faults injected into a
                                 # running agent; never read unless NVML is replayed.
                                 control=os.environ.get("GPUWATCH_TEST_NVML_CONTROL") or None)
    return RealBackend


def from_config(cfg: Config) -> NvmlProbe | None:
    """The daemon's NVML probe; None when nvml.enabled is false."""
    if not cfg.nvml.enabled:
        return None
    from gpuwatch.probes.process.kubernetes import PodResolver

    p = NvmlProbe(backend_factory(cfg), interval=cfg.nvml.interval,
                  slow_interval=cfg.nvml.slow_interval,
                  max_processes_per_gpu=cfg.nvml.max_processes_per_gpu,
                  xid_events=cfg.nvml.xid_events,
                  # Recorded pids are not this host's processes. Off Kubernetes a lookup is
                  # one read of /proc/PID/cgroup per new GPU process.
                  pods=None if cfg.nvml.replay else PodResolver())
    p.deadline = cfg.nvml.deadline
    return p


PROBES = (ProbeEntry("nvml", "nvml", 10, lambda ctx: from_config(ctx.cfg)),)
