"""eBPF probe on the CUDA driver API: bcc uprobes on libcuda's exported functions.

Counts, errors, time and bytes per process and API, log2 latency histograms and live device
allocations are aggregated in the kernel (cuda.bpf.c); the hooked symbols and the struct layouts
shared with the C side are in symbols.py; loader.py finds libcuda, compiles and attaches.
bcc (Debian's python3-bpfcc) is imported only when the probe starts.
"""
from gpuwatch.probes.ebpf.probe import EbpfCudaProbe
from gpuwatch.probes.ebpf.symbols import API_NAMES, HOOKS, Hook

__all__ = ["EbpfCudaProbe", "API_NAMES", "HOOKS", "Hook"]
