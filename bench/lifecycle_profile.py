"""Where bench/lifecycle.py's time and memory go, phase by phase (issue 36): one run of each, timed
inside the processes by wrapping their methods (nothing of gpuwatch is changed).

  1. trace (the median of 5 runs): `gpuwatch trace -p` in-process on tests/ebpf/driver.c (the fake libcuda): interpreter and
     imports, validation, object load from the bcc cache, attach, the "tracing PID" line, first read,
     then after the process exits: the loop noticing it, freeze, final snapshot (symbolising), summary,
     detach (the graph thread's stop, the links' close);
  2. daemon stop: `gpuwatch agent` (NVML replayed, eBPF on, a driver.c process attached): SIGTERM to
     exit, each shutdown step and each thread join of 10 ms or more;
  3. resident cost of what the daemon imports: each library imported in a fresh interpreter after
     the ones before it (the daemon's order), VmRSS and the Python heap (tracemalloc) it adds;
  4. `gpuwatch status`: the CLI's imports (-X importtime, the largest) and one control call.

  sudo .venv/bin/python bench/lifecycle_profile.py

Needs root, bcc, kernel headers and gcc (as bench/lifecycle.py).
"""
from __future__ import annotations

import compileall
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lifecycle import FIXTURE, ROOT, Driver, build, compile_dependencies, free_port, wait  # noqa: E402

PY = sys.executable

TRACE = r'''
import sys, time, functools, threading, subprocess
T0 = float(sys.argv[3]); marks = []
def mark(what): marks.append((time.monotonic() - T0, what))
mark("interpreter up")
from gpuwatch.agent import cli
from gpuwatch.agent.trace import session
mark("imports (cli, trace session)")
from gpuwatch.probes.ebpf import probe as P, loader as L, graphs as G
mark("imports (eBPF probe)")
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        mark("> " + label)
        try: return f(*a, **k)
        finally: mark("< " + label)
    setattr(obj, name, w)
wrap(session, "validate", "validate the process"); wrap(L.Loader, "__init__", "object load (cache) + maps")
wrap(L.Loader, "attach", "attach (links)"); wrap(P.EbpfCudaProbe, "start", "probe start")
wrap(P.EbpfCudaProbe, "freeze", "freeze"); wrap(session, "summarize", "summary")
wrap(session, "render_summary", "render summary"); wrap(G.GraphFollower, "stop", "graph thread stop")
wrap(L.Loader, "close", "detach links + free maps"); wrap(session, "_detach", "detach")
from gpuwatch.probes.ebpf import bpfsys as B, compiler as C
wrap(L, "function_offsets", "  symbol offsets (pyelftools; its import the first time)")
wrap(B, "uprobe_multi_link", "  one multi-uprobe link"); wrap(B, "prog_load", "  verify + load a program")
wrap(C, "compiled", "  the object from the bcc cache")
totals = {}
def summed(obj, name, label):  # called often: one line with the count and the sum, at the end
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.monotonic()
        try: return f(*a, **k)
        finally:
            n, s = totals.get(label, (0, 0.0)); totals[label] = (n + 1, s + time.monotonic() - t)
    setattr(obj, name, w)
summed(B, "map_create", "maps created")
_snap = P.EbpfCudaProbe.snapshot
def snap(self, pid=None, wait_symbols=True):
    mark("> snapshot" + ("" if wait_symbols else " (live)"))
    try: return _snap(self, pid, wait_symbols)
    finally: mark("< snapshot" + ("" if wait_symbols else " (live)"))
P.EbpfCudaProbe.snapshot = snap
import io, contextlib
err = sys.stderr
class Tee(io.TextIOBase):
    def write(self, s):
        if s.startswith("tracing PID"): mark("'tracing PID' line printed")
        return err.write(s)
sys.stderr = Tee()
pid = int(sys.argv[1])
def exit_watch():
    sys.stdin.readline(); mark("PROCESS EXITED (seen by its parent)")
threading.Thread(target=exit_watch, daemon=True).start()
import os
sys.stdout = open(os.devnull, "w")  # the live lines and the summary: only the marks are printed
session.run_trace(pid, library=sys.argv[2], interval=0.5)
mark("run_trace returned")
sys.stderr = err
print("\n".join(f"{t:8.3f} {w}" for t, w in marks), file=sys.__stdout__)
for label, (n, s) in totals.items(): print(f"   {label}: {n} calls, {s:.3f} s in all", file=sys.__stdout__)
'''

