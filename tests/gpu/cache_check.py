#!/usr/bin/env python3
"""Device-wide CUPTI PM sampling (gpuwatch.probes.cupti.devicewide) against cache behaviour that is
known, on a real GPU (the H200).

A separate workload process runs the same kernel, dst.copy_(src), on two footprints:
  stream  a 4 GiB copy, far larger than the 50 MB L2: every read misses
  reuse   a 4 MiB copy (8 MiB touched, fits in L2), 200 at a time in a CUDA graph: reads hit
with idle gaps around them, while CuptiSamplerProbe runs the real sampler child (occupancy, L1
hit, L2 hit, DRAM throughput in turn). Each sampler window that lies inside a phase is assigned to
it; the check prints per phase the median L2 and L1 hit ratio, achieved occupancy and DRAM
throughput, and

    OK cache: l2 reuse X vs stream Y      when reuse - stream >= 0.2
    BAD cache: ...                        otherwise, or when a phase got no L2 window

Then, time permitting: a second sampler started while the first one samples (what does CUPTI
say when the counters are taken: the text the busy detection must match), how fast the probe's
shutdown frees them, and, if `ncu` is on PATH, lts__t_sector_hit_rate.pct from Nsight Compute on
the same two kernels.

Needs torch (workload), cupti-python 13.4 + nvidia-cuda-cupti 13.4 and gpuwatch importable
(PYTHONPATH with a gpuwatch/ shim; tests/gpu/cupti_check.sh sets both). Whole run < 60 s;
every child is killed on the way out.

Usage: python3 tests/gpu/cache_check.py --out cache.json [--device 0]
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

GROUPS = ("occupancy", "l1_hit", "l2_hit", "dram")
PHASES = (("idle0", 2.0), ("stream", 5.0), ("idle1", 2.0), ("reuse", 5.0), ("idle2", 1.5))
MARGIN = 0.15  # seconds a window must start after its phase began (kernels in flight settle)


# -- the workload (a separate process: the sampler must see another process's work) -----------

def workload(args: argparse.Namespace) -> None:
    import torch

    dev = torch.device("cuda", 0)
    big_src = torch.ones(args.stream_bytes // 4, device=dev)
    big_dst = torch.empty_like(big_src)
    small_src = torch.ones(args.reuse_bytes // 8, device=dev)  # src + dst = reuse_bytes
    small_dst = torch.empty_like(small_src)
    if args.ncu_target:  # copies 1-2: the streaming copy, 3-4: the L2-resident one
        for dst, src in ((big_dst, big_src), (big_dst, big_src), (small_dst, small_src), (small_dst, small_src)):
            dst.copy_(src)
        torch.cuda.synchronize()
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            small_dst.copy_(small_src)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(200):  # back to back on the GPU: no launch gaps in the reuse phase
            small_dst.copy_(small_src)
    big_dst.copy_(big_src)
    graph.replay()
    torch.cuda.synchronize()
    print(json.dumps({"ready": True, "pid": os.getpid(), "gpu": torch.cuda.get_device_name(dev)}), flush=True)
    sys.stdin.readline()  # "go"
    for name, seconds in PHASES:
        t0 = time.time()
        iters = 0
        while time.time() - t0 < seconds:
            if name == "stream":
                for _ in range(10):
                    big_dst.copy_(big_src)
                iters += 10
            elif name == "reuse":
                for _ in range(20):
                    graph.replay()
                iters += 20 * 200
            else:
                time.sleep(0.05)
                continue
            torch.cuda.synchronize()
        torch.cuda.synchronize()
        print(json.dumps({"phase": name, "t0": t0, "t1": time.time(), "iters": iters}), flush=True)
    print(json.dumps({"done": True}), flush=True)


# -- the check -------------------------------------------------------------------------------------

class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.monotonic()
        self.deadline = self.start + args.budget
        self.children: list[subprocess.Popen] = []
        self.probe = None
        self.lines: list[dict] = []
        self.lock = threading.Lock()
        self.result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args), "errors": []}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, msg: dict) -> None:
        with self.lock:
            self.lines.append(dict(msg, _rx=time.time()))

    def kill_all(self) -> None:
        if self.probe is not None:
            pid = self.probe.child_pid
            try:
                self.probe.shutdown()
            except Exception:
                pass
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
        for c in self.children:
            if c.poll() is None:
                try:
                    os.killpg(c.pid, signal.SIGKILL)
                except OSError:
                    c.kill()
            try:
                c.wait(2)
            except subprocess.TimeoutExpired:
                pass

    def write(self) -> None:
        with self.lock:
            self.result["windows"] = [m for m in self.lines if m.get("type") == "value"]
            self.result["other_lines"] = [m for m in self.lines if m.get("type") not in ("value", "heartbeat")]
        self.result["elapsed_s"] = round(time.monotonic() - self.start, 2)
        with open(self.args.out, "w") as f:
            json.dump(self.result, f, indent=1, default=str)

    def spawn(self, cmd: list[str], env: dict | None = None, stdin=subprocess.DEVNULL) -> subprocess.Popen:
        # stderr to a file: a chatty child must never block on a full pipe nobody reads
        err = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=err, text=True,
                             env=env, start_new_session=True)
        p.err_file = err  # type: ignore[attr-defined]
        self.children.append(p)
        return p


def stderr_tail(p: subprocess.Popen, n: int = 1500) -> str:
    f = getattr(p, "err_file", None)
    if f is None:
        return ""
    try:
        f.seek(0)
        return f.read()[-n:]
    except (OSError, ValueError):
        return ""


def read_json_lines(proc: subprocess.Popen, sink: list, stop: threading.Event) -> threading.Thread:
    def pump() -> None:
        for line in proc.stdout:
            try:
                sink.append(dict(json.loads(line), _rx=time.time()))
            except ValueError:
                sink.append({"raw": line.rstrip()[:500], "_rx": time.time()})
            if stop.is_set():
                break
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def wait_until(cond, timeout: float, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())


def summarize(windows: list[dict], phases: dict[str, dict]) -> dict:
    out: dict[str, dict] = {}
    for name, ph in phases.items():
        row: dict[str, dict] = {}
        for g in GROUPS:
            vals = [w["mean"] for w in windows if w.get("group") == g and w.get("mean") is not None
                    and w["t0"] >= ph["t0"] + MARGIN and w["t1"] <= ph["t1"] + 0.05]
            row[g] = {"median": round(statistics.median(vals), 4) if vals else None, "windows": len(vals),
                      "values": [round(v, 4) for v in vals]}
        out[name] = row
    return out


def sampler_gpu_memory(pid: int | None) -> str:
    """What the sampler's own CUDA context costs on the GPU (nvidia-smi's view)."""
    if pid is None or shutil.which("nvidia-smi") is None:
        return "unknown"
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi failed: {e}"
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if parts and parts[0] == str(pid):
            return parts[1] if len(parts) > 1 else "?"
    return f"not listed (nvidia-smi: {out.strip()[:200]!r})"


def run_ncu(run: Run, env: dict) -> dict:
    ncu = shutil.which("ncu")
    if ncu is None:
        return {"skipped": "ncu is not on PATH"}
    if run.left() < 20:
        return {"skipped": f"only {run.left():.0f} s left of the budget"}
    cmd = [ncu, "--metrics", "lts__t_sector_hit_rate.pct,l1tex__t_sector_hit_rate.pct,"
           "sm__warps_active.avg.pct_of_peak_sustained_active", "--csv",
           # Only the copies (torch.ones launched fill kernels first; on 2026-11-30 ncu measured those).
           "--kernel-name-base", "demangled", "--kernel-name", "regex:copy", "--launch-count", "4",
           sys.executable, os.path.abspath(__file__), "--workload", "--ncu-target",
           "--stream-bytes", str(1 << 30), "--reuse-bytes", str(run.args.reuse_bytes)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, run.left() - 5), env=env,
                             start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"error": "ncu timed out", "cmd": cmd}
    rows = []
    text = out.stdout[out.stdout.find('"ID"'):] if '"ID"' in out.stdout else ""
    for r in csv.DictReader(io.StringIO(text)):
        rows.append({"id": r.get("ID"), "grid": r.get("Grid Size"), "kernel": r.get("Kernel Name", "")[:80],
                     "metric": r.get("Metric Name"),
                     "value": r.get("Metric Value"), "unit": r.get("Metric Unit")})
    return {"rc": out.returncode, "rows": rows, "stderr_tail": out.stderr[-1500:]}


def contention(run: Run, env: dict) -> dict:
    """A second sampler while the probe's child samples: what CUPTI answers when the counters are taken."""
    from gpuwatch.probes.cupti.sampler import BUSY_RE

    if run.left() < 10:
        return {"skipped": f"only {run.left():.0f} s left of the budget"}
    cmd = [sys.executable, "-m", "gpuwatch.probes.cupti.sampler", "--devices", str(run.args.device),
           "--interval-ms", "10", "--group-seconds", "0.5", "--groups", "l2_hit"]
    p = run.spawn(cmd, env=env)
    lines: list[dict] = []
    stop = threading.Event()
    read_json_lines(p, lines, stop)
    t = time.monotonic()
    wait_until(lambda: p.poll() is not None or any(m.get("type") in ("value", "busy", "fatal") for m in lines), 6)
    took = time.monotonic() - t
    rc = p.poll()
    term_s = None
    if rc is None:  # the real sampler on SIGTERM: release the counters, say bye, exit 0 within 1 s
        t = time.monotonic()
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(2)
            term_s = round(time.monotonic() - t, 3)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        time.sleep(0.1)  # its last line
    stop.set()
    err = " ".join(str(m.get("error", "")) for m in lines if m.get("type") in ("busy", "fatal", "error", "unsupported"))
    return {"lines": [m for m in lines if m.get("type") != "heartbeat"][:20], "rc": rc, "seconds": round(took, 2),
            "second_sampler_got_values": any(m.get("type") == "value" for m in lines),
            "sigterm_exit_s": term_s, "said_bye": any(m.get("type") == "bye" for m in lines),
            "error_text": err, "busy_regex_matches": bool(BUSY_RE.search(err)) if err else None,
            "stderr_tail": stderr_tail(p, 1000)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="cache.json")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("--group-seconds", type=float, default=0.25)
    ap.add_argument("--stream-bytes", type=int, default=4 << 30)
    ap.add_argument("--reuse-bytes", type=int, default=8 << 20)
    ap.add_argument("--budget", type=float, default=55.0, help="seconds for the whole run")
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ncu-target", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.workload:
        workload(args)
        return 0

    from gpuwatch.probes.cupti.devicewide import CuptiSamplerProbe, child_env

    run = Run(args)
    # Whatever hangs, the run ends inside the budget with its children dead and a JSON written.
    def hard_stop() -> None:
        run.result["errors"].append(f"budget of {args.budget:g} s exceeded: killed everything")
        run.kill_all()
        try:
            run.write()
        finally:
            print("BAD cache: the check ran out of time", flush=True)
            os._exit(2)
    watchdog = threading.Timer(args.budget + 3, hard_stop)
    watchdog.daemon = True
    watchdog.start()
    try:
        return check(run, CuptiSamplerProbe, child_env)
    except Exception as e:
        run.result["errors"].append(f"{type(e).__name__}: {e}")
        print(f"BAD cache: the check failed: {type(e).__name__}: {e}", flush=True)
        return 1
    finally:
        run.kill_all()
        watchdog.cancel()
        run.write()
        print(f"wrote {args.out} ({time.monotonic() - run.start:.1f} s)", flush=True)


