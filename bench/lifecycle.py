"""What a user feels each time: the five lifecycle measures of issue 36, as medians with their spread.

  1. `gpuwatch trace -p PID` ready (warm bcc cache): from starting the CLI to its "tracing PID" line
     (the probe attached), and to its first live frame (stdout is a pipe: its first "[" line);
  2. prompt back after the traced process exits: from the traced process's exit (as its parent sees
     it) to the CLI's exit, summary printed and every uprobe detached;
  3. daemon stop after SIGTERM, eBPF on (NVML replayed from tests/fixtures/nvml-h200.json);
  4. daemon RSS, eBPF on, in normal use (a fake-libcuda process running, attached, a few collections
     in): VmRSS and RssAnon;
  5. `gpuwatch status` round trip: the CLI process's wall time, and the control call alone (one
     `control.call(socket, "status")` from this process).

The traced process is tests/ebpf/driver.c on the fake libcuda (tests/ebpf/fakecuda.c), built here:
it runs its workload while traced, and the summary's call count is checked against the one the
eBPF tests expect (exact counts are part of what is measured). The daemon runs beside another
driver.c process, which it finds and attaches to as on a node.

With --baseline-ref REF the same measures run, interleaved run by run, on a copy of that commit
(`git archive REF`, imported through PYTHONPATH from this checkout's .venv: no worktree, no
install), so that both sides see the same machine at the same moments.

Each side runs as installed: its bytecode compiled first (pip compiles it at install, scripts/setup
for the editable checkout). Without it, where PYTHONDONTWRITEBYTECODE is set or the checkout is
read-only, every start compiles gpuwatch anew; --uncompiled adds that side (a copy of this
checkout's files, no bytecode, PYTHONDONTWRITEBYTECODE=1) to show what it costs. Dependencies are
compiled too where they are writable (pyelftools, pynvml: pip compiles them at install);
--pynvml-uncompiled adds this checkout with a pynvml that has no bytecode, as the GPU machine's
image has it (every start compiles its 290 KB).

  sudo .venv/bin/python bench/lifecycle.py                       # ~1 minute, 10 runs
  sudo .venv/bin/python bench/lifecycle.py --baseline-ref 928b0d5 --out bench/results/lifecycle.json

Needs root, bcc, kernel headers and gcc (as tests/ebpf do). On a GPU node (the H200) it runs as is:
the fake libcuda is its own file, so the node's real driver and jobs are not touched; add
--library /usr/lib/x86_64-linux-gnu/libcuda.so.1 --nvml-real to measure the daemon on the real
driver and NVML instead (then RSS includes NVML's own). Prints a short table last.
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "nvml-h200.json"
EBPF_TESTS = ROOT / "tests" / "ebpf"


def build(d: Path) -> dict:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        sys.exit("no C compiler: install gcc")
    lib, drv = d / "libcuda.so.1", d / "driver"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                    str(EBPF_TESTS / "fakecuda.c")], check=True)
    subprocess.run([cc, "-O1", "-fno-omit-frame-pointer", "-pthread", "-o", str(drv), str(EBPF_TESTS / "driver.c"),
                    f"-L{d}", "-l:libcuda.so.1", f"-Wl,--disable-new-dtags,-rpath,{d}"], check=True)
    # DT_RPATH, not RUNPATH: a GPU node's LD_LIBRARY_PATH names the real libcuda, and RUNPATH loses to it
    return {"lib": str(lib), "driver": str(drv)}


def expected_calls() -> int:
    sys.path.insert(0, str(ROOT.parent))
    try:
        from tests.ebpf.test_ebpf_cuda import EXPECTED  # the driver's workload, call by call
    except ImportError:
        return -1
    finally:
        sys.path.pop(0)
    return sum(c for c, _, _ in EXPECTED.values())


def wait(p: subprocess.Popen, timeout: float) -> int:
    """p's exit status, seen the moment it exits (Popen.wait(timeout) polls, in steps of up to
    50 ms: the measures came out in multiples of it); killed past timeout."""
    t = threading.Timer(timeout, p.kill)
    t.start()
    try:
        return p.wait()
    finally:
        t.cancel()


class Driver:
    """driver.c: "ready PID" -> go -> "done" -> EOF on stdin -> exit 0."""

    def __init__(self, path: str) -> None:
        self.proc = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = int(self.proc.stdout.readline().split()[1])

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"

    def exit(self) -> float:
        """Close its stdin; the moment its exit is seen."""
        self.proc.stdin.close()
        wait(self.proc, 10)
        return time.monotonic()


def compile_dependencies() -> None:
    """pip compiles a package's bytecode when it installs it; a wheel unpacked onto PYTHONPATH (the
    GPU machine's pyelftools) has none, and with PYTHONDONTWRITEBYTECODE every start compiled it
    (130 ms of the trace's start on the H200); the GPU machine's image has none for pynvml either
    (16 MiB resident and 44 ms at each import there): compiled here, as an install would have."""
    import importlib.util
    for name in ("elftools", "pynvml"):
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        for where in spec.submodule_search_locations or []:
            if os.access(where, os.W_OK):
                compileall.compile_dir(where, quiet=1, workers=0)
        if spec.submodule_search_locations is None and spec.origin and os.access(os.path.dirname(spec.origin), os.W_OK):
            compileall.compile_file(spec.origin, quiet=1)


def pynvml_without_bytecode(work: Path) -> str:
    """A folder holding a copy of the installed pynvml.py and no bytecode: first on PYTHONPATH with
    PYTHONDONTWRITEBYTECODE, every start compiles it, as on an image whose pip ran with --no-compile."""
    import importlib.util
    spec = importlib.util.find_spec("pynvml")
    if spec is None or not spec.origin:
        sys.exit("--pynvml-uncompiled: pynvml is not installed")
    where = work / "pynvml-source"
    where.mkdir()
    shutil.copy(spec.origin, where / "pynvml.py")
    return str(where)


class Side:
    """One version of gpuwatch: this checkout, or a copy of an older commit on PYTHONPATH."""

    def __init__(self, name: str, pythonpath: str | None, tree: Path = ROOT, compiled: bool = True,
                 write_bytecode: bool = True) -> None:
        self.name = name
        self.env = dict(os.environ)
        if pythonpath:  # first: the older copy wins over this checkout (installed, or on the caller's path)
            self.env["PYTHONPATH"] = ":".join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)
            # a bcc cache of its own: the cache keeps one object, so two sides whose programs differ
            # would evict each other's and compile (~3 s) at every run
            self.env["GPUWATCH_BPF_CACHE"] = tempfile.mkdtemp(prefix="gw-lifecycle-bpf-")
        if compiled:
            for package in ("agent", "probes", "detectors", "exporters"):
                compileall.compile_dir(str(tree / package), quiet=1, workers=0)
            compile_dependencies()
        if not compiled or not write_bytecode:
            self.env["PYTHONDONTWRITEBYTECODE"] = "1"
        self.env["PYTHONUNBUFFERED"] = "1"
        self.cwd = tempfile.mkdtemp(prefix="gw-lifecycle-cwd-")  # not the checkout: its own gpuwatch must win
        # what the console script runs: agent/entry.py's main where the version has it (it answers
        # `status` before importing click), else click's group
        self.entry = "gpuwatch.agent.entry" if (tree / "agent" / "entry.py").exists() else "gpuwatch.agent.cli"

    def cli(self, *args: str, **kw) -> subprocess.Popen:
        """`gpuwatch ARGS` as the installed console script runs it (python -m would add runpy's start)."""
        script = f"import sys; from {self.entry} import main; sys.argv[0] = 'gpuwatch'; sys.exit(main())"
        return subprocess.Popen([sys.executable, "-c", script, *args], env=self.env, cwd=self.cwd, **kw)


def trace_once(side: Side, built: dict, want_calls: int) -> dict:
    d = Driver(built["driver"])
    times: dict = {}
    t0 = time.monotonic()
    p = side.cli("trace", "-p", str(d.pid), "--library", built["lib"], "--interval", "0.5",
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    attached = threading.Event()
    out: list[str] = []
    err: list[str] = []

    def read(stream, lines, ready_prefix, key):
        for line in stream:
            lines.append(line)
            if key not in times and line.startswith(ready_prefix):
                times[key] = time.monotonic() - t0
                if key == "ready":
                    attached.set()

    readers = [threading.Thread(target=read, args=(p.stderr, err, "tracing PID", "ready"), daemon=True),
               threading.Thread(target=read, args=(p.stdout, out, "[", "first_frame"), daemon=True)]
    for t in readers:
        t.start()
    if not attached.wait(60):
        p.kill()
        raise RuntimeError(f"{side.name}: the trace did not attach: {''.join(err)[-2000:]}")
    d.go()
    deadline = time.monotonic() + 10  # the first frame, before the process exits
    while "first_frame" not in times and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.01)
    exited = d.exit()
    rc = wait(p, 60)
    times["exit"] = time.monotonic() - exited
    for t in readers:
        t.join(5)
    text = "".join(out)
    calls = None
    for line in reversed(out):  # the summary's "N calls" total, or the last live line's
        if line.startswith("[") and " calls " in line:
            calls = int(line.split(" calls ")[1].split()[0])
            break
    if rc != 0 or "ended: process" not in text:
        raise RuntimeError(f"{side.name}: trace ended {rc}: {''.join(err)[-2000:]}")
    times["exact"] = calls == want_calls or want_calls < 0
    return times


def status_rss(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k = line.split(":")[0]
            if k in ("VmRSS", "RssAnon", "RssFile", "Threads"):
                out[k] = int(line.split()[1]) / 1024 if k != "Threads" else int(line.split()[1])
    return out


def rss_by_mapping(pid: int, top: int = 12) -> dict[str, list[float]]:
    """Where the daemon's resident memory lies: /proc/PID/smaps summed by what is mapped (a library's
    file name, [heap], [anon] for anonymous mappings, bpf maps), the `top` largest: {name: [Rss MiB,
    of which anonymous]}."""
    rss: dict[str, list[float]] = {}
    name = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                name = os.path.basename(head[5]) if len(head) > 5 else "[anon]"
            elif head[0] in ("Rss:", "Anonymous:"):
                v = rss.setdefault(name, [0.0, 0.0])
                v[head[0] == "Anonymous:"] += int(head[1]) / 1024
    return dict(sorted(rss.items(), key=lambda kv: -kv[1][0])[:top])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_once(side: Side, built: dict, settle: float, nvml_real: bool, status_calls: int,
                extra: tuple[str, ...] = ()) -> dict:
    d = Driver(built["driver"])
    d.go()  # a process that has made CUDA calls, as the daemon sees on a node
    top = Path(tempfile.mkdtemp(prefix="gw-lifecycle-"))
    log = top / "agent.log"
    nvml = [] if nvml_real else ["--nvml-replay", str(FIXTURE)]
    p = side.cli("agent", "--config", "", "--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(top / "s"),
                 "--runtime-dir", str(top / "r"), *nvml, "--no-cupti-sampling", "--no-baseline", *extra,
                 stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    sock = str(top / "r" / "control.sock")
    try:
        t0 = time.monotonic()
        while "probe ebpf is up" not in log.read_text(errors="replace"):
            if p.poll() is not None or time.monotonic() - t0 > 60:
                raise RuntimeError(f"{side.name}: the agent's eBPF probe did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        time.sleep(settle)  # normal use: collections, scrapes of nothing, the driver process mapped
        mem = status_rss(p.pid)
        mappings = rss_by_mapping(p.pid)
        t = time.monotonic()
        st = side.cli("status", "--socket", sock, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait(st, 30)
        cli_s = time.monotonic() - t
        call_s = []
        code = (f"import time,sys\nfrom gpuwatch.agent.control import call\nr=[]\n"
                f"for _ in range({status_calls}):\n t=time.perf_counter(); call({sock!r}, 'status'); "
                f"r.append(time.perf_counter()-t)\nprint(' '.join(map(str,r)))")
        got = subprocess.run([sys.executable, "-c", code], env=side.env, cwd=side.cwd, capture_output=True,
                             text=True, timeout=60)
        if got.returncode == 0:
            call_s = [float(x) for x in got.stdout.split()]
        t = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = wait(p, 60)
        stop_s = time.monotonic() - t
        text = log.read_text(errors="replace")
        if rc != 0 or "Traceback" in text:
            raise RuntimeError(f"{side.name}: the agent stopped with {rc}: {text[-2000:]}")
        return {"stop": stop_s, "VmRSS": mem["VmRSS"], "RssAnon": mem["RssAnon"], "Threads": mem["Threads"],
                "status_cli": cli_s, "status_call": statistics.median(call_s) if call_s else float("nan"),
                "status_ok": st.returncode == 0, "rss_by_mapping": mappings}
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        d.exit()
        shutil.rmtree(top, ignore_errors=True)


def summary(values: list[float]) -> dict:
    v = sorted(x for x in values if x == x)
    if not v:
        return {"median": None}
    q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "q1": q[0], "q3": q[2], "n": len(v)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--baseline-ref", help="an older commit measured the same way, interleaved (e.g. 928b0d5), "
                    "or a file that `git archive` wrote of one (named by its file name)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of normal use before RSS and status")
    ap.add_argument("--fill-history", type=float, metavar="SECONDS",
                    help="before RSS: NVML read every 0.05 s for SECONDS (instead of --settle), so that its series "
                         "hold what a node's hold after hours (720 points each at 36 s)")
    ap.add_argument("--status-calls", type=int, default=10, help="control calls per run (their median is kept)")
    ap.add_argument("--nvml-real", action="store_true", help="the daemon reads the real NVML (a GPU node)")
    ap.add_argument("--uncompiled", action="store_true",
                    help="also measure a copy without bytecode (PYTHONDONTWRITEBYTECODE=1: compiled at every start)")
    ap.add_argument("--pynvml-uncompiled", action="store_true",
                    help="also measure this checkout with a pynvml that has no bytecode (as the GPU machine's image has it)")
    ap.add_argument("--only", choices=("trace", "daemon"), help="one half only")
    ap.add_argument("--out", help="write every run and the summary as JSON here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (eBPF uprobes)")
    work = Path(tempfile.mkdtemp(prefix="gw-lifecycle-build-"))
    built = build(work)
    want = expected_calls()
    sides = [Side("this", None)]

    def copy_of(ref: str | None, name: str, compiled: bool) -> Side:
        """A copy of commit `ref` (None: this checkout's files, without bytecode or .git)."""
        base = work / name.replace(" ", "-")
        (base / "pp").mkdir(parents=True)
        tree = base / "tree"
        if ref is None:
            shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".*", "__pycache__", "tests", "bench", "docs"))
        elif os.path.isfile(ref):  # `git archive` output, carried where there is no .git (the GPU machine)
            tree.mkdir()
            subprocess.run(["tar", "-x", "-f", ref, "-C", str(tree)], check=True)
        else:
            tree.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        (base / "pp" / "gpuwatch").symlink_to(tree)  # the package is the repository's root
        return Side(name, str(base / "pp"), tree, compiled)

    if args.baseline_ref:
        sides.append(copy_of(args.baseline_ref, os.path.basename(args.baseline_ref).split(".")[0], True))
    if args.uncompiled:
        sides.append(copy_of(None, "no bytecode", False))
    if args.pynvml_uncompiled:
        sides.append(Side("pynvml source", pynvml_without_bytecode(work), write_bytecode=False))
    fill = ("--nvml-interval", "0.05", "--nvml-slow-interval", "0.05") if args.fill_history else ()
    load = os.getloadavg()
    runs: dict[str, list[dict]] = {s.name: [] for s in sides}
    t_all = time.monotonic()
    try:
        for s in sides:  # warm each side's bcc cache (the trace's and the daemon's programs differ)
            if args.only != "daemon":
                trace_once(s, built, want)
            if args.only != "trace":
                daemon_once(s, built, 0.0, args.nvml_real, 1)
        for i in range(args.runs):
            for s in (sides if i % 2 == 0 else sides[::-1]):  # interleaved, alternating who goes first
                r: dict = {}
                if args.only != "daemon":
                    r.update(trace_once(s, built, want))
                if args.only != "trace":
                    r.update(daemon_once(s, built, args.fill_history or args.settle, args.nvml_real, args.status_calls,
                                         fill))
                runs[s.name].append(r)
                print(f"run {i + 1}/{args.runs} {s.name}: " + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items() if not isinstance(v, dict)),
                    flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    measures = [("ready", "trace ready: 'tracing PID' line", "s"), ("first_frame", "trace first live frame (--interval 0.5)", "s"),
                ("exit", "prompt back after the process exits", "s"), ("stop", "daemon stop after SIGTERM (eBPF on)", "s"),
                ("VmRSS", "daemon VmRSS, eBPF on", "MiB"), ("RssAnon", "daemon RssAnon, eBPF on", "MiB"),
                ("status_cli", "`gpuwatch status` CLI wall", "s"), ("status_call", "status control call alone", "s")]
    table = {s: {k: summary([r[k] for r in rs if k in r]) for k, _, _ in measures} for s, rs in runs.items()}
    exact = {s: all(r.get("exact", True) for r in rs) for s, rs in runs.items()}
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": table, "exact": exact, "loadavg_before": load,
                                              "loadavg_after": os.getloadavg(), "seconds": time.monotonic() - t_all},
                                             indent=2) + "\n")
    print(f"\n{args.runs} runs each, interleaved; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{time.monotonic() - t_all:.0f} s in all; trace counts exact: "
          + ", ".join(f"{s} {'yes' if e else 'NO'}" for s, e in exact.items()))

    def cell(m: dict, unit: str) -> str:
        if m.get("median") is None:
            return "-"
        f = (lambda x: f"{x * 1000:.0f}" if x >= 0.01 else f"{x * 1000:.2f}") if unit == "s" else (lambda x: f"{x:.1f}")
        return f"{f(m['median'])} [{f(m['min'])}-{f(m['max'])}]"
    head = f"{'measure (median [min-max]; ms or MiB)':46}" + "".join(f"{s:>24}" for s in runs)
    print(head)
    for k, label, unit in measures:
        if any(table[s][k].get("median") is not None for s in runs):
            print(f"{label:46}" + "".join(f"{cell(table[s][k], unit):>24}" for s in runs))
    if args.only != "trace":  # where the last run's daemon's resident memory lay
        print("\ndaemon resident memory by mapping, the last run (MiB; of which anonymous)")
        names = list(dict.fromkeys(k for s in runs for k in runs[s][-1].get("rss_by_mapping", {})))
        print(f"{'mapping':46}" + "".join(f"{s:>24}" for s in runs))
        for n in names:
            print(f"{n[:46]:46}" + "".join(
                f"{'%.1f (%.1f)' % tuple(runs[s][-1]['rss_by_mapping'][n]) if n in runs[s][-1].get('rss_by_mapping', {}) else '-':>24}"
                for s in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
