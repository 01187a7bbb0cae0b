"""The in-process agent's frameworks on a GPU (issue 19): white and grey from PyTorch, CuPy and JAX,
their out-of-memory errors as oom events scored against the leak forecast. In one run, for each
framework the machine's python3 has with a working GPU backend (the others are SKIPped, saying why):

  1. idle: a program that imports the framework and never uses it gets no context and no backend
     from the agent (NVML does not list it; JAX's backends not started; torch.cuda not initialised);
  2. colors: a program holding a known amount (white below grey) is reported with exactly its own
     numbers (tests/gpu/frameworks_program.py logs them), verified by NVML, frameworks=[it];
  3. leak: beside a ballast process that leaves --free-gib of the GPU free, a program keeps 18 MiB
     more every 0.5 s (2.1 GiB a minute: the OOM comes about 2 minutes after its start) until its
     framework raises its OOM, which it then dies of. The agent must find a white leak within 90 s
     of its start, forecast its OOM within 20 % of when it came, and record one `finding.oom`
     (cause out_of_memory_error, the framework's; PyTorch's: through its allocator's observer,
     with the bytes asked for), scored against the forecast made when the leak was found, within
     10 s of the OOM the program logged and with the error the program's own times give (within
     0.1); the GPU's forecast-error histogram counts each scored one. What the agent saw each
     second (the process's three colors, the GPU's free memory) is kept in frameworks.json.

A real `gpuwatch agent` (real NVML; eBPF, device-wide sampling and the reference workload off) on a
private socket. Prints OK/BAD/SKIP lines; frameworks.json, programs.jsonl and agent.log go to --out.
Exit 0 when every check that ran is OK (skips are not failures), 1 otherwise, 2 when nothing ran.

Usage: tests/gpu/frameworks_leak_check.sh OUTDIR [--frameworks torch,cupy,jax] [--free-gib 5]
(about 2.5 minutes per framework with a GPU backend: run torch,cupy and jax in two device calls).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from agent_proc import start_agent  # tests/gpu/agent_proc.py
from gpuwatch.agent import control

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "frameworks_program.py")
MIB, GIB = 1 << 20, 1 << 30
# JAX: no preallocation in the leak run (its pool grows with the leak, and the GPU fills before its
# limit); the colors run keeps JAX's default, 75 % of the GPU in the pool from the start.
JAX_GROW = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.99"}
PROBES = {  # does python3 have the framework, with a GPU?
    "torch": "import torch; assert torch.cuda.is_available(); (torch.ones(1, device='cuda') + 1).item()",
    "cupy": "import cupy; (cupy.ones(1) + 1).get()",
    "jax": "import jax; ds = jax.devices(); assert ds[0].platform == 'gpu', ds; (jax.numpy.ones(1) + 1).block_until_ready()",
}


def available(fw: str) -> str:
    """"" when python3 can use the framework on the GPU, else why not."""
    env = dict(os.environ, **JAX_GROW)
    try:
        p = subprocess.run([sys.executable, "-c", PROBES[fw]], capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired:
        return "its first GPU use did not finish in 180 s"
    if p.returncode == 0:
        return ""
    last = (p.stderr.strip().splitlines() or ["?"])[-1]
    return "not installed in this python3" if "ModuleNotFoundError" in last else f"no GPU backend: {last[:200]}"


def run(sock: str, fw: str, mode: str, log: str, out: str, env: dict | None = None, **opts) -> subprocess.Popen:
    args = [sys.executable, PROGRAM, "--framework", fw, "--mode", mode, "--log", log]
    for k, v in opts.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "run", "--quiet", "--socket", sock,
                             "--interval", "0.5", "--"] + args, env=dict(os.environ, **(env or {})),
                            stdout=open(os.path.join(out, f"{fw}-{mode}.log"), "a"), stderr=subprocess.STDOUT)


def logged(log: str, pid: int) -> list[dict]:
    try:
        return [e for e in map(json.loads, open(log)) if e["pid"] == pid]
    except OSError:
        return []


def ask(sock: str, method: str, params: dict):
    try:
        return control.call(sock, method, params, timeout=5)
    except control.ControlError as e:
        return {"error": str(e)}


def nvml_pids(port: int) -> set[str]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.split('pid="', 1)[1].split('"', 1)[0] for line in text.splitlines()
            if line.startswith("gpuwatch_process_gpu_memory_usage_bytes{")}


SEEN = ("gpuwatch_process_gpu_memory_usage_bytes{", "gpuwatch_process_gpu_memory_allocated_bytes{",
        "gpuwatch_process_gpu_memory_reserved_bytes{")


def what_the_agent_sees(port: int, pid: int) -> dict:
    """The process's black, white and grey and the GPU's free memory, as the agent exports them now."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError as e:
        return {"error": str(e)}
    out: dict = {"t": round(time.time(), 2)}
    for line in text.splitlines():
        if line.startswith(SEEN) and f'pid="{pid}"' in line:
            out[line.split("_bytes{", 1)[0].rsplit("_", 1)[-1]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("gpuwatch_gpu_memory_free_bytes{"):
            out["gpu_free"] = float(line.rsplit(" ", 1)[1])
    return out


def free_bytes() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=30).stdout
    return int(out.split()[0]) * MIB


