"""Issue 17 (4) against a real agent: a connection speaks only for the process that opened it.

An ordinary user's child connects and exits; the parent goes on over the inherited connection.
Its reports were filed under the dead child's PID, and once root's process got that PID,
/metrics and cupti.process showed the attacker's data as root's. Now the agent refuses, says
why, closes the connection, and keeps nothing.
"""
import json
import os
import subprocess
import sys

import pytest

from gpuwatch.agent import control
from tests.conftest import group_agent, spawn_at_pid, wait_for

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
REPORT = {"version": 1, "process": "attacker", "cupti": {"state": "idle"}}

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: plays an ordinary user, reuses a PID")

# Run as nobody. The parent makes the socket, a child connects and exits, the parent sends a
# report over it (at once, or after the test has given the PID to a root process) and prints
# what the agent answered.
INHERITED = r"""
import json, os, socket, sys, time
path, report, wait = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "wait"
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
child = os.fork()
if child == 0:
    s.connect(path)
    os._exit(0)
os.waitpid(child, 0)
print(child, flush=True)
if wait:
    sys.stdin.readline()
report["pid"] = child
s.settimeout(20)  # a loaded 2-core CI machine may take seconds to answer
try:
    s.sendall(json.dumps({"method": "cupti.report", "params": report}).encode() + b"\n")
except OSError as e:
    print("send:", e, file=sys.stderr)  # the agent closed it already
buf = b""
while True:
    try:
        chunk = s.recv(65536)
    except OSError as e:
        print("recv:", e, file=sys.stderr)  # shown when the test fails
        break
    if not chunk:
        break
    buf += chunk
print(json.dumps([json.loads(line) for line in buf.splitlines()]), flush=True)
"""


@pytest.fixture
def agent():
    with group_agent("--no-nvml", "--no-ebpf", "--no-baseline", "--no-otlp", prefix="gw-peer-") as a:
        yield a


def inherited(agent, wait: bool):
    return subprocess.Popen([*NOBODY, sys.executable, "-c", INHERITED, str(agent.socket), json.dumps(REPORT),
                             "wait" if wait else "now"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/")


def gone_counted(agent) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in agent.metrics().splitlines()
               if line.startswith("gpuwatch_control_requests_total{") and 'result="gone"' in line)


def assert_nothing_kept(agent, pid: int) -> None:
    sock = str(agent.socket)
    assert control.call(sock, "cupti.process", {"pid": pid}) is None
    assert [a for a in control.call(sock, "status")["inprocess_agents"] if a["pid"] == pid] == []
    assert f'pid="{pid}"' not in agent.metrics()


def test_a_report_from_a_process_that_has_exited_is_refused_and_the_connection_closed(agent):
    p = inherited(agent, wait=False)
    out, err = p.communicate(timeout=30)
    child, replies = out.splitlines()
    child = int(child)
    assert json.loads(replies) == [{"ok": False, "error": f"the process that opened this connection (pid {child}) "
                                    f"has exited; a connection speaks only for the process that opened it"}], err
    assert_nothing_kept(agent, child)
    assert wait_for(lambda: gone_counted(agent) >= 1, 5)
    assert agent.output().count("gone") == 1  # logged once


def test_a_reused_pid_does_not_make_the_attackers_reports_root_s(agent):
    p = inherited(agent, wait=True)
    child = int(p.stdout.readline())
    root_job = spawn_at_pid(child, ["sleep", "60"], give_up=pytest.fail)  # root's process gets the dead child's PID
    try:
        out, err = p.communicate("go\n", timeout=30)
        replies = json.loads(out)
        assert [r["ok"] for r in replies] == [False] and f"(pid {child}) has exited" in replies[0]["error"], err
        # Root, owner of the process under that PID now, sees no report for it: not the attacker's,
        # and not "belongs to another user".
        assert_nothing_kept(agent, child)
    finally:
        root_job.kill()
        root_job.wait()