DAEMON = r'''
import sys, time, functools, threading, atexit
def log(m): print(f"PROF {time.monotonic():.4f} {m}", file=sys.stderr, flush=True)
from gpuwatch.agent import runner, control, store
import gpuwatch.probes.ebpf.probe as P, gpuwatch.probes.ebpf.graphs as G, gpuwatch.probes.ebpf.loader as L
import gpuwatch.probes.nvml.probe as N
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(self, *a, **k):
        t = time.monotonic()
        try: return f(self, *a, **k)
        finally: log(f"{label} {time.monotonic() - t:.4f}")
    setattr(obj, name, w)
wrap(control.ControlServer, "stop", "control socket stop"); wrap(runner.Runner, "shutdown", "runner shutdown (probes, exporters)")
wrap(store.Store, "close", "store close"); wrap(P.EbpfCudaProbe, "shutdown", "  eBPF probe shutdown")
wrap(G.GraphFollower, "stop", "    graph thread stop"); wrap(L.Loader, "close", "    detach links + free maps")
wrap(N.NvmlProbe, "shutdown", "  NVML probe shutdown (XID thread)")
atexit.register(lambda: log("interpreter exit begins"))
join = threading.Thread.join
def timed_join(self, timeout=None):
    t = time.monotonic(); r = join(self, timeout); d = time.monotonic() - t
    if d > 0.01: log(f"    join {self.name} {d:.4f}")
    return r
threading.Thread.join = timed_join
from gpuwatch.agent.cli import main
sys.argv = ["gpuwatch"] + sys.argv[1:]
main()
'''

IMPORTS = r'''
import sys, importlib, tracemalloc, json
def rss():
    with open("/proc/self/smaps_rollup") as f:
        d = {l.split(":")[0]: int(l.split()[1]) for l in f if ":" in l and l.split()[1].isdigit()}
    return d["Rss"] / 1024, d.get("Anonymous", 0) / 1024
trace = sys.argv[1] == "tracemalloc"
if trace: tracemalloc.start()
out = []
base = rss()
for m in json.loads(sys.argv[2]):
    r0, h0 = rss(), tracemalloc.get_traced_memory()[0] if trace else 0
    importlib.import_module(m)
    r1, h1 = rss(), tracemalloc.get_traced_memory()[0] if trace else 0
    out.append([m, r1[0] - r0[0], r1[1] - r0[1], (h1 - h0) / 2**20])
print(json.dumps({"base": base, "end": rss(), "each": out}))
'''

# the daemon's imports, libraries first (in the order the daemon's own modules pull them in), then its modules
DAEMON_IMPORTS = ["logging", "dataclasses", "json", "sqlite3", "ssl", "http.server", "wsgiref.simple_server",
                  "click", "psutil", "pynvml", "prometheus_client.exposition", "elftools.elf.elffile",
                  "concurrent.futures", "gpuwatch.agent.wire", "gpuwatch.agent.config", "gpuwatch.agent.control",
                  "gpuwatch.agent.runner", "gpuwatch.probes.nvml", "gpuwatch.probes.ebpf", "gpuwatch.exporters.prometheus",
                  "gpuwatch.agent.daemon", "gpuwatch.agent.cli"]


def _ready(profile: str) -> float:
    return next((float(line.split()[0]) for line in profile.splitlines() if "'tracing PID'" in line), math.inf)


