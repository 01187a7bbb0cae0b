"""Probes: sources of samples and events (NVML, eBPF, CUPTI, process, baseline)."""
