"""What the agent needs of the unit's MemoryMax=, LimitNOFILE= and TasksMax=: a real agent, eBPF on.

Starts `gpuwatch agent` (NVML replayed from the H200 recording, eBPF on, an empty bcc cache so that
it compiles its probe in the bcc child, as on a node's first start) in a memory cgroup of its own
where it can make one (cgroup v2 or v1 under this process's own), with PROCS processes calling a
fake libcuda.so.1 (tests/ebpf/fakecuda.c) so that uprobes attach. Polls every 20 ms for SECONDS:
the agent's RSS (and its VmHWM), each child's (the bcc compile child among them), the cgroup's
usage peak (page cache and kernel memory, BPF maps included, as MemoryMax= counts), the agent's
fds and threads, and the tasks of agent and children together (what TasksMax= counts).

  sudo .venv/bin/python bench/unit_limits.py [--seconds 40] [--procs 8]
  sudo .venv/bin/python bench/unit_limits.py --gpu --seconds 120   # on a GPU node: real NVML, the CUPTI
      sampler on, and one reference workload run (`gpuwatch baseline run --force`) once eBPF is up

Needs root (eBPF), bcc, kernel headers and gcc, as tests/ebpf do. Prints a short table last.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "nvml-h200.json"
MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(d: Path) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    lib = d / "libcuda.so.1"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                    str(ROOT / "tests" / "ebpf" / "fakecuda.c")], check=True)
    exe = d / "hooked_calls"
    subprocess.run([cc, "-O1", "-pthread", "-o", str(exe), str(ROOT / "bench" / "hooked_calls.c"), f"-L{d}",
                    "-l:libcuda.so.1", f"-Wl,-rpath,{d}"], check=True)
    return exe


def make_cgroup(name: str) -> tuple[Path, str] | None:
    """(directory, "v2"|"v1") of a new memory cgroup below this process's own; None where it cannot."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            base, kind = Path("/sys/fs/cgroup") / path.lstrip("/"), "v2"
        elif "memory" in ctrls.split(","):
            base, kind = Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "v1"
        else:
            continue
        try:
            d = base / name
            d.mkdir()
            return d, kind
        except OSError:
            continue
    return None


def cgroup_peak(cg: tuple[Path, str] | None, kernel: bool = False) -> int | None:
    """The cgroup's peak usage (kernel: its kernel memory's, v1 only)."""
    if cg is None:
        return None
    d, kind = cg
    name = "memory.peak" if kind == "v2" else "memory.kmem.max_usage_in_bytes" if kernel else "memory.max_usage_in_bytes"
    if kernel and kind == "v2":
        return None
    try:
        return int((d / name).read_text())
    except (OSError, ValueError):
        return None