def trace_profile(built: dict) -> str:
    d = Driver(built["driver"])
    t0 = time.monotonic()
    p = subprocess.Popen([PY, "-c", TRACE, str(d.pid), built["lib"], repr(t0)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(1.2)
    d.go()
    d.exit()
    p.stdin.write("exited\n")
    p.stdin.flush()
    out, _ = p.communicate(timeout=60)
    return out


def daemon_profile(built: dict) -> str:
    d = Driver(built["driver"])
    d.go()
    top = Path(tempfile.mkdtemp(prefix="gw-lifecycle-profile-"))
    log = top / "log"
    p = subprocess.Popen([PY, "-c", DAEMON, "agent", "--config", "", "--listen", f"127.0.0.1:{free_port()}",
                          "--state-dir", str(top / "s"), "--runtime-dir", str(top / "r"), "--nvml-replay", str(FIXTURE),
                          "--no-cupti-sampling", "--no-baseline"], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    while "probe ebpf is up" not in log.read_text(errors="replace"):
        if p.poll() is not None:
            return log.read_text()[-2000:], "no agent"
        time.sleep(0.05)
    time.sleep(3)
    status = status_profile(str(top / "r" / "control.sock"))  # against this live agent: the path users take
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    wait(p, 60)
    end = time.monotonic()
    d.exit()
    lines = [f"{0.0:8.3f} SIGTERM sent"]
    for line in log.read_text().splitlines():
        if line.startswith("PROF "):
            _, ts, rest = line.split(" ", 2)
            if float(ts) >= t - 0.001:
                lines.append(f"{float(ts) - t:8.3f} {rest}")
    lines.append(f"{end - t:8.3f} process exited (seen by its parent)")
    return "\n".join(lines), status


def import_profile() -> str:
    rows = {}
    for mode in ("rss", "tracemalloc"):
        r = subprocess.run([PY, "-c", IMPORTS, mode, json.dumps(DAEMON_IMPORTS)], capture_output=True, text=True,
                           cwd=tempfile.gettempdir())
        rows[mode] = json.loads(r.stdout)
    out = [f"interpreter alone: Rss {rows['rss']['base'][0]:.1f} MiB (anonymous {rows['rss']['base'][1]:.1f}); "
           f"after all: {rows['rss']['end'][0]:.1f} MiB (anonymous {rows['rss']['end'][1]:.1f})",
           f"{'module (and what it pulls in first)':40} {'Rss +MiB':>9} {'anon +MiB':>9} {'py heap +MiB':>12}"]
    for (m, rss, anon, _h), (_m, _r, _a, heap) in zip(rows["rss"]["each"], rows["tracemalloc"]["each"]):
        out.append(f"{m:40} {rss:9.2f} {anon:9.2f} {heap:12.2f}")
    return "\n".join(out)


def status_profile(sock: str) -> str:
    # as the console script runs it (agent/entry.py: status before click), not python -m
    script = "import sys; from gpuwatch.agent.entry import main; sys.argv[0] = 'gpuwatch'; sys.exit(main())"
    r = subprocess.run([PY, "-X", "importtime", "-c", script, "status", "--socket", sock],
                       capture_output=True, text=True, cwd=tempfile.gettempdir())
    if r.returncode != 0:  # an error path imports what the answer does not (psutil, to find agents)
        return f"status failed ({r.returncode}): {r.stdout[-300:]}"
    rows = []
    for line in r.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            self_us, cum_us, name = line[len("import time:"):].split("|")
            if self_us.strip().isdigit():
                rows.append((int(cum_us), int(self_us), name.rstrip()))
    tops = [(c, s, n.strip()) for c, s, n in rows if not n.startswith("  ")]  # top level: one space
    tops.sort(reverse=True)
    t = time.monotonic()
    subprocess.run([PY, "-c", "pass"], check=True)
    bare = time.monotonic() - t
    out = [f"python -c pass (this venv): {bare * 1000:.0f} ms", f"{'top-level import':40} {'cum ms':>8} {'self ms':>8}"]
    out += [f"{n:40} {c / 1000:8.1f} {s / 1000:8.1f}" for c, s, n in tops[:12]]
    return "\n".join(out)


def main() -> int:
    if os.geteuid() != 0:
        sys.exit("needs root (eBPF uprobes)")
    work = Path(tempfile.mkdtemp(prefix="gw-lifecycle-profile-build-"))
    built = build(work)
    # as installed: with bytecode (scripts/setup compiles it; PYTHONDONTWRITEBYTECODE would compile at each start)
    for package in ("agent", "probes", "detectors", "exporters"):
        compileall.compile_dir(str(ROOT / package), quiet=1, workers=0)
    compile_dependencies()
    trace_profile(built)  # warm the bcc cache
    runs = sorted((trace_profile(built) for _ in range(5)), key=_ready)
    print(f"load average {os.getloadavg()[0]:.2f}\n\n== 1. trace: seconds since the CLI process began "
          f"(the median of 5 runs by its 'tracing PID' line; they ranged {_ready(runs[0]):.3f}-{_ready(runs[-1]):.3f}) ==")
    print(runs[2])
    print("\n== 2. daemon stop: seconds since SIGTERM ==")
    stop, status = daemon_profile(built)
    print(stop)
    print("\n== 3. what the daemon's imports cost resident ==")
    print(import_profile())
    print("\n== 4. `gpuwatch status` against that agent: the CLI's imports ==")
    print(status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