def check(run: Run, CuptiSamplerProbe, child_env) -> int:
    args = run.args
    env = child_env()
    run.result["sampler_env"] = {"LD_LIBRARY_PATH": env.get("LD_LIBRARY_PATH", ""),
                                 "CUDA_DEVICE_ORDER": env.get("CUDA_DEVICE_ORDER")}
    probe = CuptiSamplerProbe(devices=str(args.device), sample_interval=args.interval_ms / 1000,
                              group_seconds=args.group_seconds, groups=GROUPS, on_message=run.record,
                              hang_timeout=5.0, start_timeout=30.0)
    run.probe = probe
    t_wall = time.time()
    probe.start()
    wl_env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(args.device))
    wl = run.spawn([sys.executable, "-u", os.path.abspath(__file__), "--workload", "--stream-bytes",
                    str(args.stream_bytes), "--reuse-bytes", str(args.reuse_bytes)], env=wl_env,
                   stdin=subprocess.PIPE)
    wl_lines: list[dict] = []
    stop = threading.Event()
    read_json_lines(wl, wl_lines, stop)

    def sampler_up() -> bool:
        return any(m.get("type") == "value" for m in run.lines) or probe.state in ("unavailable", "yielded")

    ok_start = wait_until(lambda: sampler_up() and (any(m.get("ready") for m in wl_lines) or wl.poll() is not None),
                          min(35.0, run.left() - 15))
    hello = next((m for m in run.lines if m.get("type") == "hello"), {})
    first_value = next((m for m in run.lines if m.get("type") == "value"), None)
    run.result["sampler"] = {"hello": hello, "state": probe.state, "reason": probe.reason,
                             "first_value_after_s": round(first_value["_rx"] - t_wall, 2) if first_value else None}
    print(f"sampler: {probe.state} {probe.reason or ''} cupti {hello.get('cupti_version')} "
          f"libcupti {hello.get('libcupti')} devices {hello.get('devices')}", flush=True)
    if probe.state != "sampling" or not first_value:
        reason = probe.reason or "no value from the sampler in time"
        print(f"BAD cache: the sampler is not sampling ({probe.state}): {reason}", flush=True)
        run.result["verdict"] = {"ok": False, "why": reason, "lines": run.lines[-10:]}
        return 1
    if not ok_start or not any(m.get("ready") for m in wl_lines):
        err = stderr_tail(wl)
        print(f"BAD cache: the workload did not get ready: {err}", flush=True)
        run.result["verdict"] = {"ok": False, "why": "workload not ready", "stderr": err}
        return 1
    ready = next(m for m in wl_lines if m.get("ready"))
    run.result["workload"] = {"ready": ready}
    run.result["sampler"]["gpu_memory"] = mem = sampler_gpu_memory(probe.child_pid)
    print(f"sampler child {probe.child_pid} GPU memory: {mem}", flush=True)
    states: list[tuple[float, str]] = []
    wl.stdin.write("go\n")
    wl.stdin.flush()
    total = sum(s for _, s in PHASES)
    end = time.monotonic() + min(total + 15, run.left() - 2)
    while time.monotonic() < end and not any(m.get("done") for m in wl_lines) and wl.poll() is None:
        if not states or states[-1][1] != probe.state:
            states.append((round(time.time(), 3), probe.state))
        time.sleep(0.1)
    phases = {m["phase"]: m for m in wl_lines if "phase" in m}
    run.result["workload"]["phases"] = phases
    run.result["probe_states"] = states
    if set(phases) != {n for n, _ in PHASES}:
        err = stderr_tail(wl)
        print(f"BAD cache: the workload did not finish its phases ({sorted(phases)}): {err}", flush=True)
        run.result["verdict"] = {"ok": False, "why": "workload phases missing", "stderr": err}
        return 1
    time.sleep(args.group_seconds * len(GROUPS) * 0.5)  # the window in flight at the end
    with run.lock:
        windows = [m for m in run.lines if m.get("type") == "value"]
    summary = summarize(windows, phases)
    run.result["summary"] = summary
    decode = [w.get("decode_ms", 0) for w in windows]
    run.result["decode_ms_per_window"] = {"mean": round(statistics.mean(decode), 2) if decode else None,
                                          "max": max(decode) if decode else None}
    print(f"{'phase':<7} {'l2_hit':>8} {'l1_hit':>8} {'occupancy':>10} {'dram':>8}   (windows l2/l1/occ/dram)")
    for name, _ in PHASES:
        row = summary[name]
        cells = [row[g]["median"] for g in ("l2_hit", "l1_hit", "occupancy", "dram")]
        counts = "/".join(str(row[g]["windows"]) for g in ("l2_hit", "l1_hit", "occupancy", "dram"))
        print(f"{name:<7} " + " ".join(f"{'-' if c is None else f'{c:.3f}':>{w}}" for c, w in zip(cells, (8, 8, 10, 8)))
              + f"   ({counts}; {phases[name]['iters']} iterations)")
    print(f"decode per window: mean {run.result['decode_ms_per_window']['mean']} ms, "
          f"max {run.result['decode_ms_per_window']['max']} ms; restarts {probe.restarts()}; "
          f"invalid lines {probe.invalid_lines}", flush=True)

    run.result["contention"] = c = contention(run, env)
    if "skipped" not in c:
        print(f"second sampler while the first samples: rc {c['rc']}, got values {c['second_sampler_got_values']}, "
              f"says: {c['error_text'][:300] or '(nothing)'}; busy regex matches: {c['busy_regex_matches']}; "
              f"SIGTERM exit {c['sigterm_exit_s']} s, bye {c['said_bye']}", flush=True)
    pid = probe.child_pid
    t = time.monotonic()
    probe.shutdown()
    took = time.monotonic() - t
    gone = wait_until(lambda: pid is None or not os.path.exists(f"/proc/{pid}"), 1.0)
    bye = any(m.get("type") == "bye" for m in run.lines)
    run.result["shutdown"] = {"seconds": round(took, 3), "child_gone": gone, "said_bye": bye}
    print(f"probe shutdown: {took:.2f} s, child gone {gone}, sampler said bye (released the counters) {bye}", flush=True)

    run.result["ncu"] = n = run_ncu(run, dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID",
                                              CUDA_VISIBLE_DEVICES=str(args.device)))
    if "rows" in n:
        for r in n["rows"]:
            what = "stream" if str(r["id"]) in ("0", "1") else "reuse"  # launch order of --ncu-target
            print(f"ncu: {what:<6} {r['kernel'][:40]:<40} grid {r['grid']} {r['metric']:<45} {r['value']} "
                  f"{r['unit'] or ''}")
    else:
        print(f"ncu: {n}")

    l2s, l2r = summary["stream"]["l2_hit"]["median"], summary["reuse"]["l2_hit"]["median"]
    if l2s is None or l2r is None:
        print(f"BAD cache: no L2 window inside the {'stream' if l2s is None else 'reuse'} phase "
              f"({len(windows)} windows in all)", flush=True)
        run.result["verdict"] = {"ok": False, "why": "no L2 window in a phase"}
        return 1
    ok = l2r - l2s >= 0.2
    line = (f"l2 reuse {l2r:.3f} vs stream {l2s:.3f}; l1 reuse {summary['reuse']['l1_hit']['median']} vs stream "
            f"{summary['stream']['l1_hit']['median']}; occupancy stream {summary['stream']['occupancy']['median']} "
            f"reuse {summary['reuse']['occupancy']['median']} idle {summary['idle1']['occupancy']['median']}; dram "
            f"stream {summary['stream']['dram']['median']} reuse {summary['reuse']['dram']['median']}")
    run.result["verdict"] = {"ok": ok, "l2_reuse": l2r, "l2_stream": l2s}
    print(("OK cache: " if ok else "BAD cache: ") + line, flush=True)
    # The same kernels under Nsight Compute: our device-wide L2 hit ratio within 5 points of its
    # per-kernel lts__t_sector_hit_rate.pct.
    if "rows" in n:
        ncu_l2: dict[str, list[float]] = {"stream": [], "reuse": []}
        for r in n["rows"]:
            if r["metric"] == "lts__t_sector_hit_rate.pct":
                try:
                    ncu_l2["stream" if str(r["id"]) in ("0", "1") else "reuse"].append(float(str(r["value"]).replace(",", "")))
                except ValueError:
                    pass
        if ncu_l2["stream"] and ncu_l2["reuse"]:
            diffs = {ph: abs(ours * 100 - sum(v) / len(v)) for ph, ours, v in
                     (("stream", l2s, ncu_l2["stream"]), ("reuse", l2r, ncu_l2["reuse"]))}
            near = all(d <= 5 for d in diffs.values())
            run.result["ncu_compare"] = {"ncu": ncu_l2, "ours": {"stream": l2s, "reuse": l2r}, "points_apart": diffs}
            print(("OK " if near else "BAD ") + "ncu: L2 hit " + "; ".join(
                f"{ph} ours {o * 100:.1f} % vs ncu {sum(ncu_l2[ph]) / len(ncu_l2[ph]):.1f} % ({diffs[ph]:.1f} points)"
                for ph, o in (("stream", l2s), ("reuse", l2r))), flush=True)
            ok = ok and near
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
