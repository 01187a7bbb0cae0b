"""gpuwatch's device-wide counters against Nsight Compute on the same kernels (issue 34).

Four known workloads, real kernels (compiled here with NVRTC, launched through the driver API in a
PyTorch context; no memcpy, which ncu does not profile):
  stream   a copy kernel over 4 GiB (ping-pong between two 4 GiB buffers): DRAM-bound, L2 misses
  l2       the same kernel over 16 MiB (two 8 MiB buffers), 200 passes per launch: L2-resident
  bank     shared-memory reads where all 32 lanes hit one bank (32-way conflicts)
  occ      64 threads and 200 KiB of dynamic shared memory per block: 2 warps per SM (3.1 %)
(a) the real gpuwatch sampler child (python -m gpuwatch.probes.cupti.sampler, device-wide, JSON lines)
    runs while the workload process runs each phase for --phase-seconds; each value window that
    lies inside a phase is kept;
(b) `ncu --clock-control none --cache-control none --metrics ...` profiles a few launches of the
    same kernels (the workload in --ncu mode).
Prints per phase gpuwatch vs ncu for L2 hit, L1 hit, DRAM throughput, achieved occupancy (percent,
difference in percentage points) and bank conflicts (per second, relative difference).

Usage (repo root, GPU machine): tests/gpu/ncu_compare_check.sh  (sources env.sh for the CUPTI wheels)
or: python3 tests/gpu/ncu_compare_check.py --out "$OUT" [--phase-seconds 8] [--context bindings]
Writes $OUT/ncu_compare.json, sampler.jsonl, ncu.csv; about 2-3 minutes.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

PHASES = ("stream", "l2", "bank", "occ")
GROUPS = "occupancy,l1_hit,l2_hit,dram,bank_conflicts"
# gpuwatch group -> (ncu metric, how to show it)
COMPARE = {
    "l2_hit": ("lts__t_sector_hit_rate.pct", "pct"),
    "l1_hit": ("l1tex__t_sector_hit_rate.pct", "pct"),
    "dram": ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "pct"),
    "occupancy": ("sm__warps_active.avg.pct_of_peak_sustained_active", "pct"),
    "bank_conflicts": ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", "rate"),
}
NCU_EXTRA = ["gpu__time_duration.sum"]
# gpuwatch's L2 metric is PM sampling's realtime one; ncu may or may not know it (asked separately).
NCU_REALTIME_L2 = "lts__average_t_sector_hit_rate_realtime.pct"

SOURCE = r"""
extern "C" __global__ void gw_copy(float4* a, float4* b, unsigned long long n, int reps) {
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (int r = 0; r < reps; ++r) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += stride) {
      if (r & 1) a[i] = b[i]; else b[i] = a[i];
    }
  }
}
extern "C" __global__ void gw_bank(float* out, int iters) {
  __shared__ float s[8192];
  int t = threadIdx.x;
  for (int i = t; i < 8192; i += blockDim.x) s[i] = (float)i;
  __syncthreads();
  float acc = 0.f;
  for (int k = 0; k < iters; ++k) acc += s[(t * 32 + k) & 8191];  // every lane of a warp in bank k % 32
  out[blockIdx.x * blockDim.x + t] = acc;
}
extern "C" __global__ void gw_occ(float* out, int iters) {
  extern __shared__ float big[];
  int t = threadIdx.x;
  big[t] = (float)t;
  __syncthreads();
  float a = big[t], m = 1.0001f;
  for (int k = 0; k < iters; ++k) a = a * m + 0.5f;
  out[blockIdx.x * blockDim.x + t] = a;
}
"""


# -- the workload (a child process: --workload or --ncu) ---------------------------------------------

def ck(res):
    res = res if isinstance(res, tuple) else (res,)
    if int(res[0]) != 0:
        raise RuntimeError(f"CUDA call failed: {res[0]!r}")
    return res[1] if len(res) == 2 else res[1:]


class Kernels:
    def __init__(self) -> None:
        import torch
        from cuda.bindings import driver, nvrtc

        self.torch, self.drv = torch, driver
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the primary context, current on this thread
        major, minor = torch.cuda.get_device_capability()
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        prog = ck(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"gw.cu", 0, [], []))
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]  # NVRTC optimises by default; it refuses -O3
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(res[0]) != 0:
            size = ck(nvrtc.nvrtcGetProgramLogSize(prog))
            buf = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, buf)
            raise RuntimeError("nvrtc: " + buf.decode(errors="replace"))
        size = ck(nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        ck(nvrtc.nvrtcGetCUBIN(prog, cubin))
        self._image = ctypes.create_string_buffer(cubin, len(cubin))  # kept alive with the module
        self.module = ck(driver.cuModuleLoadData(ctypes.addressof(self._image)))
        self.f = {n: ck(driver.cuModuleGetFunction(self.module, n.encode())) for n in ("gw_copy", "gw_bank", "gw_occ")}
        self.occ_smem = 200 * 1024
        ck(driver.cuFuncSetAttribute(self.f["gw_occ"],
                                     driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     self.occ_smem))
        f32 = torch.float32
        self.big = (torch.empty(1 << 30, dtype=f32, device="cuda"), torch.empty(1 << 30, dtype=f32, device="cuda"))
        self.small = (torch.empty(2 << 20, dtype=f32, device="cuda"), torch.empty(2 << 20, dtype=f32, device="cuda"))
        for t in self.big + self.small:
            t.fill_(1.0)
        self.out = torch.empty(self.sms * 8 * 256, dtype=f32, device="cuda")
        torch.cuda.synchronize()

    def launch(self, name: str, grid: int, block: int, smem: int, args, types) -> None:
        ck(self.drv.cuLaunchKernel(self.f[name], grid, 1, 1, block, 1, 1, smem, 0, (args, types), 0))

    def phase(self, phase: str) -> None:
        """One launch of the phase's kernel (a few ms of GPU work)."""
        vp, u64, i32 = ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int
        if phase in ("stream", "l2"):
            a, b = self.big if phase == "stream" else self.small
            n = a.numel() // 4  # float4 elements
            reps = 1 if phase == "stream" else 200
            self.launch("gw_copy", self.sms * 8, 256, 0, (a.data_ptr(), b.data_ptr(), n, reps), (vp, vp, u64, i32))
        elif phase == "bank":
            self.launch("gw_bank", self.sms * 8, 256, 0, (self.out.data_ptr(), 20000), (vp, i32))
        elif phase == "occ":
            self.launch("gw_occ", self.sms * 4, 64, self.occ_smem, (self.out.data_ptr(), 200000), (vp, i32))


