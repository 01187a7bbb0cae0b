"""NVML probe: GPU health, clocks, power, memory, processes, GPM activity and XID events.

Every NVML call goes through backend.Backend.call. Recording and replay of NVML answers
(the only fake in gpuwatch) live in gpuwatch.probes.nvml.replay.
"""
from gpuwatch.probes.nvml.backend import (
    Backend, GpuLost, LibraryUnavailable, NotSupported, NoValue, NvmlError, RealBackend,
)
from gpuwatch.probes.nvml.doctor import nvml_checks
from gpuwatch.probes.nvml.probe import NvmlProbe, inventory

__all__ = [
    "Backend", "GpuLost", "LibraryUnavailable", "NotSupported", "NoValue", "NvmlError", "RealBackend",
    "NvmlProbe", "inventory", "nvml_checks",
]
