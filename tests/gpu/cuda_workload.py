"""A PyTorch process whose CUDA driver calls are known, for checking the eBPF probe on a GPU.

It prints "ready <pid>" once CUDA is initialised and its kernels are loaded, then waits for a
line on stdin before each phase (add x 2*rounds, malloc, matmul, fresh), printing "done <phase> <seconds>":
  add      N x.add_(1) on a small tensor      -> N cuLaunchKernel (via cudaLaunchKernel)
  malloc   M raw cudaMalloc(S) + cudaFree     -> M cuMemAlloc_v2 (S bytes each) + M cuMemFree_v2
  matmul   K bf16 matmuls 1024^3 (cuBLAS)     -> K cuLaunchKernelEx
  fresh    F sin_ + F cos_ on a 1M tensor     -> 2F cuLaunchKernel of kernels first loaded now
  triton   T launches of a Triton kernel compiled before "ready" -> T launches of gw_scale_kernel
  graph    G replays of a CUDA graph captured before "ready"     -> G cuGraphLaunch
  expand   a 1 GiB tensor with expandable segments (PYTORCH_CUDA_ALLOC_CONF, set by workload.py)
           -> cuMemCreate + cuMemMap of at least 1 GiB, then freed with the tensor's segment kept
Usage: python3 tests/gpu/cuda_workload.py --adds 20000 --mallocs 500 --malloc-bytes 1048576 --matmuls 50
"""
import argparse
import ctypes
import os
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def gw_scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 1.0001, mask=i < n)


ap = argparse.ArgumentParser()
ap.add_argument("--adds", type=int, default=20000)
ap.add_argument("--mallocs", type=int, default=500)
ap.add_argument("--malloc-bytes", type=int, default=1 << 20)
ap.add_argument("--matmuls", type=int, default=50)
ap.add_argument("--rounds", type=int, default=1)
ap.add_argument("--fresh", type=int, default=100, help="sin_ and cos_ launches in the fresh phase")
ap.add_argument("--tritons", type=int, default=300)
ap.add_argument("--graphs", type=int, default=97)
ap.add_argument("--expand-bytes", type=int, default=1 << 30)
a = ap.parse_args()

x = torch.zeros(16, device="cuda")
m1 = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
m2 = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
y = torch.ones(1 << 20, device="cuda")  # for the fresh phase: allocated now, so it launches only sin/cos
x.add_(1); m1 @ m2  # load the kernels and cuBLAS before the tracer counts
t = torch.ones(4096, device="cuda")
gw_scale_kernel[(4,)](t, 4096, BLOCK=1024)  # compiled and loaded now: its handle predates any tracer
g_in = torch.zeros(256, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    g_in.mul_(2)  # warm-up before capture
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    g_in.mul_(2)
    g_in.add_(1)
torch.cuda.synchronize()
cudart = None
for lib in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
    try:
        cudart = ctypes.CDLL(lib)
        break
    except OSError:
        pass
if cudart is None:  # torch's own copy
    import glob
    cands = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*"))
    cudart = ctypes.CDLL(sorted(cands)[-1])
print(f"ready {os.getpid()}", flush=True)


def phase(name, fn):
    if not sys.stdin.readline():
        sys.exit(0)
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    print(f"done {name} {time.perf_counter() - t:.4f}", flush=True)


def adds():
    for _ in range(a.adds):
        x.add_(1)


def mallocs():
    ptr = ctypes.c_void_p()
    for _ in range(a.mallocs):
        assert cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(a.malloc_bytes)) == 0
        assert cudart.cudaFree(ptr) == 0


def fresh():
    for _ in range(a.fresh):
        y.sin_()
        y.cos_()


def tritons():
    for _ in range(a.tritons):
        gw_scale_kernel[(4,)](t, 4096, BLOCK=1024)


def graphs():
    for _ in range(a.graphs):
        graph.replay()


def expand():
    big = torch.empty(a.expand_bytes, dtype=torch.uint8, device="cuda")
    big.fill_(1)
    del big


def matmuls():
    for _ in range(a.matmuls):
        m1 @ m2


# add phases in two groups of --rounds: the tracer attaches between the groups, so the medians
# of the two give its overhead (the first phase of all also warms up, so it is not counted).
for _ in range(2 * a.rounds):
    phase("add", adds)
phase("malloc", mallocs)
phase("matmul", matmuls)
phase("fresh", fresh)  # kernels this process has not launched before: loaded (and named) now
phase("triton", tritons)
phase("graph", graphs)
phase("expand", expand)
sys.stdin.readline()