def workload(phase_seconds: float, idle: float, ncu_launches: int) -> int:
    k = Kernels()
    torch = k.torch
    if ncu_launches:
        for phase in PHASES:
            for _ in range(ncu_launches):
                k.phase(phase)
            torch.cuda.synchronize()
        print(json.dumps({"type": "done"}), flush=True)
        return 0
    for phase in PHASES:
        t0, end, n = time.time(), time.monotonic() + phase_seconds, 0
        while time.monotonic() < end:
            k.phase(phase)
            n += 1
            if n % 8 == 0:
                torch.cuda.synchronize()  # never queue far ahead of the clock
        torch.cuda.synchronize()
        print(json.dumps({"type": "phase", "phase": phase, "t0": t0, "t1": time.time(), "launches": n}), flush=True)
        time.sleep(idle)
    return 0


# -- the comparison ---------------------------------------------------------------------------------

def run_sampler_side(a) -> tuple[list[dict], list[dict], str]:
    from gpuwatch.probes.cupti.devicewide import child_env

    env = child_env()
    sampler_cmd = [sys.executable, "-X", "faulthandler", "-m", "gpuwatch.probes.cupti.sampler", "--devices", "0",
                   "--interval-ms", "10", "--group-seconds", str(a.group_seconds), "--groups", GROUPS,
                   "--context", a.context]
    out_path = os.path.join(a.out, "sampler.jsonl")
    err_path = os.path.join(a.out, "sampler.stderr")
    with open(out_path, "wb") as so, open(err_path, "wb") as se:
        sampler = subprocess.Popen(sampler_cmd, stdout=so, stderr=se, env=env)
        # Wait for its hello (enable() done) before the phases start.
        end = time.monotonic() + 60
        while time.monotonic() < end and sampler.poll() is None:
            with open(out_path) as f:
                if any('"hello"' in ln or '"fatal"' in ln for ln in f):
                    break
            time.sleep(0.2)
        phases = []
        try:
            w = subprocess.run([sys.executable, __file__, "--workload", "--phase-seconds", str(a.phase_seconds)],
                               capture_output=True, text=True, timeout=a.phase_seconds * 4 * 2 + 120)
            phases = [json.loads(ln) for ln in w.stdout.splitlines() if ln.startswith("{")]
            if w.returncode:
                print("workload failed:", w.stderr[-1500:], flush=True)
        finally:
            sampler.terminate()
            try:
                sampler.wait(5)
            except subprocess.TimeoutExpired:
                sampler.kill()
    lines = []
    with open(out_path) as f:
        for ln in f:
            try:
                lines.append(json.loads(ln))
            except ValueError:
                pass
    with open(err_path, errors="replace") as f:
        err = f.read()[-2000:]
    return phases, lines, err


