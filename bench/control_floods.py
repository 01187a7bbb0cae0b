"""The agent's footprint under the connection floods of issue 17, on a real agent (NVML replayed).

Measures the agent's RSS, threads and /metrics size idle, then while an ordinary user (uid 65534,
in the socket's group) holds 150 idle control connections and reconnects as fast as it can, then
while 2,000 TCP connections to /metrics stay open without a request; and whether root's
`gpuwatch status` is served meanwhile. The report floods (600 processes x 64 GPUs, forged
timestamps) are measured by tests/e2e/test_report_attacks.py (run it with -s for its numbers).

Usage (repo root, as root): .venv/bin/python bench/control_floods.py [--seconds 10]
Prints one table; numbers go to docs/security.md.
"""
from __future__ import annotations

import argparse
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import FIXTURE, Agent  # noqa: E402

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
HOG = r"""
import socket, sys, time
path, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
held, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    while len(held) < n:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            held.append(s)
        except OSError:
            s.close()
            break
    for s in held[:10]:  # the agent closes idle ones: keep replacing them
        s.close()
    del held[:10]
"""


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            out[key] = int(value.split()[0])
    return out


def metrics_bytes(agent: Agent) -> int:
    try:
        return len(agent.metrics(timeout=5).encode())
    except Exception:  # noqa: BLE001 - refused with 503 during the HTTP flood
        return -1


def sample(agent: Agent, what: str, seconds: float, statuses: list[bool] | None = None) -> dict:
    worst = {"VmRSS": 0, "Threads": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        st = proc_status(agent.proc.pid)
        worst = {k: max(worst[k], st[k]) for k in worst}
        if statuses is not None:
            r = subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "status", "--socket", str(agent.socket)],
                               capture_output=True, timeout=30)
            statuses.append(r.returncode == 0)
        time.sleep(0.2)
    return {"what": what, "rss_mib": round(worst["VmRSS"] / 1024, 1), "threads": worst["Threads"],
            "metrics_bytes": metrics_bytes(agent)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args()
    top = Path(tempfile.mkdtemp(prefix="gw-floods-"))
    top.chmod(0o755)
    agent = Agent(top / "agent", "--nvml-replay", str(FIXTURE), "--no-ebpf", "--socket-group", "65534")
    rows = []
    try:
        agent.metrics()
        time.sleep(2)
        rows.append(sample(agent, "idle", a.seconds))
        hog = subprocess.Popen([*NOBODY, sys.executable, "-c", HOG, str(agent.socket), "150", str(a.seconds + 2)],
                               cwd="/")
        time.sleep(1)
        statuses: list[bool] = []
        row = sample(agent, "150 idle control connections (uid 65534), reconnecting", a.seconds, statuses)
        row["root_status_ok"] = f"{sum(statuses)}/{len(statuses)}"
        rows.append(row)
        hog.wait(30)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
        socks = [socket.create_connection(("127.0.0.1", agent.port), timeout=5) for _ in range(2000)]
        rows.append(sample(agent, "2,000 idle /metrics connections", min(a.seconds, 8.0)))
        for s in socks:
            s.close()
        time.sleep(2)
        rows.append(sample(agent, "after the floods", 2.0))
    finally:
        agent.stop()
    print(f"{'flood':<58} {'RSS MiB':>8} {'threads':>8} {'/metrics B':>11} {'root status':>12}")
    for r in rows:
        mb = r['metrics_bytes'] if r['metrics_bytes'] >= 0 else '503'
        print(f"{r['what']:<58} {r['rss_mib']:>8} {r['threads']:>8} {mb:>11} "
              f"{r.get('root_status_ok', ''):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
