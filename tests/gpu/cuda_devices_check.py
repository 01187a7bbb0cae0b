"""CUDA_VISIBLE_DEVICES resolved from outside a process (probes/process/cuda_devices.py) against
what CUDA itself says inside it, on this machine's real GPUs.

For each environment below, a child process started with it prints the UUID of each of its CUDA
devices (torch.cuda.get_device_properties(i).uuid); the resolver, given the child's
/proc/PID/environ and NVML's GPUs (real pynvml), must name the same UUIDs, or a prefix of them
(it names nothing where it cannot be sure: indexes without CUDA_DEVICE_ORDER=PCI_BUS_ID on a node
of several GPUs) — never a different GPU. Also says whether CUDA's default FASTEST_FIRST order is
the PCI bus order here.

  python3 tests/gpu/cuda_devices_check.py [--out cuda_devices.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pynvml as N

from gpuwatch.probes.process import cuda_devices

CHILD = r'''
import sys, torch
print(" ".join("GPU-" + str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())),
      flush=True)
sys.stdin.readline()
'''


def nvml() -> list[cuda_devices.NvmlGpu]:
    N.nvmlInit()
    out = []
    for i in range(N.nvmlDeviceGetCount()):
        h = N.nvmlDeviceGetHandleByIndex(i)
        try:
            mig = N.nvmlDeviceGetMigMode(h)[0] == 1
        except N.NVMLError:
            mig = False
        out.append(cuda_devices.NvmlGpu(N.nvmlDeviceGetUUID(h), N.nvmlDeviceGetName(h),
                                        N.nvmlDeviceGetPciInfo(h).busId, mig))
    return sorted(out, key=lambda g: (g.pci_bus_id.lower(), g.uuid))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    gpus = nvml()
    n = len(gpus)
    u = [g.uuid for g in gpus]  # PCI bus order
    cases: list[dict] = [{}, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, {"CUDA_VISIBLE_DEVICES": "0"},
                         {"CUDA_VISIBLE_DEVICES": u[0][:12]}, {"CUDA_VISIBLE_DEVICES": "-1"},
                         {"CUDA_VISIBLE_DEVICES": f"0,x,{n - 1}", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}]
    if n >= 2:
        cases += [{"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, {"CUDA_VISIBLE_DEVICES": "1,0"},
                  {"CUDA_VISIBLE_DEVICES": f"{u[1][:12]},{u[0][:12]}"},
                  {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in reversed(range(n))),
                   "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}]
    bad, rows = 0, []
    for extra in cases:
        env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
        env.update(extra)
        p = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        cuda = p.stdout.readline().split()
        named = cuda_devices.visible_uuids(cuda_devices.read_cuda_environment(p.pid), gpus)
        p.stdin.close()
        p.wait(30)
        ok = list(named) == cuda[:len(named)]
        bad += not ok
        rows.append({"env": extra, "cuda": cuda, "resolved": list(named), "ok": ok})
        print(f"{'OK ' if ok else 'BAD'} {extra or 'no CUDA_* variables'}: CUDA {[c[:12] for c in cuda]}, "
              f"resolved {[c[:12] for c in named]}", flush=True)
    fastest = next(r["cuda"] for r in rows if r["env"] == {})
    print(f"CUDA's default order {'is' if fastest == u else 'is NOT'} the PCI bus order here ({n} GPUs)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpus": [g.__dict__ for g in gpus], "cases": rows, "default_is_pci_order": fastest == u}, f,
                      indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