def gpuwatch_values(phases: list[dict], lines: list[dict], interval_s: float) -> dict:
    """phase -> group -> mean of the windows inside it (percent for ratios, per second for counts)."""
    out: dict[str, dict[str, float]] = {}
    for ph in phases:
        for group in COMPARE:
            ws = [m for m in lines if m.get("type") == "value" and m.get("group") == group
                  and m.get("mean") is not None and m["t0"] >= ph["t0"] - 0.05 and m["t1"] <= ph["t1"] + 0.3]
            if ws:
                v = statistics.fmean(m["mean"] for m in ws)
                out.setdefault(ph["phase"], {})[group] = v / interval_s if COMPARE[group][1] == "rate" else v * 100
    return out


def run_ncu(a, metrics: list[str], tag: str) -> tuple[str, str, int]:
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--clock-control", "none", "--cache-control", "none", "--target-processes", "all",
           "--kernel-name", "regex:gw_", "--metrics", ",".join(metrics), "--csv", "--page", "raw",
           "--print-units", "base", sys.executable, __file__, "--workload", "--ncu-launches", str(a.ncu_launches)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "", str(e), -1
    with open(os.path.join(a.out, f"ncu-{tag}.csv"), "w") as f:
        f.write(p.stdout)
    with open(os.path.join(a.out, f"ncu-{tag}.stderr"), "w") as f:
        f.write(p.stderr)
    return p.stdout, p.stderr, p.returncode


