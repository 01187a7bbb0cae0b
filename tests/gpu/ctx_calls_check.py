"""Which CUDA context calls a real framework makes where a uprobe sees them, before its allocations.

A question for the probe's design, answered on the GPU machine: to put an allocation on its GPU,
the eBPF probe would follow each thread's current context (cuCtxSetCurrent, cuCtxPushCurrent,
cuCtxCreate, cuDevicePrimaryCtxRetain's context and device) or read the device from the call
itself (cuMemCreate's CUmemAllocationProp.location, a pool's device). That works only if the
runtime reaches those through libcuda's exported symbols. This script hooks them with plain bcc
uprobes on the real libcuda, runs PyTorch workloads (the caching allocator's cudaMalloc path,
expandable segments, the cudaMallocAsync backend; each allocating from the main thread and from a
second thread, and on every GPU the machine has), and says for every allocation whether its
device was known from what the uprobes saw before it, and whether those devices are every GPU the
workload allocated on.

    python3 tests/gpu/ctx_calls_check.py --out DIR     (root; bcc on PYTHONPATH; torch for python3)
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import subprocess
import sys
from collections import defaultdict

from bcc import BPF  # type: ignore[import-not-found]

FNS = ["cuCtxSetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuDevicePrimaryCtxRetain",
       "cuCtxCreate_v2", "cuCtxCreate_v3", "cuCtxCreate_v4", "cuCtxGetCurrent", "cuCtxGetDevice",
       "cuMemAlloc_v2", "cuMemAllocAsync", "cuMemAllocFromPoolAsync", "cuMemCreate", "cuMemPoolCreate",
       "cuDeviceGetDefaultMemPool", "cuDeviceGetMemPool", "cuMemAllocManaged", "cuMemFree_v2"]
ALLOCS = {"cuMemAlloc_v2", "cuMemAllocAsync", "cuMemAllocFromPoolAsync", "cuMemCreate", "cuMemAllocManaged"}

PROG = r"""
#include <uapi/linux/ptrace.h>
struct ev { u32 tgid; u32 tid; u32 fn; u32 ret; u64 a0; u64 a1; u64 a2; u64 a3; u64 out; u64 loc; u64 ts; };
struct call { u64 a0; u64 a1; u64 a2; u64 a3; };
BPF_HASH(calls, u64, struct call);
BPF_PERF_OUTPUT(evs);

static int enter(struct pt_regs *ctx, u32 fn) {
    u64 id = bpf_get_current_pid_tgid();
    struct call c = {PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx)};
    u64 k = (id << 8) ^ fn;
    calls.update(&k, &c);
    return 0;
}

static int leave(struct pt_regs *ctx, u32 fn) {
    u64 id = bpf_get_current_pid_tgid();
    u64 k = (id << 8) ^ fn;
    struct call *c = calls.lookup(&k);
    if (!c)
        return 0;
    struct ev e = {};
    e.tgid = id >> 32;
    e.tid = (u32)id;
    e.fn = fn;
    e.ret = (u32)PT_REGS_RC(ctx);
    e.a0 = c->a0;
    e.a1 = c->a1;
    e.a2 = c->a2;
    e.a3 = c->a3;
    e.ts = bpf_ktime_get_ns();
    // the first argument is an out pointer for most of them: what it holds now
    bpf_probe_read_user(&e.out, sizeof(e.out), (void *)c->a0);
    // cuMemCreate(handle *, size, const CUmemAllocationProp *prop, flags): location {type, id} at +8
    if (c->a2)
        bpf_probe_read_user(&e.loc, sizeof(e.loc), (void *)(c->a2 + 8));
    calls.delete(&k);
    evs.perf_submit(ctx, &e, sizeof(e));
    return 0;
}
"""


class Ev(ctypes.Structure):
    _fields_ = [("tgid", ctypes.c_uint32), ("tid", ctypes.c_uint32), ("fn", ctypes.c_uint32), ("ret", ctypes.c_uint32),
                ("a0", ctypes.c_uint64), ("a1", ctypes.c_uint64), ("a2", ctypes.c_uint64), ("a3", ctypes.c_uint64), ("out", ctypes.c_uint64),
                ("loc", ctypes.c_uint64), ("ts", ctypes.c_uint64)]


WORKLOAD = r"""
import threading, torch
torch.cuda.set_device(0)
a = torch.empty(8 << 20, device="cuda")            # 32 MiB from the main thread
def other():
    b = torch.empty(16 << 20, device="cuda")      # 64 MiB from a second thread
    torch.cuda.synchronize()
t = threading.Thread(target=other); t.start(); t.join()
c = torch.empty(1 << 28, dtype=torch.uint8, device="cuda:0")  # 256 MiB by an explicit device
n = torch.cuda.device_count()
more = [torch.empty(1 << 26, dtype=torch.uint8, device=f"cuda:{d}") for d in range(1, n)]  # 64 MiB on each other GPU
def last():
    torch.cuda.set_device(n - 1)
    x = torch.empty(1 << 25, dtype=torch.uint8, device="cuda")   # 32 MiB from a thread on the last GPU
    torch.cuda.synchronize()
