"""Check kernel names read from the driver's memory (probes/ebpf/driver_names.py) on a GPU.

1. calibrate() on the real libcuda: the offset chains from a handle to its name, and its time;
2. a PyTorch process compiles and launches a Triton kernel (handle and name known to it);
   from this process, resolve() reads that handle's name in the other process's memory.
Prints a table; exit 0 when the Triton kernel's name was read back exactly.

  python3 tests/gpu/driver_names_check.py --out names.json      (root, from the repository root)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time

from gpuwatch.probes.ebpf import driver_names, loader

CHILD = textwrap.dedent("""
    import os, sys, torch, triton, triton.language as tl

    @triton.jit
    def gw_scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    x = torch.ones(4096, device="cuda")
    k = gw_scale_kernel[(4,)](x, 4096, BLOCK=1024)
    torch.cuda.synchronize()
    x.add_(1); (x[:64].view(8, 8) @ x[:64].view(8, 8)).sum().item()
    handle = getattr(k, "function", None)
    print(f"ready {os.getpid()} {handle} {k.name}", flush=True)
    sys.stdin.readline()
""")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows, ok = [], True
    src = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)  # Triton reads its kernels' source
    src.write(CHILD)
    src.close()
    child = subprocess.Popen([sys.executable, src.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline().split()
    pid, handle, name = int(line[1]), int(line[2]), line[3]
    libs = loader.libraries_in(pid, loader.LIBCUDA_RE)
    print("libcuda:", libs)
    t0 = time.perf_counter()
    cal = driver_names.calibrate(libs[0])
    took = time.perf_counter() - t0
    print(f"calibration ({took:.2f} s): function {cal.function} kernel {cal.kernel} error {cal.error}")
    rows.append(("calibration seconds", f"{took:.2f}", "-"))
    with driver_names.Memory(pid) as mem:
        got = cal.name(mem, handle)
        per_chain = {str(c): (driver_names.resolve(mem, handle, c) or b"").decode() for c in cal.chains}
    print("per chain:", per_chain)
    rows.append(("Triton kernel name read", (got or b"").decode(), name))
    ok &= got is not None and got.decode() == name
    child.stdin.write("\n")
    child.stdin.flush()
    child.wait(30)
    json.dump({"function": cal.function, "kernel": cal.kernel, "error": cal.error, "seconds": took,
               "triton": {"handle": hex(handle), "expected": name, "read": (got or b"").decode(),
                          "per_chain": per_chain}}, open(a.out, "w"), indent=1)
    for what, seen, want in rows:
        print(f"{what:28s} {seen:>40s} {want:>40s}")
    print("OK" if ok else "BAD")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