def status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "Threads", "RssAnon"):
                out[k] = int(v.split()[0]) * (1024 if k != "Threads" else 1)
    except (OSError, ValueError):
        pass
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
                out += map(int, kids)
                todo += map(int, kids)
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--procs", type=int, default=8, help="processes calling the fake libcuda")
    ap.add_argument("--gpu", action="store_true", help="real NVML, CUPTI sampling and a reference workload run")
    a = ap.parse_args()
    top = Path(tempfile.mkdtemp(prefix="gw-unit-limits-"))
    cg = make_cgroup(f"gw-unit-limits-{os.getpid()}")
    procs: list[subprocess.Popen] = []
    agent = None
    try:
        exe = build(top)
        for _ in range(a.procs):  # each makes 10**12 launches: busy for the whole run
            p = subprocess.Popen([str(exe), "launch", "1", str(10**12)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            p.stdout.readline()
            p.stdin.write("\n")
            p.stdin.flush()
            procs.append(p)
        (top / "bpf-cache").mkdir()
        port = free_port()
        env = dict(os.environ, GPUWATCH_BPF_CACHE=str(top / "bpf-cache"))
        cmd = [sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "", "--listen", f"127.0.0.1:{port}",
               "--state-dir", str(top / "state"), "--runtime-dir", str(top / "run")]
        if not a.gpu:
            cmd += ["--nvml-replay", str(FIXTURE), "--no-baseline", "--no-cupti-sampling"]
        workload = None
        enter = f'echo $$ > {cg[0] / "cgroup.procs"} && ' if cg else ""
        agent = subprocess.Popen(["sh", "-c", f'{enter}exec "$@"', "sh", *cmd], env=env, start_new_session=True,
                                 stdin=subprocess.DEVNULL, stdout=open(top / "agent.log", "wb"),
                                 stderr=subprocess.STDOUT)
        peak = {"anon": 0, "rss": 0, "fds": 0, "threads": 0, "tasks": 0, "sum": 0}
        child_peak: dict[str, int] = {}
        end = time.monotonic() + a.seconds
        up_at = None
        sampler_states: list[tuple[float, str]] = []
        while time.monotonic() < end and agent.poll() is None:
            st = status(agent.pid)
            kids = descendants(agent.pid)
            total, tasks = st.get("VmRSS", 0), st.get("Threads", 0)
            for k in kids:
                ks = status(k)
                total += ks.get("VmRSS", 0)
                tasks += ks.get("Threads", 0)
                line = cmdline(k)
                if not line or not ks.get("VmHWM"):
                    continue  # exiting, or the shell before its exec
                words = [w.rsplit("/", 1)[-1] for w in line.split(" ") if w and not w.startswith("-")]
                what = " ".join(words[1:3] if words[0].startswith("python") else words[:1])
                what = what.replace("gpuwatch.probes.", "")
                child_peak[what] = max(child_peak.get(what, 0), ks.get("VmHWM", 0))
                anon_key = f"{what} (anonymous)"
                child_peak[anon_key] = max(child_peak.get(anon_key, 0), ks.get("RssAnon", 0))
            try:
                fds = len(os.listdir(f"/proc/{agent.pid}/fd"))
            except OSError:
                fds = 0
            peak.update(anon=max(peak["anon"], st.get("RssAnon", 0)), rss=max(peak["rss"], st.get("VmHWM", 0)), fds=max(peak["fds"], fds),
                        threads=max(peak["threads"], st.get("Threads", 0)), tasks=max(peak["tasks"], tasks),
                        sum=max(peak["sum"], total))
            if up_at is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                        if b'gpuwatch_probe_up{probe="ebpf"} 1' in r.read():
                            up_at = a.seconds - (end - time.monotonic())
                            if a.gpu:
                                # Not --force: the GPU is idle but for the agent's own sampler, which must
                                # neither count as a compute process nor stay beside the run (issue 34).
                                workload = subprocess.Popen(
                                    [sys.executable, "-m", "gpuwatch.agent.cli", "baseline", "run", "--config", "",
                                     "--socket", str(top / "run" / "control.sock")],
                                    stdout=open(top / "baseline.out", "wb"), stderr=subprocess.STDOUT)
                except OSError:
                    pass
            if a.gpu and up_at is not None and len(sampler_states) < 64:
                # The CUPTI sampler's state as the agent says it (sampling, paused while a baseline run
                # holds the GPU, ...), each change once.
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                        now = [ln.split('state="', 1)[1].split('"', 1)[0] for ln in r.read().decode().splitlines()
                               if ln.startswith("gpuwatch_profiling_state{") and 'state="' in ln
                               and float(ln.rsplit(" ", 1)[1]) == 1]
                    if now and (not sampler_states or sampler_states[-1][1] != now[0]):
                        sampler_states.append((round(a.seconds - (end - time.monotonic()), 1), now[0]))
                except (OSError, IndexError):
                    pass
            time.sleep(0.02)
        steady = status(agent.pid).get("VmRSS", 0)
        if workload is not None:
            print(f"gpuwatch baseline run: exit {workload.wait(600)}")
            print((top / "baseline.out").read_text(errors="replace")[-1500:])
            print("sampler states (s after start, state):", sampler_states)
            smi = shutil.which("nvidia-smi")
            if smi:
                print(subprocess.run([smi, "--query-compute-apps=pid,process_name,used_memory", "--format=csv"],
                                     capture_output=True, text=True).stdout)
        uprobes = ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode().splitlines()
            uprobes = " ".join(line for line in text if line.startswith("gpuwatch_ebpf_attached"))
            if a.gpu:  # the agent's own GPU processes and what NVML charges them (the sampler's context)
                own = {line.split('pid="', 1)[1].split('"', 1)[0] for line in text
                       if line.startswith("gpuwatch_agent_gpu_process{") and 'pid="' in line}
                print("the agent's own GPU processes:", *(line for line in text if line.startswith(
                    ("gpuwatch_agent_gpu_process{", "gpuwatch_process_gpu_memory_usage_bytes{"))
                    and any(f'pid="{p}"' in line for p in own)), sep="\n  ")
        except OSError:
            pass
        cgp, kmem = cgroup_peak(cg), cgroup_peak(cg, kernel=True)
        print(f"\nagent log tail:\n{(top / 'agent.log').read_text(errors='replace')[-1500:]}")
        print(f"eBPF up after {up_at if up_at is None else round(up_at, 1)} s; {uprobes}")
        print(f"{'what':48} {'value':>10}")
        rows = [("agent peak RSS (VmHWM)", f"{peak['rss'] / MIB:.1f} MiB"),
                ("agent anonymous RSS, peak", f"{peak['anon'] / MIB:.1f} MiB"),
                ("agent RSS at the end", f"{steady / MIB:.1f} MiB"),
                *((f"child {k}, peak RSS"[:48], f"{v / MIB:.1f} MiB") for k, v in sorted(child_peak.items())),
                ("agent + children, RSS at once, peak", f"{peak['sum'] / MIB:.1f} MiB"),
                (f"cgroup ({cg[1] if cg else '-'}) peak, page cache + kernel", f"{cgp / MIB:.1f} MiB" if cgp else "n/a"),
                ("cgroup kernel memory peak (BPF maps...)", f"{kmem / MIB:.1f} MiB" if kmem else "n/a"),
                ("agent fds, peak", str(peak["fds"])),
                ("agent threads, peak", str(peak["threads"])),
                ("tasks (agent + children threads), peak", str(peak["tasks"]))]
        for k, v in rows:
            print(f"{k:48} {v:>10}")
        return 0
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait(20)
        for p in procs:
            p.kill()
            p.wait()
        if cg is not None:
            for _ in range(50):
                try:
                    cg[0].rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
