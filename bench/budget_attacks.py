"""The agent's footprint under issue 31's bloat attacks, at the default budget (agent/budget.py).

A real agent (eBPF on, NVML off) as root; the attackers run as nobody (uid 65534), through the fake
libcuda of tests/ebpf (fakecuda.c) and tests/ebpf/attacker.c:

  graphs      one process captures a graph of 4,096 launches (distinct grids) and instantiates it
              4,096 times (the agent took 73 -> 664 MB before the budget); then eight such processes
              of one user, then of eight users (uids 65527-65534: the node-wide limit)
  copies 600  one process loads 600 private copies of libcuda (RTLD_LOCAL); the agent scans for
              libraries under LimitNOFILE=1024 (before: the control socket failed with EMFILE)

For each: the agent's RSS (VmRSS) before and after, its fds and uprobes, one scrape a second
during the attack and after (answered / asked), `gpuwatch status` answered, new log lines, and how
long the agent took to stop on SIGTERM.

Usage (repo root, as root; bcc and kernel headers as for tests/ebpf):
    .venv/bin/python bench/budget_attacks.py
Prints one table; numbers go to docs/security.md ("Measured under the floods").
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpuwatch.agent.control import ControlError, call  # noqa: E402
from tests.conftest import Agent, series  # noqa: E402
from tests.ebpf.conftest import HERE, _build  # noqa: E402

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def as_user(uid: int) -> tuple[str, ...]:
    return ("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups")
MIB = 1 << 20


def status_of(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class Scraper(threading.Thread):
    """One scrape a second: (answered, asked)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.ok, self.asked, self.stop = url, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.asked += 1
            try:
                with urllib.request.urlopen(self.url, timeout=1.0) as r:
                    self.ok += r.status == 200 and b"gpuwatch_build_info" in r.read()
            except OSError:
                pass
            self.stop.wait(1.0)


def wait_up(a: Agent, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if call(str(a.socket), "status")["probes"].get("ebpf", {}).get("state") == "up":
                return
        except ControlError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the eBPF probe did not come up:\n{a.output()[-2000:]}")


def start(tmp: Path, name: str, *args: str, nofile: int | None = None) -> Agent:
    real = subprocess.Popen
    if nofile:
        subprocess.Popen = lambda cmd, **kw: real(["prlimit", f"--nofile={nofile}", "--", *cmd], **kw)
    try:
        a = Agent(tmp / name, "--no-nvml", *args)
    finally:
        subprocess.Popen = real
    wait_up(a)
    time.sleep(2)  # settled
    return a


def ready(*cmd: str) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    assert p.stdout.readline().startswith("ready"), cmd
    return p


def measure(a: Agent, label: str, attack, rows: list) -> None:
    pid = a.proc.pid
    lines0 = len(a.output().splitlines())
    rss0 = status_of(pid, "VmRSS") / 1024
    s = Scraper(a.url)
    s.start()
    t0 = time.monotonic()
    procs = attack()
    took = time.monotonic() - t0
    time.sleep(5)  # the agent catches up; scrapes go on
    s.stop.set()
    s.join()
    text = a.metrics()
    rss1 = status_of(pid, "VmRSS") / 1024
    nfds = len(os.listdir(f"/proc/{pid}/fd"))
    uprobes = sum(v for k, v in series(text, "gpuwatch_ebpf_attached").items() if 'what="uprobes"' in k)
    libs = sum(v for k, v in series(text, "gpuwatch_ebpf_attached").items() if 'what="libraries"' in k)
    refused = {k: v for k, v in series(text, "gpuwatch_budget_refusals_total").items() if v}
    try:
        call(str(a.socket), "status")
        status = "yes"
    except ControlError as e:
        status = f"no ({e})"
    lines = len(a.output().splitlines()) - lines0
    for p in procs:
        p.stdin.close()
        p.wait(30)
    t1 = time.monotonic()
    rc = a.stop()
    stop_s = time.monotonic() - t1
    rows.append((label, f"{rss0:.0f} -> {rss1:.0f}", nfds, f"{libs:.0f} / {uprobes:.0f}", f"{s.ok}/{s.asked}",
                 status, lines, f"{stop_s:.1f} (rc {rc})", f"{took:.1f}",
                 ", ".join(f"{k.strip('{}').replace('budget=', '').replace(',limit=', ' ')} {v:.0f}".replace('"', '')
                           for k, v in refused.items())))


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("run as root: the agent attaches uprobes, the attackers run as nobody")
    os.environ.setdefault("GPUWATCH_BPF_CACHE", tempfile.mkdtemp(prefix="gpuwatch-bpf-cache-"))
    tmp = Path(tempfile.mkdtemp(prefix="gpuwatch-budget-bench-"))
    tmp.chmod(0o755)
    rows: list = []
    try:
        built = _build(tmp)
        lib, attacker = built["lib"], str(tmp / "attacker")
        subprocess.run(["gcc", "-O1", "-o", attacker, str(HERE / "attacker.c"), "-ldl"], check=True)

        def graphs(n: int, users: bool):
            def attack():
                procs = [ready(*as_user(65534 - (i if users else 0)), attacker, "graphs", lib, "4096", "4096")
                         for i in range(n)]
                for p in procs:  # one after another: together they would overflow the ring buffer
                    p.stdin.write("go\n")
                    p.stdin.flush()
                    assert p.stdout.readline().strip() == "done"
                    time.sleep(1.0)  # the agent drains the events
                return procs
            return attack

        for n, users in ((1, False), (8, False), (8, True)):
            a = start(tmp, f"graphs{n}{users}", "--ebpf-library", lib)
            who = f"{n} users" if users else "one user"
            measure(a, f"{n} x graph of 4,096 nodes instantiated 4,096 times ({who})", graphs(n, users), rows)

        copies = tmp / "copies"
        for i in range(600):
            (copies / str(i)).mkdir(parents=True)
            shutil.copy(lib, copies / str(i) / "libcuda.so.1")
        subprocess.run(["chown", "-R", "65534:65534", str(copies)], check=True)
        holder = []

        def loaded():
            return holder

        holder.append(ready(*NOBODY, attacker, "copies", str(copies), "600"))
        a = start(tmp, "copies", "--no-host", nofile=1024)  # the scan at start finds the 600 copies
        measure(a, "600 private copies of libcuda, LimitNOFILE=1024", loaded, rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    head = ("attack", "RSS MiB", "fds", "libraries / uprobes", "scrapes ok", "status", "log lines", "stop s",
            "attack s", "refusals")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


if __name__ == "__main__":
    main()