t = threading.Thread(target=last); t.start(); t.join()
torch.cuda.synchronize()
print("workload done", n, flush=True)
"""
CASES = {"caching allocator (cudaMalloc)": {}, "expandable segments (cuMemCreate)":
         {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
         "cudaMallocAsync backend": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}}


def libcuda() -> str:
    for pat in ("/usr/local/nvidia/lib64/libcuda.so.*", "/usr/lib/x86_64-linux-gnu/libcuda.so.*", "/usr/lib64/libcuda.so.*"):
        for p in sorted(glob.glob(pat)):
            if not os.path.islink(p):
                return p
    sys.exit("no libcuda found")


def judge(events: list[dict]) -> dict:
    """Replay the events in time order: each thread's current context, each context's device; say for
    each allocation whether its device was known (and what it was), and from what."""
    ctx_dev: dict[int, int] = {}
    cur: dict[int, int] = {}
    pool_dev: dict[int, int] = {}
    out = {"allocations": 0, "known": 0, "unknown": [], "devices": defaultdict(int), "by": defaultdict(int)}
    for e in sorted(events, key=lambda e: e["ts"]):
        fn, ok, tid = e["fn"], e["ret"] == 0, e["tid"]
        if not ok:
            continue
        if fn == "cuDevicePrimaryCtxRetain":
            ctx_dev[e["out"]] = e["a1"]
        elif fn in ("cuCtxCreate_v2", "cuCtxCreate_v3", "cuCtxCreate_v4"):
            dev = {"cuCtxCreate_v2": e["a2"], "cuCtxCreate_v3": None, "cuCtxCreate_v4": e["a3"]}[fn]
            if dev is not None:
                ctx_dev[e["out"]] = dev
            cur[tid] = e["out"]
        elif fn in ("cuCtxSetCurrent", "cuCtxPushCurrent_v2"):
            cur[tid] = e["a0"]
        elif fn == "cuCtxPopCurrent_v2":
            cur.pop(tid, None)
        elif fn in ("cuDeviceGetDefaultMemPool", "cuDeviceGetMemPool"):
            pool_dev[e["out"]] = e["a1"]
        elif fn in ALLOCS:
            out["allocations"] += 1
            if fn == "cuMemCreate":
                dev, by = (e["loc"] >> 32) & 0xFFFFFFFF, "cuMemCreate's location"
            elif fn == "cuMemAllocFromPoolAsync" and e["a2"] in pool_dev:
                dev, by = pool_dev[e["a2"]], "its pool's device"
            else:
                dev = ctx_dev.get(cur.get(tid, -1))
                by = "the thread's current context"
            if dev is None:
                out["unknown"].append({"fn": fn, "tid": tid, "bytes": e["a1"]})
            else:
                out["known"] += 1
                out["devices"][dev] += 1
                out["by"][f"{fn} by {by}"] += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lib = libcuda()
    b = BPF(text=PROG + "".join(f"int e{i}(struct pt_regs *ctx) {{ return enter(ctx, {i}); }}\n"
                                f"int r{i}(struct pt_regs *ctx) {{ return leave(ctx, {i}); }}\n"
                                for i in range(len(FNS))))
    attached = []
    for i, fn in enumerate(FNS):
        try:
            b.attach_uprobe(name=lib, sym=fn, fn_name=f"e{i}")
            b.attach_uretprobe(name=lib, sym=fn, fn_name=f"r{i}")
            attached.append(fn)
        except Exception as exc:  # a symbol this driver does not export
            print(f"not hooked: {fn}: {exc}")
    events: list[dict] = []

    def on(cpu, data, size):
        e = ctypes.cast(data, ctypes.POINTER(Ev)).contents
        events.append({"tgid": e.tgid, "tid": e.tid, "fn": FNS[e.fn], "ret": e.ret, "a0": e.a0, "a1": e.a1,
                       "a2": e.a2, "a3": e.a3, "out": e.out, "loc": e.loc, "ts": e.ts})

    b["evs"].open_perf_buffer(on, page_cnt=256)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    if os.environ.get("WORKLOAD_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["WORKLOAD_PYTHONPATH"]
    if os.environ.get("WORKLOAD_LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = os.environ["WORKLOAD_LD_LIBRARY_PATH"]
    results = {"libcuda": lib, "hooked": attached, "cases": {}}
    ok = True
    for name, extra in CASES.items():
        events.clear()
        p = subprocess.Popen([sys.executable if not os.environ.get("WORKLOAD_PYTHON") else os.environ["WORKLOAD_PYTHON"],
                              "-c", WORKLOAD], env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        while p.poll() is None:
            b.perf_buffer_poll(timeout=100)
        for _ in range(5):
            b.perf_buffer_poll(timeout=100)
        output = p.stdout.read()
        mine = [e for e in events if e["tgid"] == p.pid]
        verdict = judge(mine)
        counts = defaultdict(int)
        for e in mine:
            counts[e["fn"]] += 1
        results["cases"][name] = {"rc": p.returncode, "output_tail": output[-2000:], "calls": dict(counts),
                                  "verdict": {**verdict, "devices": dict(verdict["devices"]), "by": dict(verdict["by"])},
                                  "events": [{**e, "a0": hex(e["a0"]), "out": hex(e["out"])} for e in mine[:400]]}
        done = [line.split() for line in output.splitlines() if line.startswith("workload done")]
        gpus = int(done[-1][2]) if done else 0
        # every allocation's device known, and every GPU the workload allocated on among them
        good = (p.returncode == 0 and verdict["allocations"] > 0 and verdict["known"] == verdict["allocations"]
                and set(verdict["devices"]) == set(range(gpus)))
        ok &= good
        print(f"{'OK ' if good else 'BAD'} {name}: rc {p.returncode}, {verdict['allocations']} allocations, "
              f"{verdict['known']} with a known device {dict(verdict['devices'])}; by {dict(verdict['by'])}; "
              f"calls {dict(counts)}", flush=True)
    with open(os.path.join(args.out, "ctx_calls.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