def check_idle(fw: str, sock: str, port: int, log: str, out: str, results: list) -> None:
    p = run(sock, fw, "idle", log, out, seconds=4)
    time.sleep(3)  # the agent has read the process's memory several times by now
    listed = str(p.pid) in nvml_pids(port)
    p.wait(60)
    end = {k: v for e in logged(log, p.pid) for k, v in e.items() if k in ("backends_started", "cuda_initialized")}
    ok = not listed and not any(end.values())
    results.append((ok, f"{fw} idle: imported, never used: NVML lists it on a GPU: {listed}; {end or 'nothing more'} "
                        "(the agent must start nothing)"))


def check_colors(fw: str, sock: str, log: str, out: str, results: list, record: dict) -> None:
    p = run(sock, fw, "colors", log, out, hold_mib=1024, seconds=8)
    time.sleep(6)
    report = ask(sock, "cupti.process", {"pid": p.pid}) or {}
    p.wait(60)
    truth = [e for e in logged(log, p.pid) if e["event"] == "colors"]
    mem = (report.get("memory") or [{}])[0] if isinstance(report, dict) else {}
    record[f"{fw}_colors"] = {"report_memory": report.get("memory") if isinstance(report, dict) else report,
                              "program": truth[-3:]}
    if not truth or not mem:
        results.append((False, f"{fw} colors: no {'program log' if not truth else 'memory in the report'} ({report})"))
        return
    want = truth[-1]
    ok = ((mem.get("allocated"), mem.get("reserved")) == (want["white"], want["grey"])
          and mem.get("frameworks") == [fw] and mem.get("self_reported") is False and want["white"] < want["grey"])
    results.append((ok, f"{fw} colors: agent white {mem.get('allocated')} grey {mem.get('reserved')} "
                        f"{mem.get('frameworks')} (self_reported {mem.get('self_reported')}); the program's own "
                        f"white {want['white']} grey {want['grey']}"))


