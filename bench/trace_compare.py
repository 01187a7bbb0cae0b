"""Tracing overhead and coverage, side by side: gpuwatch trace (eBPF), gpuwatch run (CUPTI) and
torch.profiler on the same PyTorch training step and the same eager decode loop (GPU machine, root).

Each mode is a fresh process of bench/trace_workload.py; each round starts every mode once, one
after another, in the same launch order (reversed every other round, so drift hits all alike):
  none            the program alone: the reference of its round
  trace           `gpuwatch trace --pid PID` attached after the program's warm-up (counts, live view)
  trace-output    the same with --output (every call recorded, a Perfetto file at the end)
  run             `gpuwatch run --` (CUPTI kernel activity on a 10 % duty cycle: the default)
  run-continuous  `gpuwatch run --kernels continuous --`
  profiler        the timed section inside torch.profiler.profile(activities=[CUDA])
Each process warms up, runs a little of both workloads ("ping", after which a tracer has named the
kernels), waits 3 s, then times --train-steps training steps and --decode-steps tokens one by one; per mode
and round the median step time, and its ratio to the none run of the same round. The table gives
the median ratio over rounds and its range (the spread). The mean is kept too: with the default
duty cycle a step inside the 1 s kernel window is slower, which a median hides.

Then coverage (--cover): one more process per tool doing known work (trace_workload.py `cover`),
and for the timed section of the last round the kernel launches each tool counted.

  python3 bench/trace_compare.py --rounds 3 --out trace_compare.json   (tests/gpu/compare_check.sh)
The tracer gets TRACER_LD_LIBRARY_PATH and TRACER_PYTHONPATH (the bcc bundle's, GPU.md) on top of
this environment; the traced programs never do. Without bcc the trace modes are left out, said so.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "trace_workload.py")
MODES = ("none", "trace", "trace-output", "run", "run-continuous", "profiler")
TRACE_MODES = ("trace", "trace-output")
COVER_TOOLS = ("trace", "run-continuous", "profiler")
# Between the ping and the timed section: a tracer's first refreshes after the ping name the
# kernels (for kernels loaded before it attached, once, in a child process on the same GPU), which
# a user attaching to a long job pays once at the start; every mode waits the same.
SETTLE_SECONDS = 3.0


def gpuwatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpuwatch.agent.cli", *args]


def tracer_env() -> dict:
    env = dict(os.environ)
    for var in ("LD_LIBRARY_PATH", "PYTHONPATH"):
        extra = os.environ.get(f"TRACER_{var}")
        if extra:
            env[var] = extra + (os.pathsep + env[var] if env.get(var) else "")
    return env


def bcc_missing() -> str:
    p = subprocess.run([sys.executable, "-c", "import bcc"], env=tracer_env(), capture_output=True, text=True)
    return "" if p.returncode == 0 else (p.stderr.strip().splitlines() or ["import bcc failed"])[-1]


class Lines:
    """A pipe read on a thread, so waits have deadlines."""

    def __init__(self, stream, log=None) -> None:
        self.q: queue.Queue = queue.Queue()
        self.log = log
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            if self.log is not None:
                self.log.write(line)
                self.log.flush()
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, pred, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            try:
                line = self.q.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"nothing matching within {timeout:g} s") from None
            if line is None:
                raise EOFError("the stream ended")
            if pred(line):
                return line


class Tool:
    """One process of the workload under one mode; start() to ready (and attached), then commands."""

    def __init__(self, mode: str, tmp: str, worker_args: list[str], tag: str) -> None:
        self.mode, self.tmp, self.tag = mode, tmp, tag
        self.tracer: subprocess.Popen | None = None
        self.summary_path = os.path.join(tmp, f"{tag}-summary.json")
        cmd = [sys.executable, WORKER, *worker_args] + (["--profiler"] if mode == "profiler" else [])
        if mode.startswith("run"):
            kernels = "continuous" if mode == "run-continuous" else "sampled"
            cmd = gpuwatch("run", "--kernels", kernels, "--quiet", "--socket", os.path.join(tmp, "no-agent.sock"),
                           "--report-dir", os.path.join(tmp, "reports"), "--") + cmd
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        self.log = open(os.path.join(tmp, f"{tag}-worker.log"), "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  env=env)
        self.out = Lines(self.p.stdout)

    def start(self) -> None:
        line = self.out.wait_for(lambda s: s.startswith("ready "), 300)
        pid = int(line.split()[1])
        if self.mode in TRACE_MODES:
            cmd = gpuwatch("trace", "--config", "", "--pid", str(pid), "--summary-json", self.summary_path,
                           "--interval", "1")
            if self.mode == "trace-output":
                cmd += ["--output", os.path.join(self.tmp, f"{self.tag}-perfetto.json")]
            self.tlog = open(os.path.join(self.tmp, f"{self.tag}-tracer.log"), "w")
            self.tracer = subprocess.Popen(cmd, stdout=self.tlog, stderr=subprocess.PIPE, text=True,
                                           env=tracer_env())
            self.terr = Lines(self.tracer.stderr, self.tlog)
            self.terr.wait_for(lambda s: s.startswith("tracing PID"), 120)

    def command(self, what: str, timeout: float = 600) -> dict:
        self.p.stdin.write(what + "\n")
        self.p.stdin.flush()
        return json.loads(self.out.wait_for(lambda s: s.startswith("{"), timeout))

    def finish(self) -> dict | None:
        """End the program; for a trace, wait for its summary (and file), not for the slow detach."""
        self.p.stdin.close()
        try:
            self.p.wait(120)
        except subprocess.TimeoutExpired:
            self.p.kill()
        summary = None
        if self.tracer is not None:
            try:  # the trace ends with the process: summary, --output file, then "detaching …"
                self.terr.wait_for(lambda s: s.startswith("detaching"), 300)
            except (TimeoutError, EOFError):
                pass
            if os.path.exists(self.summary_path):
                with open(self.summary_path) as f:
                    summary = json.load(f)
        return summary

    def kill(self) -> None:
        for p in (self.p, self.tracer):
            if p is not None and p.poll() is None:
                p.kill()


def launches_of(summary: dict) -> int:
    apis = summary.get("apis", {})
    return sum(apis.get(k, {}).get("calls", 0) for k in ("cuLaunchKernel", "cuLaunchKernelEx"))


# What a kernel name says it is (the names of trace_workload.py's cover work).
def kind_of(name: str) -> str:
    n = name or ""
    if "gw_cover_kernel" in n:
        return "triton"
    if any(f"{op}_kernel_cuda" in n for op in ("sin", "cos", "exp")):
        return "graph"
    low = n.lower()
    if any(s in low for s in ("nvjet", "gemm", "cutlass", "xmma", "cublas")):
        return "cublas"
    return "other"


def by_kind(kernels: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, n in kernels.items():
        out[kind_of(name)] = out.get(kind_of(name), 0) + n
    return out


def cover_row(tool: str, res: dict, summary: dict | None) -> dict:
    """What one tool saw of the cover work, against what the work did."""
    row: dict = {"tool": tool}
    if tool == "trace":
        if summary is None:
            return dict(row, error="no trace summary")
        apis = summary.get("apis", {})
        row["kernels"] = by_kind({k.get("name") or "?": k["launches"] for k in summary.get("kernels", [])})
        row["apis"] = {k: {"calls": v.get("calls", 0), "bytes": v.get("bytes", 0)} for k, v in apis.items()
                       if v.get("calls")}
        row["graph_launches"] = apis.get("cuGraphLaunch", {}).get("calls", 0)
        row["expand_bytes_seen"] = apis.get("cuMemCreate", {}).get("bytes", 0)
    elif tool == "profiler":
        prof = res.get("profiler") or {}
        row["kernels"] = by_kind(prof.get("kernels", {}))
        row["apis"] = prof.get("apis", {})
        row["graph_launches"] = sum(n for k, n in row["apis"].items() if "GraphLaunch" in k)
        row["expand_bytes_seen"] = None  # CUDA activity records no allocations (profile_memory is another option)
    else:
        agent = res.get("agent") or {}
        row["kernels"] = by_kind(agent.get("kernels", {}))
        row["graph_launches"] = None  # CUPTI activity of kernels only: no API calls
        held = [m.get("reserved", 0) for m in res.get("agent_memory_while_held") or []]
        row["expand_bytes_seen"] = max(held) if held else 0
        row["agent_state"] = agent.get("state")
    row["truth"] = {k: res.get(k) for k in ("tritons", "matmuls", "graph_replays", "graph_kernels", "expand_bytes",
                                            "reserved_growth_bytes")}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--decode-steps", type=int, default=200)
    ap.add_argument("--cover", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--time-limit", type=float, default=480, help="start no new round after this many seconds")
    ap.add_argument("--worker-args", default="",
                    help="extra arguments for trace_workload.py (e.g. '--device cpu --small')")
    ap.add_argument("--out")
    a = ap.parse_args()
    t_start = time.monotonic()
    modes = [m for m in a.modes.split(",") if m]
    if "none" not in modes or set(modes) - set(MODES):
        ap.error(f"--modes: none and any of {', '.join(MODES)}")
    notes = []
    missing = bcc_missing() if set(modes) & set(TRACE_MODES) else ""
    if missing:
        notes.append(f"trace modes left out: bcc not importable for the tracer ({missing})")
        modes = [m for m in modes if m not in TRACE_MODES]
    print("\n".join(notes), flush=True)
    worker_args = ["--train-steps", str(a.train_steps), "--decode-steps", str(a.decode_steps), *a.worker_args.split()]
    tmp = tempfile.mkdtemp(prefix="gpuwatch-trace-compare-")
    runs: dict[str, dict[int, dict]] = {m: {} for m in modes}  # mode -> round -> result
    failed: dict[str, str] = {}
    launches: dict[str, int] = {}
    tracers: list[subprocess.Popen] = []
    rounds_done = 0
    for r in range(a.rounds):
        if time.monotonic() - t_start > a.time_limit:
            notes.append(f"stopped after {r} rounds: --time-limit {a.time_limit:g} s")
            break
        order = modes if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            if mode in failed:
                continue
            tool = Tool(mode, tmp, worker_args, f"r{r}-{mode}")
            try:
                tool.start()
                warm = tool.command("ping")
                time.sleep(SETTLE_SECONDS)
                res = tool.command("time")
                res["ping"] = warm
                summary = tool.finish()
            except Exception as e:  # said, and the mode left out from here on; the others go on
                tool.kill()
                logs = [tool.log.name] + ([tool.tlog.name] if tool.tracer is not None else [])
                failed[mode] = f"round {r + 1}: {type(e).__name__}: {e}; " + " | ".join(
                    open(f, errors="replace").read()[-1500:] for f in logs)
                print(f"round {r + 1} {mode} FAILED: {failed[mode]}", flush=True)
                continue
            if tool.tracer is not None:
                tracers.append(tool.tracer)
            res["seconds_since_start"] = round(time.monotonic() - t_start, 1)
            runs[mode][r] = res
            # launches each tool counted in the timed section (the last round's process of each mode)
            if summary is not None:  # it counted the ping too; torch.profiler's count of a ping says how many
                launches[mode] = launches_of(summary)
                res["trace_apis"] = {k: v.get("calls", 0) for k, v in summary.get("apis", {}).items()}
            elif mode == "profiler":
                launches[mode] = res["profiler"]["launches"]
                launches["profiler-ping"] = warm["profiler"]["launches"]
            elif mode.startswith("run") and res.get("agent"):
                launches[mode] = res["agent"]["launches"]
            print(f"round {r + 1} {mode:15} train {res['train']['median'] * 1e3:8.3f} ms  "
                  f"decode {res['decode']['median'] * 1e3:7.3f} ms/token  (t={res['seconds_since_start']} s)",
                  flush=True)
        rounds_done = r + 1
    cover = []
    if a.cover and "--small" not in a.worker_args:
        for tool_name in [m for m in COVER_TOOLS if m in modes and m not in failed]:
            tool = Tool(tool_name, tmp, worker_args, f"cover-{tool_name}")
            try:
                tool.start()
                res = tool.command("cover")
                summary = tool.finish()
                cover.append(cover_row(tool_name, res, summary))
            except Exception as e:
                tool.kill()
                cover.append({"tool": tool_name, "error": f"{type(e).__name__}: {e}"})
            if tool.tracer is not None:
                tracers.append(tool.tracer)
            print(f"cover {tool_name}: {json.dumps(cover[-1])[:600]}", flush=True)

    table = {}
    for work in ("train", "decode"):
        for mode in modes:
            # each run against the none run of its own round
            pairs = [(m, runs["none"][r]) for r, m in sorted(runs[mode].items()) if r in runs["none"]]
            if not pairs:
                continue
            ratios = [m[work]["median"] / n[work]["median"] for m, n in pairs]
            mean_ratios = [m[work]["mean"] / n[work]["mean"] for m, n in pairs]
            table[f"{work}/{mode}"] = {
                "median_step_seconds": statistics.median(m[work]["median"] for m, _ in pairs),
                "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                "mean_ratio": statistics.median(mean_ratios), "ratios": ratios, "steps": pairs[0][0][work]["n"]}
    # Tracers detach in the background (the kernel takes ~0.1 s per uprobe); wait before leaving.
    for p in tracers:
        try:
            p.wait(600)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
              "rounds": rounds_done, "modes": modes, "notes": notes, "failed": failed, "results": table,
              "timed_section_launches_seen": launches, "cover": cover,
              "runs": {m: {r: {k: v for k, v in res.items() if k not in ("train", "decode")} |
                              {w: {k: v for k, v in res[w].items() if k != "all"} for w in ("train", "decode")}
                              for r, res in rs.items()} for m, rs in runs.items()},
              "seconds": round(time.monotonic() - t_start, 1)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'work':6} {'mode':15} {'median step':>12} {'ratio':>7} {'range':>15} {'mean ratio':>10}")
    for key, row in table.items():
        work, mode = key.split("/")
        print(f"{work:6} {mode:15} {row['median_step_seconds'] * 1e3:9.3f} ms {row['ratio']:7.3f} "
              f"{row['ratio_min']:7.3f}-{row['ratio_max']:.3f} {row['mean_ratio']:10.3f}")
    print("kernel launches seen in the timed section (last round):", launches)
    for mode, why in failed.items():
        print(f"FAILED {mode}: {why[:300]}")
    for row in cover:
        print("cover", json.dumps({k: v for k, v in row.items() if k != "apis"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
