"""Issue 17 (5) against a real agent: one ordinary user cannot crowd everyone else off the control
socket. With 150 idle connections, reconnecting as fast as it can, that user took every slot: 0
of 30 `gpuwatch status` calls by root got through ("too busy"), and other users' in-process
reports failed too. Now the user holds its few slots, root has slots of its own, idle
connections are closed, and the hog is told whose limit it hit.
"""
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import group_agent, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: plays two ordinary users")


def as_user(uid: int) -> tuple[str, ...]:
    return ("setpriv", f"--reuid={uid}", "--regid=65534", "--clear-groups")  # group 65534: the socket's


# 150 connections that never send a request; each one refused or closed is opened again at once,
# until stdin says stop. Prints what it met.
HOG = r"""
import json, select, socket, sys
path = sys.argv[1]
socks, stats, sample = [], {"connects": 0, "busy": 0, "closed": 0, "backlog_full": 0}, ""
print("started", flush=True)
while True:
    while len(socks) < 150:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except OSError:  # the listen backlog is full: read what came back, then try again
            stats["backlog_full"] += 1
            s.close()
            break
        stats["connects"] += 1
        socks.append(s)
    ready, _, _ = select.select(socks + [sys.stdin], [], [], 0.01)
    if sys.stdin in ready:
        break
    for s in ready:
        try:
            data = s.recv(4096)
        except OSError:
            data = b""
        if b"already have" in data:
            stats["busy"] += 1
            sample = sample or json.loads(data)["error"]
        else:
            stats["closed"] += 1
        s.close()
        socks.remove(s)
print(json.dumps(dict(stats, sample=sample)), flush=True)
"""

# Another user's in-process agent: a report a quarter of a second, as `gpuwatch run` sends them.
REPORTER = r"""
import json, sys, time
from gpuwatch.agent.control import ControlError, call
ok, errors = 0, []
for _ in range(int(sys.argv[2])):
    try:
        call(sys.argv[1], "cupti.report", {"version": 1, "cupti": {"state": "idle"}}, timeout=1.0)
        ok += 1
    except ControlError as e:
        errors.append(str(e))
    time.sleep(0.25)
print(json.dumps({"ok": ok, "errors": errors[:3]}), flush=True)
"""


@pytest.fixture
def agent():
    with group_agent("--no-nvml", "--no-ebpf", "--no-baseline", "--no-otlp", prefix="gw-fair-") as a:
        yield a


def counter(text: str, method: str, result: str) -> float:
    want = f'gpuwatch_control_requests_total{{method="{method}",result="{result}"}} '
    return next((float(line[len(want):]) for line in text.splitlines() if line.startswith(want)), 0.0)


def test_one_user_with_150_idle_connections_does_not_lock_out_root_or_other_users(agent):
    sock = str(agent.socket)
    hog = subprocess.Popen([*as_user(65534), sys.executable, "-c", HOG, sock], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    assert hog.stdout.readline() == "started\n", hog.stderr.read()
    time.sleep(1.0)  # the hog has taken what it can
    reporter = subprocess.Popen([*as_user(65533), sys.executable, "-c", REPORTER, sock, "20"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")

    def status(_):
        p = subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "status", "--socket", sock],
                           capture_output=True, text=True, timeout=60)
        return p.returncode, p.stderr.strip()

    try:
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(status, range(30)))
        reported = json.loads(reporter.communicate(timeout=60)[0])
    finally:
        out, err = hog.communicate("stop\n", timeout=30)
    hogged = json.loads(out.splitlines()[-1])
    failures = [e for rc, e in results if rc != 0]
    assert failures == [], failures
    assert len(results) == 30
    assert reported["ok"] == 20, reported
    # The hog kept at it the whole time, and was told whose limit it hit.
    assert hogged["busy"] > 100, hogged
    assert hogged["sample"] == ("you (uid 65534) already have 4 connections open to the gpuwatch agent, "
                                "the most one user may; close one and try again")
    # gpuwatch_control_requests_total, once the next snapshot has it
    # (the reporter may finish after the statuses did: a snapshot with all 30 may lack its last reports)
    wait_for(lambda: counter(t := agent.metrics(), "status", "ok") >= 30 and counter(t, "cupti.report", "ok") >= 20,
             5)
    text = agent.metrics()
    assert counter(text, "status", "ok") >= 30 and counter(text, "cupti.report", "ok") >= 20
    assert counter(text, "none", "busy") >= hogged["busy"] * 0.9
    assert counter(text, "none", "idle") >= 1
    # Logged once, however many times it was refused.
    assert agent.output().count("uid 65534, busy") == 1, agent.output()[-2000:]
    print(f"root status {30 - len(failures)}/30, other user's reports {reported['ok']}/20, hog {hogged}")