def check_leak(fw: str, sock: str, port: int, log: str, out: str, free_gib: float, results: list,
               record: dict) -> None:
    hold = max(0, free_bytes() - int(free_gib * GIB))
    ballast = subprocess.Popen([sys.executable, os.path.join(HERE, "load.py"), "--seconds", "900", "--hold-gib",
                                f"{hold / GIB:.3f}", "--duty", "0"], stdout=subprocess.PIPE, text=True)
    try:
        ballast.stdout.readline()  # it holds its memory now
        p = run(sock, fw, "leak", log, out, env=JAX_GROW if fw == "jax" else None)
        seen, timeline, t0 = [], [], time.time()
        while p.poll() is None and time.time() - t0 < 400:
            timeline.append(what_the_agent_sees(port, p.pid))
            for f in (ask(sock, "findings", {"kind": "memory_leak"}) or {}).get("open", []):
                if f.get("pid") == str(p.pid) and (not seen or seen[-1]["ts"] != f["ts"]):
                    seen.append({k: f.get(k) for k in ("ts", "color", "time_to_oom_seconds", "summary")})
            time.sleep(1)
        if p.poll() is None:
            p.kill()
        p.wait(30)
    finally:
        ballast.kill()
        ballast.wait()
    ev = {e["event"]: e for e in logged(log, p.pid)}
    start, oom = ev.get("leak_start"), ev.get("oom")
    time.sleep(3)  # its last report and exit reach the runner
    ooms = [e for e in (ask(sock, "findings", {}) or {}).get("ooms", []) if e.get("pid") == str(p.pid)]
    steps = [e for e in logged(log, p.pid) if e["event"] == "step"]
    record[f"{fw}_leak"] = {"findings": seen, "program": {k: v for k, v in ev.items() if k != "step"},
                            "oom_events": ooms, "exit": p.returncode, "agent_saw": timeline,
                            "program_steps": steps[::4] + steps[-3:]}
    if not start or not oom:
        results.append((False, f"{fw} leak: the program logged {sorted(ev)} (exit {p.returncode}): no OOM to judge"))
        return
    first = seen[0] if seen else None
    delay = first["ts"] - start["t"] if first else None
    results.append((first is not None and first["color"] == "white" and delay <= 90,
                    f"{fw} leak: seen {delay if delay is None else round(delay)} s after its start (limit 90 s) as "
                    f"{first and first['color']}; the program's OOM {oom['error']} {oom['t'] - start['t']:.0f} s "
                    "after its start"))
    if len(ooms) != 1:
        results.append((False, f"{fw} oom: {len(ooms)} oom events for pid {p.pid} (one expected): {ooms}"))
        return
    e = ooms[0]
    how = "allocator" if fw == "torch" else "uncaught"
    ok = (e.get("cause"), e.get("framework"), e.get("how")) == ("out_of_memory_error", fw, how)
    if fw == "torch":
        ok = ok and e.get("requested_bytes") == oom["requested_bytes"]
    line = (f"{fw} oom event: {e.get('summary')} (cause {e.get('cause')}, how {e.get('how')}, requested "
            f"{e.get('requested_bytes')})")
    if first is not None and first.get("time_to_oom_seconds"):
        actual = oom["t"] - first["ts"]
        truth = actual / first["time_to_oom_seconds"] - 1
        got = e.get("forecast_error_ratio")
        ok = (ok and abs(truth) <= 0.2 and got is not None and abs(got - truth) <= 0.1
              and abs(e["came_after_seconds"] - actual) <= 10)
        line += (f"; the program's own OOM came {actual:.0f} s after the first finding, forecast "
                 f"{first['time_to_oom_seconds']:.0f} s (error {truth:+.0%}, limit 20 %)")
    else:
        ok = False
        line += "; no forecast to score"
    results.append((ok, line))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--frameworks", default="torch,cupy,jax")
    ap.add_argument("--free-gib", type=float, default=5.0, help="what the ballast leaves free for each leak")
    ap.add_argument("--port", type=int, default=19838)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    record: dict = {"args": vars(a), "skipped": {}}
    results: list[tuple[bool, str]] = []
    ready = []
    for fw in a.frameworks.split(","):
        why = available(fw)
        if why:
            record["skipped"][fw] = why
            print(f"SKIP {fw}: {why}", flush=True)
        else:
            ready.append(fw)
    if not ready:
        print("nothing to check: no framework with a GPU backend in this python3", flush=True)
        return 2
    work = tempfile.mkdtemp(prefix="gw-fw-")
    log = os.path.join(a.out, "programs.jsonl")
    agent, sock = start_agent(work, a.port)
    t_start = time.time()
    try:
        time.sleep(2)  # NVML's first view, which verifies the programs' memory
        for fw in ready:
            check_idle(fw, sock, a.port, log, a.out, results)
            check_colors(fw, sock, log, a.out, results, record)
            print(f"[{time.time() - t_start:4.0f} s] {fw}: idle and colors done", flush=True)
        for fw in ready:
            check_leak(fw, sock, a.port, log, a.out, a.free_gib, results, record)
            print(f"[{time.time() - t_start:4.0f} s] {fw}: leak done", flush=True)
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{a.port}/metrics", timeout=5).read().decode()
        record["oom_series"] = [line for line in text.splitlines() if line.startswith("gpuwatch_oom_")]
        counted = sum(float(line.rsplit(" ", 1)[1]) for line in record["oom_series"]
                      if line.startswith("gpuwatch_oom_forecast_error_ratio_count"))
        scored = sum(1 for fw in ready for e in (record.get(f"{fw}_leak") or {}).get("oom_events") or []
                     if e.get("forecast_error_ratio") is not None)
        results.append((counted == scored, f"forecast-error histogram: {counted:.0f} observations for {scored} "
                                           "scored OOMs"))
    finally:
        agent.terminate()
        agent.wait(20)
    record["results"] = [{"ok": ok, "what": w} for ok, w in results]
    with open(os.path.join(a.out, "frameworks.json"), "w") as f:
        json.dump(record, f, indent=1)
    os.replace(os.path.join(work, "agent.log"), os.path.join(a.out, "agent.log"))
    for ok, what in results:
        print(("OK   " if ok else "BAD  ") + what, flush=True)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