def parse_ncu(text: str) -> dict[str, dict[str, float]]:
    """phase -> metric -> value (the median over the profiled launches of the phase's kernel)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        return {}
    head = rows[0]
    name_col = head.index("Kernel Name")
    per: dict[str, dict[str, list[float]]] = {}
    order: dict[str, int] = {}
    for row in rows[2:]:  # rows[1]: units
        kname = row[name_col]
        kernel = next((k for k in ("gw_copy", "gw_bank", "gw_occ") if k in kname), None)
        if kernel is None:
            continue
        # gw_copy runs in two phases: stream launches first, then l2 (the workload's order).
        if kernel == "gw_copy":
            order[kernel] = order.get(kernel, 0) + 1
            phase = "stream" if order[kernel] <= per_phase_launches else "l2"
        else:
            phase = {"gw_bank": "bank", "gw_occ": "occ"}[kernel]
        for i, col in enumerate(head):
            if "__" in col:
                try:
                    v = float(row[i].replace(",", ""))
                except ValueError:  # a device attribute or a metric ncu left empty ("n/a")
                    continue
                per.setdefault(phase, {}).setdefault(col, []).append(v)
    return {ph: {m: statistics.median(v) for m, v in ms.items()} for ph, ms in per.items()}


per_phase_launches = 3


def main() -> int:
    global per_phase_launches
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--phase-seconds", type=float, default=8.0)
    ap.add_argument("--group-seconds", type=float, default=0.5, help="the sampler's turn per metric")
    ap.add_argument("--context", default="bindings", help="how the sampler makes its context (bindings, torch)")
    ap.add_argument("--ncu-launches", type=int, default=3, help="launches per phase profiled by ncu")
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.workload:
        return workload(a.phase_seconds, 1.0, a.ncu_launches if "--ncu-launches" in sys.argv else 0)
    per_phase_launches = a.ncu_launches
    os.makedirs(a.out, exist_ok=True)
    t = time.monotonic()
    phases, lines, err = run_sampler_side(a)
    hello = next((m for m in lines if m.get("type") == "hello"), None)
    print(f"sampler: hello {'yes' if hello else 'NO'} (context {a.context}), "
          f"{sum(1 for m in lines if m.get('type') == 'value')} windows, phases {[p['phase'] for p in phases]} "
          f"({time.monotonic() - t:.0f} s)", flush=True)
    for m in lines:
        if m.get("type") in ("fatal", "unsupported", "error", "busy"):
            print("  sampler:", m, flush=True)
    if not hello:
        print("  sampler stderr:", err[-800:], flush=True)
    with open(os.path.join(a.out, "phases.json"), "w") as f:  # to re-read the comparison offline
        json.dump(phases, f)
    ours = gpuwatch_values(phases, lines, 0.010)
    t = time.monotonic()
    text, nerr, rc = run_ncu(a, [m for m, _ in COMPARE.values()] + NCU_EXTRA, "main")
    theirs = parse_ncu(text)
    print(f"ncu: rc {rc}, phases {sorted(theirs)} ({time.monotonic() - t:.0f} s)", flush=True)
    if not theirs:
        print("  ncu stderr:", nerr[-1500:], flush=True)
    text2, nerr2, rc2 = run_ncu(a, [NCU_REALTIME_L2], "realtime")
    realtime = parse_ncu(text2)
    if not realtime:
        print(f"ncu {NCU_REALTIME_L2}: not available (rc {rc2}): {nerr2.strip()[-200:]}", flush=True)

    table = []
    for phase in PHASES:
        for group, (metric, kind) in COMPARE.items():
            g = ours.get(phase, {}).get(group)
            n = theirs.get(phase, {}).get(metric)
            if kind == "rate" and n is not None:
                dur = theirs.get(phase, {}).get("gpu__time_duration.sum")
                n = n / (dur * 1e-9) if dur else None  # per second of kernel time
            diff = None
            if g is not None and n is not None:
                diff = g - n if kind == "pct" else ((g - n) / n * 100 if n else None)
            row = {"phase": phase, "metric": group, "gpuwatch": g, "ncu": n, "diff": diff, "kind": kind}
            if group == "l2_hit":
                row["ncu_realtime"] = realtime.get(phase, {}).get(NCU_REALTIME_L2)
            table.append(row)
    with open(os.path.join(a.out, "ncu_compare.json"), "w") as f:
        json.dump({"table": table, "phases": phases, "ncu": theirs, "ncu_realtime": realtime,
                   "sampler_context": a.context}, f, indent=1)

    def fmt(v, kind):
        if v is None:
            return "-"
        return f"{v:.1f}" if kind == "pct" else f"{v:.3g}"
    print("\nper phase: gpuwatch (PM sampling, device-wide) vs ncu (--clock-control none, per kernel)")
    print(f"{'phase':7} {'metric':15} {'gpuwatch':>10} {'ncu':>10} {'diff':>12}  note")
    for r in table:
        unit = "pp" if r["kind"] == "pct" else "%"
        d = "-" if r["diff"] is None else f"{r['diff']:+.1f} {unit}"
        note = ""
        if r["kind"] == "pct" and r["diff"] is not None:
            note = "ok (<= 5 pp)" if abs(r["diff"]) <= 5 else "DIFFERS"
        if r.get("ncu_realtime") is not None:
            note += f" ncu realtime L2 {r['ncu_realtime']:.1f}"
        if r["kind"] == "rate":
            note = "conflicts/s" + (" ok (<= 10 %)" if r["diff"] is not None and abs(r["diff"]) <= 10 else "")
        print(f"{r['phase']:7} {r['metric']:15} {fmt(r['gpuwatch'], r['kind']):>10} {fmt(r['ncu'], r['kind']):>10} "
              f"{d:>12}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
